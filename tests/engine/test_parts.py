"""The parts of the loop: one cadence rule, no collective in a ``due``, an open list a part joins by
one registration, and a training source the loop knows only by its interface."""
from __future__ import annotations

import ast
import itertools
import json
from pathlib import Path
from typing import Any, Iterator

import example_part
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset
from crashes import Crash, CrashAt
from toy_task import ToyData, ToyTask, toy_config

from visiontrain.core import config as C
from visiontrain.engine.loop.trainer import Trainer
from visiontrain.engine.protocols.cadence import Cadence
from visiontrain.engine.protocols.part import Progress
from visiontrain.engine.protocols.task import TaskData
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.engine.state.checkpoint import load_checkpoint
from visiontrain.engine.optim.schedules import StepClock

ENGINE = Path(__file__).resolve().parents[2] / "src" / "visiontrain" / "engine"




# ---------------------------------------------------------------------------- the cadence
# The rules as the log point, the evaluator and the checkpointer each wrote them before there was
# one Cadence (commit 22eb1c6 and after): the one rule must give the same answers.
def old_log_point(p: Progress, epoch_end: bool, every: int) -> bool:
    return epoch_end or p.step % every == 0 or p.step == p.total


def old_evaluator(p: Progress, epoch_end: bool, every: int, unit: str) -> bool:
    if epoch_end:
        return unit == "epochs" and (p.last_epoch_done() or (every > 0 and p.epochs_done() % every == 0))
    return unit == "steps" and every > 0 and p.step % every == 0 and p.step < p.total


def old_checkpointer(p: Progress, epoch_end: bool, every: int, unit: str) -> bool:
    if every <= 0 or p.step >= p.total:
        return False
    if epoch_end:
        return (unit == "epochs" and not p.last_epoch_done() and p.epochs_done() % every == 0) or \
            (unit == "steps" and p.step % every == 0)
    return unit == "steps" and p.step % every == 0 and not p.epoch_steps_done()


def positions(clock: StepClock, epochs: int) -> Iterator[tuple[Progress, bool, bool]]:
    """(progress, epoch_end, keeps) as the loop asks its parts: after each step, then at an epoch's
    end the measuring parts, the epoch's turn, the keeping parts."""
    p = Progress(clock, epochs)
    while not p.finished():
        while not p.epoch_steps_done() and not p.finished():
            p.advance()
            yield p, False, False
            yield p, False, True
        if not p.epoch_steps_done():
            return
        yield p, True, False
        p.next_epoch()
        yield p, True, True


# (clock, epochs) as engine.setup.make_clock makes them: all epochs, max_steps mid-epoch or at an
# epoch's end, accumulation switched on from epoch 2
CLOCKS = [(StepClock(8, 24), 3), (StepClock(8, 20), 3), (StepClock(8, 16), 3), (StepClock(3, 9), 3),
          (StepClock(5, 14, change_epoch=2, steps_per_epoch_after=2), 4), (StepClock(1, 4), 4)]


@pytest.mark.parametrize("clock,epochs", CLOCKS)
def test_one_cadence_gives_what_each_part_decided_on_its_own(clock, epochs):
    for every, unit in itertools.product([0, 1, 2, 3, 4, 8], ["steps", "epochs"]):
        for p, epoch_end, keeps in positions(clock, epochs):
            where = (every, unit, p.step, p.epoch, epoch_end, keeps)
            if not keeps:
                if every:
                    logs = epoch_end or Cadence(every, "steps", at_end=True).due(p, epoch_end)
                    assert logs == old_log_point(p, epoch_end, every), where
                evals = Cadence(every, unit, at_end=unit == "epochs").due(p, epoch_end) and not (
                    unit == "steps" and p.step >= p.total)
                assert evals == old_evaluator(p, epoch_end, every, unit), where
            else:
                keeps = p.step < p.total and Cadence(every, unit).due(p, epoch_end, keeps=True)
                assert keeps == old_checkpointer(p, epoch_end, every, unit), where


def test_the_parts_use_the_cadence_of_their_keys(tmp_path):
    cfg = toy_config(trainer__log_every=3, eval__every=5, eval__unit="steps", checkpoint__every=2)
    t = Trainer(cfg, ToyTask(cfg), tmp_path / "run")
    assert t.log_point.cadence == Cadence(3, "steps", at_end=True)
    assert t.evaluator.cadence == Cadence(5, "steps", at_end=False)
    assert t.checkpointer.cadence == Cadence(2, "epochs") and t.checkpointer.keeps
    assert [type(p).__name__ for p in t._measure] == ["LogPoint", "Evaluator"]
    assert [type(p).__name__ for p in t._keep] == ["Checkpointer", "StopCheck"]


