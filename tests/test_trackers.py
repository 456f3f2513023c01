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
from visiontrain.engine.state.run_files import TENSORBOARD_DIR


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
    factory = tracking.register_tracker(lambda cfg, run_dir, experiment: made.append(Recording(experiment))
                                        or made[-1])
    yield made
    tracking.TRACKERS.remove(factory)


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
