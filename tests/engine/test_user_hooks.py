"""``trainer.hooks``: a user's hooks named by import path, periodic on their cadence, in every
checkpoint when they have state; a path that is not a hook is one line and exit 2, nothing written."""
from __future__ import annotations

import pytest

from crashes import Crash, CrashAt
from toy_task import ToyTask, toy_config
from visiontrain.app import cli
from visiontrain.engine.loop.trainer import Trainer
from visiontrain.engine.protocols.hooks import Hook
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.engine.state.checkpoint import load_checkpoint

HOOKS = ["user_hooks_example:LossEveryFour", "user_hooks_example:CountsEvaluations"]



def hooks_of(trainer: Trainer) -> dict[str, Hook]:
    return {type(h).__name__: h for h in trainer.hooks.hooks if type(h).__module__ == "user_hooks_example"}


def test_hooks_named_in_the_config_run_and_resume_where_they_were(tmp_path):
    cfg = toy_config(trainer__hooks=HOOKS, trainer__epochs=3, checkpoint__every=6, checkpoint__unit="steps",
                     schedules__lr={"shape": "cosine"})
    full = Trainer(cfg, ToyTask(cfg), tmp_path / "full")
    full.fit()
    whole = hooks_of(full)
    assert [step for step, _ in whole["LossEveryFour"].seen] == [4, 8, 12, 16, 20, 24]
    assert whole["CountsEvaluations"].evaluations == 3
    cut = Trainer(cfg, ToyTask(cfg), tmp_path / "cut", hooks=[CrashAt(15)])
    with pytest.raises(Crash):
        cut.fit()
    last = tmp_path / "cut" / "checkpoints" / "last.pt"
    saved = fmt.entry(load_checkpoint(last), fmt.HOOKS)
    assert saved["user_hooks_example:LossEveryFour"]["seen"] == [row for row in whole["LossEveryFour"].seen[:3]]
    assert saved["user_hooks_example:CountsEvaluations"] == {"evaluations": 1}
    resumed = Trainer(cfg, ToyTask(cfg), tmp_path / "cut", resume=str(last))
    resumed.fit()
    again = hooks_of(resumed)
    assert again["LossEveryFour"].seen == whole["LossEveryFour"].seen
    assert again["CountsEvaluations"].evaluations == 3


def test_a_hook_the_checkpoint_has_no_state_of_starts_afresh_and_says_so(tmp_path, capsys):
    cfg = toy_config(trainer__max_steps=8, trainer__epochs=2)
    Trainer(cfg, ToyTask(cfg), tmp_path / "run").fit()
    more = toy_config(trainer__epochs=2, trainer__hooks=HOOKS[1:])
    Trainer(more, ToyTask(more), tmp_path / "run", resume=str(tmp_path / "run/checkpoints/last.pt")).fit()
    out = capsys.readouterr().out
    assert f"holds no state of {fmt.HOOKS!r}: it starts afresh" in out
    fewer = toy_config(trainer__epochs=3)
    Trainer(fewer, ToyTask(fewer), tmp_path / "run", resume=str(tmp_path / "run/checkpoints/last.pt")).fit()
    assert f"holds the state of {fmt.HOOKS!r}, which this run has no part for" in capsys.readouterr().out


@pytest.mark.parametrize("path,says", [
    ("user_hooks_example.LossEveryFour", "is not an import path"),
    ("no_such_module_here:Hook", "cannot be imported (ModuleNotFoundError: No module named 'no_such_module_here')"),
    ("user_hooks_example:Missing", "module 'user_hooks_example' has no 'Missing', not a hook"),
    ("user_hooks_example:NotAHook", "'NotAHook' is a type, not a hook"),
    ("user_hooks_example:NeedsArguments", "cannot be built without arguments"),
])
def test_a_path_that_is_not_a_hook_is_one_line_and_nothing_is_written(tmp_path, capsys, path, says):
    run = tmp_path / "run"
    code = cli.main(["fit", "classify-fashion", "data.name=digits", f"trainer.hooks=[{path}]", "--run-dir", str(run)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"visiontrain: error: trainer.hooks: {path!r}") and says in err[0], err[0]
    assert "expected 'package.module:ClassName', a subclass of visiontrain.Hook built without arguments" in err[0]
    assert not run.exists()


class RunIdTracker:
    """A tracker (engine.records.tracking) with state: the id of the run it records into, as an experiment
    tracker's run id; a resumed run goes on recording into the same one."""

    packages = ()

    def __init__(self) -> None:
        self.run_id, self.started_with = None, []

    def start(self, config, provenance, step) -> None:
        self.started_with.append(self.run_id)
        self.run_id = self.run_id or f"run-{step}"

    def log(self, kind, step, epoch, values) -> None:
        pass

    def end(self, status) -> None:
        pass

    def state_dict(self) -> dict:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: dict) -> None:
        self.run_id = state["run_id"]


def test_a_trackers_state_is_in_the_checkpoint_and_resumed(tmp_path):
    cfg = toy_config(trainer__max_steps=8, trainer__epochs=2)
    Trainer(cfg, ToyTask(cfg), tmp_path / "run", trackers=[RunIdTracker()]).fit()
    last = tmp_path / "run" / "checkpoints" / "last.pt"
    assert fmt.entry(load_checkpoint(last), fmt.TRACKERS) == {"RunIdTracker": {"run_id": "run-0"}}
    again, more = RunIdTracker(), toy_config(trainer__epochs=2)
    Trainer(more, ToyTask(more), tmp_path / "run", resume=str(last), trackers=[again]).fit()
    assert again.started_with == ["run-0"] and again.run_id == "run-0"
