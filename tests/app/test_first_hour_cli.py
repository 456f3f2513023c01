"""A user's first hour with the command line: refusals in one line that lose nothing, run dirs that
never mix two runs, a resume that says what changed, and the small things (`--version`, help).

The fit commands run in this process (`cli.main`): these tests are about the command line's
decisions, not about training, and a process per command would triple their time. They train
classify-fashion on the 8x8 digits for a few steps, loaded in-process as the recipe ships it.
"""
from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from visiontrain.app import cli

from visiontrain.core import config as C
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.engine.state.checkpoint import load_checkpoint

DIGITS = ["classify-fashion", "data.name=digits", "trainer.progress=plain", "eval.every=0", "trainer.plots=false"]


def fit(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["fit", *args])
    out, err = capsys.readouterr()
    return code, out, err


def errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("visiontrain: error:")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_a_config_error(capsys, tmp_path):
    code, _, err = fit(capsys, *DIGITS, "trainer.device=cuda", "--run-dir", str(tmp_path / "run"))
    assert code == 2 and errors(err) == [errors(err)[0]], err
    assert errors(err)[0].startswith("visiontrain: error: trainer.device=cuda: CUDA is not available here")
    code, _, err = fit(capsys, *DIGITS, "trainer.device=gpu", "--run-dir", str(tmp_path / "run"))
    assert code == 2 and "trainer.device=gpu: not a device; expected auto, cpu, cuda or cuda:N" in err
    assert not (tmp_path / "run").exists()


def test_a_dir_left_by_a_crashed_attempt_is_refused_or_set_aside(capsys, tmp_path):
    """No last.pt, but the logs of an attempt that crashed before its first checkpoint: a new run
    is refused (its rows would mix with the old ones); --resume auto sets them aside and starts."""
    run = tmp_path / "run"
    (run / "tb").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 7, "epoch": 0, "total": 9.0}\n')
    (run / "config.yaml").write_text("seed: 123\n")
    code, _, err = fit(capsys, *DIGITS, "trainer.max_steps=2", "--run-dir", str(run))
    assert code == 2 and "holds an earlier run that wrote no checkpoint (config.yaml, metrics.jsonl, tb)" in err
    assert (run / "config.yaml").read_text() == "seed: 123\n" and len((run / "metrics.jsonl").read_text()) == 55

    code, _, err = fit(capsys, *DIGITS, "trainer.max_steps=2", "--run-dir", str(run), "--resume", "auto")
    assert code == 0, err
    aside = next(run.glob("attempt-without-checkpoint-*"))
    assert f"starting a new run; the files of the earlier attempt (config.yaml, metrics.jsonl, tb) are now in " \
           f"{aside}" in err
    assert (aside / "config.yaml").read_text() == "seed: 123\n"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert 7 not in steps and max(steps) == 2


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """--resume auto on a new dir, then again with a changed config."""
    run = tmp_path_factory.mktemp("resume") / "run"
    first = cli.main(["fit", *DIGITS, "trainer.max_steps=2", "--run-dir", str(run), "--resume", "auto"])
    wall_first = json.loads((run / "summary.json").read_text())["wall_s"]
    with contextlib.redirect_stdout(io.StringIO()) as out:  # a module fixture cannot take capsys
        second = cli.main(["fit", *DIGITS, "trainer.max_steps=4", "optim.lr=0.01", "--run-dir", str(run),
                           "--resume", "auto"])
    return run, first, second, wall_first, out.getvalue()


def test_resume_auto_on_a_new_dir_says_it_starts_a_new_run(capsys, tmp_path):
    code, _, err = fit(capsys, *DIGITS, "trainer.max_steps=1", "--run-dir", str(tmp_path / "typo"), "--resume", "auto")
    assert code == 0 and f"visiontrain: no checkpoint in {tmp_path / 'typo' / 'checkpoints'}: starting a new run" in err