def test_no_due_runs_a_collective(tmp_path, monkeypatch):
    """Whether a part is due is decided on the host, the same on every rank: a ``due`` that ran a
    collective (the stop check's all-reduce once did) would hang ranks that disagree on asking."""
    cfg = toy_config(trainer__log_every=2)
    t = Trainer(cfg, ToyTask(cfg), None)
    t.stop.distributed = True  # as under torchrun: the stop check agrees at log points

    def collective(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a collective inside due()")

    for name in ("all_reduce", "broadcast", "broadcast_object_list", "all_gather", "barrier"):
        monkeypatch.setattr(torch.distributed, name, collective)
    asked = 0
    for p, epoch_end, keeps in positions(t.clock, cfg.trainer.epochs):
        t.progress.step, t.progress.epoch, t.progress.step_in_epoch = p.step, p.epoch, p.step_in_epoch
        for part in t._keep if keeps else t._measure:
            part.due(p.step, epoch_end)
            asked += 1
    assert asked > 50 and t.stop.due(4, False)  # a log point: the stop check runs (and agrees) there


def test_the_loop_names_no_optional_part_and_no_data_format():
    """Early stopping, trackers, plots, the first look and the profiler are parts or hooks of the
    list in engine.loop.assembly; the trainer and the checkpointer name none of them, nor the sampler."""
    optional = {"early_stop", "EarlyStopping", "tracking", "TrackRun", "make_trackers", "start_tracking", "end_trackers",
                "plots", "PlotHook", "first_look", "FirstLook", "profiling", "ProfileSteps", "sampler", "train_loader",
                "ResumableBatchSampler", "LoaderSource"}
    for module, banned in (("loop/trainer.py", optional | {"LogPoint", "Evaluator", "StopCheck", "StopFlag", "preemption"}),
                           ("parts/checkpointer.py", optional | {"LogPoint", "rng", "capture_rng", "RngState",
                                                           "restore_rng", "scaler", "early_stop"})):
        tree = ast.parse((ENGINE / module).read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        names |= {n.module.rsplit(".", 1)[-1] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not names & banned, f"{module} names {sorted(names & banned)}"


# ---------------------------------------------------------------------------- a new part
@pytest.fixture
def weight_trail():
    example_part.register()  # taken out again after the test (tests/support/registries.py)


def test_a_registered_part_runs_on_its_cadence_and_resumes_where_it_was(tmp_path, weight_trail):
    """tests/support/example_part.py and one registration: the part runs every 3 steps, its record is in the
    checkpoint under its name, and a run killed and resumed ends with the record of the run that
    was not (the steps before the kill come from the checkpoint)."""
    cfg = toy_config(trainer__epochs=2, checkpoint__every=4, checkpoint__unit="steps")
    full = Trainer(cfg, ToyTask(cfg), tmp_path / "full")
    full.fit()
    assert [s for s, _ in full.weight_trail.trail] == [3, 6, 9, 12, 15, 16]
    crashed = Trainer(cfg, ToyTask(cfg), tmp_path / "cut", hooks=[CrashAt(10)])
    with pytest.raises(Crash):
        crashed.fit()
    last = load_checkpoint(tmp_path / "cut" / "checkpoints" / "last.pt")
    assert fmt.entry(last, "weight_trail")["steps"] == [3, 6]  # written at step 8
    resumed = Trainer(cfg, ToyTask(cfg), tmp_path / "cut", resume=str(tmp_path / "cut" / "checkpoints" / "last.pt"))
    resumed.fit()
    assert resumed.weight_trail.trail == full.weight_trail.trail
    for run in ("full", "cut"):  # the part's own key of summary.json, the records before the kill counted
        assert json.loads((tmp_path / run / "summary.json").read_text())["weight_trail_records"] == 6


def test_a_part_s_own_section_is_set_by_a_recipe_and_an_override_listed_and_checked(tmp_path, weight_trail):
    """The part's dataclass, registered with it from its own file, is a section of every recipe: a
    recipe sets it, an override changes it, show-config --docs lists it, a mistyped key in it gets
    a suggestion, and the run records on the cadence it sets, in its checkpoint too."""
    recipe = tmp_path / "trail.yaml"
    recipe.write_text("task: {name: toy}\ndata: {batch_size: 32}\noptim: {name: sgd, lr: 0.05}\n"
                      "trainer: {epochs: 2, log_every: 4, progress: plain}\nweight_trail: {every: 5}\n")
    assert C.load_config(str(recipe)).weight_trail.every == 5
    cfg = C.load_config(str(recipe), ["weight_trail.every=4"])
    assert cfg.weight_trail == example_part.WeightTrailConfig(every=4)
    docs = {key: text for key, _, text in C.describe_keys(cfg)}
    assert docs["weight_trail"] == example_part.WEIGHT_TRAIL_DOC and "between two records" in docs["weight_trail.every"]
    assert "weight_trail:\n  every: 4\n" in C.dump_config(cfg)
    with pytest.raises(C.ConfigError, match=r"unknown config key 'weight_trail.evry'; did you mean weight_trail.every"):
        C.load_config(str(recipe), ["weight_trail.evry=4"])
    with pytest.raises(C.ConfigError, match=r"weight_trail.every: expected an integer >= 1, got 0"):
        C.load_config(str(recipe), ["weight_trail.every=0"])
    run = Trainer(cfg, ToyTask(cfg), tmp_path / "run")
    run.fit()
    assert [s for s, _ in run.weight_trail.trail] == [4, 8, 12, 16]
    last = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")
    assert fmt.entry(last, "weight_trail")["steps"] == [4, 8, 12, 16]
    assert fmt.config_of(last)["weight_trail"] == {"every": 4}


def test_a_part_added_since_the_checkpoint_starts_afresh_and_says_so(tmp_path, capsys):
    cfg = toy_config(trainer__epochs=2, trainer__max_steps=8)
    Trainer(cfg, ToyTask(cfg), tmp_path / "run").fit()
    example_part.register()  # taken out again after the test (tests/support/registries.py)
    longer = toy_config(trainer__epochs=2)
    resumed = Trainer(longer, ToyTask(longer), tmp_path / "run", resume=str(tmp_path / "run/checkpoints/last.pt"))
    resumed.fit()
    assert "holds no state of 'weight_trail': it starts afresh" in capsys.readouterr().out
    assert [s for s, _ in resumed.weight_trail.trail] == [9, 12, 15, 16]


# ---------------------------------------------------------------------------- a training source
class ToyStream(IterableDataset):
    """A plain iterable stream: the toy samples of one epoch, in an order drawn from (seed, epoch),
    with noise drawn as they go; no length, no index, read front to back."""

    def __init__(self, data: ToyData, seed: int, epoch: int) -> None:
        self.data, self.seed, self.epoch = data, seed, epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.seed * 7919 + self.epoch)
        for i in torch.randperm(len(self.data.x), generator=g).tolist():
            yield self.data.x[i] + 0.01 * torch.randn(self.data.x.shape[1:], generator=g), self.data.y[i], torch.tensor(i)


class StreamSource:
    """A ``TrainSource`` over a stream: a resumed epoch reads its stream again from the start and
    skips the batches already trained, which gives exactly the batches that followed them."""

    def __init__(self, data: ToyData, batch_size: int, seed: int) -> None:
        self.data, self.batch_size, self.seed = data, batch_size, seed
        self.batches_per_epoch = len(data.x) // batch_size

    def _loader(self, epoch: int) -> DataLoader:
        # a private generator: an iterator made mid-epoch (a resume) draws nothing from the global RNG
        return DataLoader(ToyStream(self.data, self.seed, epoch), batch_size=self.batch_size, drop_last=True,
                          generator=torch.Generator())

    def batches(self, epoch: int, start_batch: int = 0) -> Iterator[Any]:
        return itertools.islice(iter(self._loader(epoch)), start_batch, None)

    def first_items(self, limit: int | None = None) -> list[Any]:
        return list(itertools.islice(iter(ToyStream(self.data, self.seed, 0)), limit or self.batch_size))

    def collate(self, items: list[Any]) -> Any:
        return self._loader(0).collate_fn(items)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])

    def close(self) -> None:
        pass


