"""The loop's position, and the shape of the parts that act between steps.

The trainer's loop only steps. After each step it asks each part whether it is due: the log point,
the evaluator, the checkpointer and the stop check each own their cadence (``due``), their state
(``state_dict`` / ``load_state_dict``, composed by the checkpointer) and their host syncs. A new
periodic duty is a new part, not a new branch in the loop.
"""
from __future__ import annotations

import time
from typing import Any, Protocol

from visiontrain.engine.schedules import StepClock


class Part(Protocol):
    def due(self, step: int, epoch_end: bool) -> bool:
        """Whether to run after optimizer step ``step`` (``epoch_end``: the epoch's steps are all done).
        Cheap and host-only: asked after every step."""

    def run(self, epoch_end: bool = False) -> Any:
        """The duty itself; may read the device (each such line is marked ``# host sync``)."""


class Progress:
    """Where the run is: optimizer steps done, the epoch, and the steps done in it; the wall time.

    At an epoch's end the measuring parts (log point, evaluator) run while ``epoch`` still names the
    finished epoch; :meth:`next_epoch` then moves on, and the keeping parts (checkpointer, stop
    check) run after it, so a checkpoint written there resumes at the next epoch's first step.
    At the epoch's last step the keeping parts wait for that end: a checkpoint written before the
    end duties would make a resume run them, and log them, a second time."""

    def __init__(self, clock: StepClock, epochs: int) -> None:
        self.clock, self.epochs = clock, epochs
        self.step = self.epoch = self.step_in_epoch = 0
        self.wall_before = 0.0                  # training seconds of earlier segments of a resumed run
        self.started = time.perf_counter()

    @property
    def total(self) -> int:
        return self.clock.total_steps

    def epoch_steps_done(self) -> bool:
        return self.step_in_epoch >= self.clock.steps_in_epoch(self.epoch)

    def epochs_done(self) -> int:
        """Epochs completed: the same number before and after :meth:`next_epoch` at an epoch's end."""
        return self.epoch + int(self.epoch_steps_done())

    def last_epoch_done(self) -> bool:
        return self.epochs_done() >= self.epochs or self.step >= self.total

    def finished(self) -> bool:
        return self.epoch >= self.epochs or self.step >= self.total

    def advance(self) -> None:
        self.step += 1
        self.step_in_epoch += 1

    def next_epoch(self) -> None:
        self.epoch, self.step_in_epoch = self.epoch + 1, 0

    def wall_s(self) -> float:
        return self.wall_before + time.perf_counter() - self.started

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "wall_s": self.wall_s()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch, self.step_in_epoch = int(state["step"]), int(state["epoch"]), int(state["step_in_epoch"])
        self.wall_before = float(state.get("wall_s", 0.0))
