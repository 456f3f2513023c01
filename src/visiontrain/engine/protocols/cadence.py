"""When a periodic duty is due: every N optimizer steps or epochs, plus, optionally, at the run's end.

One rule for every part that acts between steps (the log point, the evaluator, the checkpointer,
user hooks): the loop asks after each optimizer step, and once more at an epoch's end. Pure and
host-only: the answer depends on the loop's position alone, so every rank gives the same one and
none of them communicates to find it out.

``at_end`` adds the run's last step (a cadence in epochs: the last epoch's end) to the count's
points: the log point's last window, the evaluator's last epoch, a hook's final record.

At an epoch's last step the loop asks twice: after the step, and at the epoch's end. A part that
measures the finished epoch (``keeps=False``) acts at the first; a part that keeps the run
(``keeps=True``: the checkpointer, the stop check) at the second, after the epoch's own duties, so
that a checkpoint written there resumes at the next epoch and never runs those duties again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Unit = Literal["steps", "epochs"]


@dataclass(frozen=True)
class Cadence:
    every: int = 0          # 0: never by the count (``at_end`` alone)
    unit: Unit = "steps"
    at_end: bool = False    # also after the run's last step (last epoch: its end)

    def __post_init__(self) -> None:
        if self.unit not in ("steps", "epochs"):
            raise ValueError(f"Cadence: unit must be 'steps' or 'epochs', got {self.unit!r}")
        if self.every < 0:
            raise ValueError(f"Cadence: every must be >= 0, got {self.every}")

    def due(self, progress: Any, epoch_end: bool, *, keeps: bool = False) -> bool:
        """Whether the loop's position (``engine.protocols.part.Progress``) is a point of this cadence;
        ``epoch_end``: the call at an epoch's end; ``keeps``: see the module docstring."""
        p = progress
        last = self.at_end and p.step >= p.total
        if self.unit == "epochs":
            return epoch_end and (last or self.every > 0 and p.epochs_done() % self.every == 0)
        hit = last or self.every > 0 and p.step % self.every == 0
        if not hit:
            return False
        if keeps:  # at an epoch's last step: at its end, after the epoch's duties
            return epoch_end or not p.epoch_steps_done()
        return not epoch_end