class StreamToyTask(ToyTask):
    def build_data(self) -> TaskData:
        data = super().build_data()
        data.train = StreamSource(data.train, self.cfg.data.batch_size, seed=self.cfg.seed + 11)
        return data


def test_a_stream_source_trains_and_resumes_exactly(tmp_path):
    cfg = toy_config(trainer__epochs=3, task__dropout=0.2, checkpoint__every=5, checkpoint__unit="steps")
    full = Trainer(cfg, StreamToyTask(cfg), tmp_path / "full")
    full.fit()
    assert full.step == 3 * 8 and isinstance(full.run.source, StreamSource)
    crashed = Trainer(cfg, StreamToyTask(cfg), tmp_path / "cut", hooks=[CrashAt(12)])
    with pytest.raises(Crash):
        crashed.fit()
    last = tmp_path / "cut" / "checkpoints" / "last.pt"
    assert fmt.entry(load_checkpoint(last), fmt.DATA) == {"seed": cfg.seed + 11}
    resumed = Trainer(cfg, StreamToyTask(cfg), tmp_path / "cut", resume=str(last))
    assert (resumed.step, resumed.epoch, resumed.step_in_epoch) == (10, 1, 2)  # mid-epoch
    resumed.fit()
    for (name, a), b in zip(full.raw_model.state_dict().items(), resumed.raw_model.state_dict().values()):
        assert torch.equal(a, b), name
