"""Trackers: where a run's metrics go besides its run dir (an experiment tracker such as MLflow).

``RunLogger.log`` is the one funnel for metrics: it writes metrics.jsonl, TensorBoard and the
console, and hands every event to each tracker in its list. A tracker is started once per launch
of a run (with the resolved config, the run's provenance and the step it starts at), logs what the
log point and the evaluator already read on the host (it adds no host sync), and is ended once with
the run's status. Only rank 0 has trackers.

Who makes the trackers ends them: a ``Trainer`` given none makes them (``make_trackers``) and ends
them when ``fit`` returns; the CLI makes its own, so that it ends them after it wrote report.html
and the report reaches the tracker with the final status. A failure inside ``fit`` ends them at
once, FAILED, or KILLED when the run was stopped (a stop signal, Ctrl-C); ``end`` is idempotent.
:class:`TrackRun` is the hook that does all this for a run; a tracker with ``state_dict`` /
``load_state_dict`` has that state in every checkpoint. Torch-free, as ``engine.records.run_log`` is.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Protocol

from visiontrain.core.config import Config, config_to_dict
from visiontrain.core.stop_signals import Preempted
from visiontrain.engine.protocols.hooks import Hook
from visiontrain.engine.records.provenance import Launch, Starting, record_launch
from visiontrain.engine.records.tensorboard import TensorBoardTracker
from visiontrain.rundir import checkpoint_format as fmt

FINISHED, FAILED, KILLED = "FINISHED", "FAILED", "KILLED"


class Tracker(Protocol):
    """What a tracker does (``engine.records.tensorboard.TensorBoardTracker`` and
    ``engine.records.mlflow_tracker.MlflowTracker`` are two). ``packages`` are the distributions whose
    versions the run's provenance records when this tracker is used. Two events are optional:
    ``image(tag, pixels, step)`` for a rendered figure and ``rewind(step)`` when a resumed run
    continues after ``step`` (what was logged after it is dropped)."""

    packages: tuple[str, ...] = ()

    def start(self, config: dict[str, Any], provenance: dict[str, Any], step: int) -> None:
        """At the start of ``fit``: the resolved config (nested), the provenance record (its last
        launch is this one) and the optimizer step the run starts at (0, or a resume's step)."""

    def log(self, kind: str, step: int, epoch: int, values: dict[str, Any]) -> None:
        """One event of ``RunLogger.log`` (kind ``train`` or ``eval``); values may hold non-numbers."""

    def end(self, status: str) -> None:
        """Once: the run's files as they are now, and its status (FINISHED, FAILED or KILLED).
        A second call, or one before ``start``, does nothing."""


def status_of(err: BaseException) -> str:
    """The status a run ends with when ``err`` stopped it: KILLED when it was asked to stop (a
    stop signal: last.pt is written and ``--resume auto`` continues; Ctrl-C), FAILED otherwise."""
    return KILLED if isinstance(err, (Preempted, KeyboardInterrupt)) else FAILED


def start_tracking(trackers: list[Tracker], run_dir: Path, launch: Launch, config: dict[str, Any],
                   starting: Starting) -> None:
    """At the start of ``fit`` on rank 0: this launch appended to provenance.json (with the versions
    of the trackers' packages), then each tracker started with the config, the provenance and the
    step the run starts at."""
    record = record_launch(run_dir, launch, starting, packages=tuple(p for t in trackers for p in t.packages))
    for tracker in trackers:
        tracker.start(config, record, starting.step)


def end_trackers(trackers: list[Tracker], status: str) -> None:
    for tracker in trackers:
        tracker.end(status)


#: Makes a tracker for a run: (config, run dir, experiment name) -> a tracker, or None where the
#: config does not ask for it.
TrackerFactory = Callable[[Config, Path, str], "Tracker | None"]


def _tensorboard(cfg: Config, run_dir: Path, experiment: str) -> Tracker:
    return TensorBoardTracker(run_dir)


#: The tracker backends, in the order they are handed each event: TensorBoard, then each registered
#: one (``engine.records.mlflow_tracker`` registers MLflow's, with the ``logging`` section).
TRACKERS: list[TrackerFactory] = [_tensorboard]


def register_tracker(factory: TrackerFactory) -> TrackerFactory:
    """A tracker backend for every run made from now on (a new file with a ``Tracker`` and this one
    call); returned, so that ``TRACKERS.remove`` can take it out again."""
    TRACKERS.append(factory)
    return factory


def make_trackers(cfg: Config, run_dir: str | Path | None, recipe: str | None = None) -> list[Tracker]:
    """The trackers the config asks for: rank 0's, when there is a run dir (``RANK``, as the
    process group is made later). A tracker whose package is missing, or a bad setting, is a
    ConfigError here, before anything is built or written. ``recipe`` names the default experiment
    (the run dir's name when there is none)."""
    if run_dir is None or os.environ.get("RANK", "0") != "0":
        return []
    experiment = Path(recipe).stem if recipe else Path(run_dir).resolve().name
    made = (factory(cfg, Path(run_dir), experiment) for factory in TRACKERS)
    return [tracker for tracker in made if tracker is not None]


class TrackRun(Hook):
    """This launch in provenance.json and the trackers started, when ``fit`` starts (rank 0 of a run
    with a run dir); the trackers ended FAILED or KILLED when it fails, FINISHED when it returns if
    ``ends`` (the trainer made them). Its state: each tracker's that has one, by class name."""

    name = fmt.TRACKERS

    def __init__(self, trackers: list[Tracker], launch: Launch, *, ends: bool) -> None:
        self.trackers, self.launch, self.ends = trackers, launch, ends

    @property
    def stateful(self) -> dict[str, Any]:
        return {type(t).__name__: t for t in self.trackers if hasattr(t, "state_dict")}

    @property
    def has_state(self) -> bool:
        """Only a run whose trackers keep state has a ``trackers`` entry in its checkpoints."""
        return bool(self.stateful)

    def before_train(self) -> None:
        t = self.trainer
        if t.run.writes:
            starting = Starting(t.step, t.resumed_from, t.dist.world_size, t.run.precision.record())
            start_tracking(self.trackers, t.run.run_dir, self.launch, config_to_dict(t.cfg), starting)

    def after_train(self) -> None:
        if self.ends:
            end_trackers(self.trackers, FINISHED)

    def on_exception(self, err: BaseException) -> None:
        end_trackers(self.trackers, status_of(err))  # FAILED, or KILLED by a stop signal

    def state_dict(self) -> dict[str, Any]:
        return {name: tracker.state_dict() for name, tracker in self.stateful.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, tracker in self.stateful.items():
            if name in state:
                tracker.load_state_dict(state[name])
