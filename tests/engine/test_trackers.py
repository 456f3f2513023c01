"""Trackers are one interface: TensorBoard and MLflow are two backends of ``engine.records.tracking``,
and a backend of one's own is a class and one ``register_tracker`` call (docs/architecture.md,
"Where a new feature goes")."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from toy_task import ToyTask, toy_config
from visiontrain.engine.loop.trainer import Trainer
from visiontrain.engine.records import tracking
from visiontrain.engine.records.tensorboard import TensorBoardTracker
from visiontrain.rundir.run_files import TENSORBOARD_DIR


class Recording:
    """A tracker backend that keeps what it is handed."""

    packages = ()

    def __init__(self, experiment: str) -> None:
        self.experiment, self.events, self.status = experiment, [], None

    def start(self, config: dict[str, Any], provenance: dict[str, Any], step: int) -> None:
        self.events.append(("start", step, config["trainer"]["epochs"]))

    def log(self, kind: str, step: int, epoch: int, values: dict[str, Any]) -> None:
        self.events.append((kind, step))

    def end(self, status: str) -> None:
        self.status = status


@pytest.fixture
def recording():
    made: list[Recording] = []
    # taken out again after the test (tests/support/registries.py)
    tracking.register_tracker(lambda cfg, run_dir, experiment: made.append(Recording(experiment)) or made[-1])
    return made


def test_a_registered_backend_gets_every_event_of_a_run(tmp_path, recording):
    cfg = toy_config(trainer__epochs=2, trainer__log_every=4)
    trainer = Trainer(cfg, ToyTask(cfg), tmp_path / "run")
    trainer.fit()
    (backend,) = recording
    assert backend.experiment == "run" and backend.status == tracking.FINISHED
    assert backend.events[0] == ("start", 0, 2)
    train_steps = [event[1] for event in backend.events if event[0] == "train"]
    assert train_steps and train_steps[-1] == trainer.step
    assert any(event[0] == "eval" for event in backend.events)
    assert any((tmp_path / "run" / TENSORBOARD_DIR).iterdir())  # the built-in backend beside it


def test_no_backend_off_rank_zero_or_without_a_run_dir(tmp_path, monkeypatch, recording):
    cfg = toy_config()
    assert tracking.make_trackers(cfg, None) == []
    monkeypatch.setenv("RANK", "1")
    assert tracking.make_trackers(cfg, tmp_path) == []
    monkeypatch.setenv("RANK", "0")
    kinds = [type(t) for t in tracking.make_trackers(cfg, tmp_path)]
    assert kinds == [TensorBoardTracker, Recording]  # MLflow only when logging.mlflow asks for it


def test_tensorboard_rewound_shows_each_step_once(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = TensorBoardTracker(tmp_path)
    for step in (1, 2, 3):
        tb.log("train", step, 0, {"total": 1.0, "note": "text is not a scalar"})
    tb.rewind(2)  # a resume from the checkpoint at step 2: step 3 is logged again
    tb.log("train", 3, 0, {"total": 0.5})
    tb.end(tracking.FINISHED)
    events = EventAccumulator(str(Path(tmp_path) / TENSORBOARD_DIR)).Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/total")] == [(1, 1.0), (2, 1.0), (3, 0.5)]
    assert events.Tags()["scalars"] == ["train/total"]


def test_tensorboard_writes_a_rows_scalars_as_one_event_with_the_same_values(tmp_path):
    """One event a row (the writer's queue is the cost of a long run), and TensorBoard reads every
    scalar under the same tag, step and value as when each had its own event."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    rows = [(step, {"total": 1.0 / step, "lr": 0.1 * step, "skipped_steps": step, "note": "text"})
            for step in (1, 2, 3)]
    tb = TensorBoardTracker(tmp_path)
    for step, values in rows:
        tb.log("train", step, 0, values)
    tb.log("eval", 3, 0, {"top1": 91.5, "flag": True})
    tb.end(tracking.FINISHED)
    logdir = Path(tmp_path) / TENSORBOARD_DIR
    (events_file,) = logdir.glob("events.out.tfevents.*")
    with_values = [e for e in EventFileLoader(str(events_file)).Load() if e.HasField("summary")]
    assert [(e.step, len(e.summary.value)) for e in with_values] == [(1, 3), (2, 3), (3, 3), (3, 1)]
    events = EventAccumulator(str(logdir)).Reload()
    assert sorted(events.Tags()["scalars"]) == ["eval/top1", "train/lr", "train/skipped_steps", "train/total"]
    for key in ("total", "lr", "skipped_steps"):
        expected = [(step, pytest.approx(values[key])) for step, values in rows]
        assert [(e.step, e.value) for e in events.Scalars(f"train/{key}")] == expected
    assert [(e.step, e.value) for e in events.Scalars("eval/top1")] == [(3, 91.5)]
