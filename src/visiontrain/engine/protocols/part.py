"""The loop's position, and the parts that act between its steps.

The trainer's loop only steps. After each optimizer step it asks each part, in order, whether it is
due (``Part.due``: pure and host-only, never a collective) and runs those that are. The parts of a
run are an open, ordered list (``engine.loop.assembly``): the log point, the evaluator, the
checkpointer and the stop check are parts, and so is anything registered there or given as a hook
with a ``cadence``. A part with state (``state_dict`` / ``load_state_dict``) is in every checkpoint
under its ``name``. A new periodic duty is a new part, not a new branch in the loop.
"""
from __future__ import annotations

import time
from typing import Any

from visiontrain.engine.optim.schedules import StepClock
from visiontrain.engine.protocols.hooks import Hook


class Part(Hook):
    """A duty between optimizer steps. As a hook it also receives the events (``after_eval``...).

    At an epoch's end the parts that measure the finished epoch run first, while ``Progress.epoch``
    still names it; the epoch then moves on, and the parts that keep the run (``keeps``: the
    checkpointer, the stop check) run after, so a checkpoint written there resumes at the next
    epoch's first step (see ``engine.protocols.cadence``)."""

    name: str = ""          # trainer.parts[name]; its entry in the checkpoint when it has state
    keeps: bool = False

    def due(self, step: int, epoch_end: bool) -> bool:
        """Whether to run after optimizer step ``step`` (``epoch_end``: the call at an epoch's end).
        Cheap, host-only and the same on every rank: asked after every step. By default the
        ``cadence``'s answer."""
        return self.cadence is not None and self.cadence.due(self.trainer.progress, epoch_end, keeps=self.keeps)

    def run(self, epoch_end: bool = False) -> None:
        """The duty itself; may read the device (each such line is marked ``# host sync``)."""
        self.periodic()

    def start(self) -> None:
        """Once per launch, after the ``before_train`` hooks and before the first step."""

    def finish(self) -> dict[str, Any] | None:
        """Once, after the last step, before the ``after_train`` hooks; what it returns goes into the
        summary ``fit`` returns."""
        return None

    def summary(self) -> dict[str, Any]:
        """The keys this part adds to RUN_DIR/summary.json: what it measured over the whole run (a
        resumed run's earlier launches included, through its state). The checkpointer asks every
        part at the run's end and writes the file; a new measure is a key of its own part, not a
        line in the checkpointer."""
        return {}


class PeriodicHook(Part):
    """A hook with a ``cadence`` (a user's, a task's) as a part: its ``periodic()`` runs when due."""

    def __init__(self, hook: Hook) -> None:
        self.hook, self.cadence = hook, hook.cadence
        self.name = f"{type(hook).__module__}:{type(hook).__qualname__}"

    def run(self, epoch_end: bool = False) -> None:
        self.hook.periodic()


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
        self.trained_s = 0.0                    # this launch's seconds in the loop, set when it ends
        self.data_s = 0.0                       # seconds waiting for batches since the log point read it
        self.evaluating = False                 # for an out-of-memory message: what ran out
        self.ended_early: dict[str, str] | None = None  # {"reason", "message"}: a part ended the run

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
        """Every step trained, or a part ended the run early (early stopping)."""
        return self.epoch >= self.epochs or self.step >= self.total or self.ended_early is not None

    def start(self) -> None:
        """The loop of this launch starts: its wall time counts from here."""
        self.started = time.perf_counter()

    def advance(self) -> None:
        self.step += 1
        self.step_in_epoch += 1

    def next_epoch(self) -> None:
        self.epoch, self.step_in_epoch = self.epoch + 1, 0

    def end_early(self, reason: str, message: str) -> None:
        """A part's decision that the loop ends now (after this step's keeping parts), and why."""
        self.ended_early = {"reason": reason, "message": message}

    def end_reason(self, max_steps: int | None) -> dict[str, str]:
        """Why the run ended, for summary.json: a part's decision, ``trainer.max_steps`` or all its epochs."""
        if self.ended_early is not None:
            return dict(self.ended_early)
        if max_steps is not None and self.step >= max_steps and self.epoch < self.epochs:
            return {"reason": "max_steps", "message": f"trainer.max_steps={max_steps} reached in epoch {self.epoch}"}
        return {"reason": "epochs", "message": f"trained trainer.epochs={self.epochs} epochs"}

    def wall_s(self) -> float:
        return self.wall_before + time.perf_counter() - self.started

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "wall_s": self.wall_s()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.epoch, self.step_in_epoch = int(state["step"]), int(state["epoch"]), int(state["step_in_epoch"])
        self.wall_before = float(state.get("wall_s", 0.0))