def test_resume_with_a_changed_config_says_what_changed_and_keeps_each_config(resumed, capsys):
    run, first, second, wall_first, printed = resumed
    assert first == second == 0
    changed = [line.split(" ", 2)[2] for line in printed.splitlines() if "config changed" in line]  # after the time
    assert changed == ["config changed since the checkpoint: optim.lr: 0.003 -> 0.01",
                       "config changed since the checkpoint: trainer.max_steps: 2 -> 4"], printed[-2000:]
    old = C.load_config(str(run / "config-2.yaml"))  # the config of the segment that ended at step 2
    new = C.load_config(str(run / "config.yaml"))
    assert (old.trainer.max_steps, old.optim.lr) == (2, 0.003) and (new.trainer.max_steps, new.optim.lr) == (4, 0.01)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["wall_s"] > wall_first  # both segments' training time


def test_every_command_takes_a_run_dir_where_it_takes_a_checkpoint(resumed, capsys, tmp_path):
    run = resumed[0]
    assert cli.main(["export", str(run), "--format", "torchscript", "--out", str(tmp_path / "m.pt")]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"] == str(run / "checkpoints" / "best.pt")  # else last.pt
    code, out, err = fit(capsys, *DIGITS, "trainer.max_steps=1", "--init", str(run), "--run-dir", str(tmp_path / "b"))
    assert code == 0, err
    code, out, err = fit(capsys, *DIGITS, "trainer.max_steps=5", "--resume", str(run), "--run-dir", str(tmp_path / "c"))
    assert code == 0 and f"resumed from {run / 'checkpoints' / 'last.pt'} at step 4" in out, err
    assert fmt.step_of(load_checkpoint(tmp_path / "c" / "checkpoints" / "last.pt")) == 5
    assert cli.main(["export", str(tmp_path / "nothing-here"), "--format", "onnx"]) == 2
    assert "nothing-here does not exist; give a checkpoint file or a run dir" in capsys.readouterr().err


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.image_size=640"], "data.image_size=640: task 'yolo' does not read it; its input sizes are task.size, "
                              "task.val_size and task.multiscale_sizes"),
    (["data.augment=imagenet"], "data.augment=imagenet: task 'yolo' does not read it; its augmentation is GluonCV's"),
])
def test_keys_a_task_does_not_read_are_refused_with_the_ones_it_does(overrides, message):
    with pytest.raises(C.ConfigError, match=r"^command line \(over detect-yolov3.yaml\): " + message.replace(
            "(", r"\(").replace(")", r"\)")):
        C.load_config("detect-yolov3", overrides)
    saved = C.config_to_dict(C.load_config("detect-yolov3"))  # every key, at its default: still a valid config
    assert C.config_from_dict(saved).task.name == "yolo"


def test_errors_say_where_the_key_came_from_and_rank_suggestions(tmp_path):
    with pytest.raises(C.ConfigError, match=r"^command line \(over classify-fashion.yaml\): unknown config key "
                                            r"'trainer.max_step'; did you mean trainer.max_steps,"):
        C.load_config("classify-fashion", ["trainer.max_step=3"])
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("task: {name: detr, num_querys: 3}\n")
    with pytest.raises(C.ConfigError, match=rf"^{recipe}: unknown config key 'task.num_querys'; did you mean "
                                            r"task.num_queries,"):
        C.load_config(str(recipe))


def test_an_unknown_dataset_name_gets_a_did_you_mean(capsys, tmp_path):
    code, _, err = fit(capsys, *DIGITS, "data.name=imagefolder", "--run-dir", str(tmp_path / "run"))
    assert code == 2 and "data.name: unknown dataset 'imagefolder' (did you mean 'image-folder'?)" in err
    assert not (tmp_path / "run").exists()  # a refused command leaves no empty directory


def test_version_help_defaults_and_positional_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("visiontrain ")
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, command in sub.choices.items():
        for action in command._actions:
            assert action.help, f"{name} {action.dest}: no help text"
    with pytest.raises(SystemExit):
        cli.main(["benchmark", "--help"])
    assert "timed optimizer steps (default: 20)" in " ".join(capsys.readouterr().out.split())


def test_show_config_docs_columns_stay_aligned(capsys):
    assert cli.main(["show-config", "detect-yolov3", "--docs"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    starts = {len(line) - len(line[line.index("  "):].lstrip()) for line in rows}  # where column 2 starts
    assert len(starts) == 1, sorted(starts)
