"""TensorBoard as a tracker: every number a run logs as a scalar (``train/<key>``, ``eval/<key>``)
and every figure as an image, in ``RUN_DIR/tb/``; rank 0 of a run with a run dir, as every tracker.

The writer opens an events file as it is made, so it is made at the first event: a run that logs
nothing (a resume of a finished run) leaves ``tb/`` as it was. A resume rewinds it to the step it
continues from: the next writer hides what the old one wrote after that step (``purge_step``), so
each step is shown once, as in metrics.jsonl. Torch-free at import (the writer is torch's).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from visiontrain.rundir.run_files import TENSORBOARD_DIR


class TensorBoardTracker:
    """A ``Tracker`` (``engine.records.tracking``) with two more events: ``image`` and ``rewind``."""

    packages = ("tensorboard",)

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / TENSORBOARD_DIR
        self._writer: Any = None
        self._purge: int | None = None

    def start(self, config: dict[str, Any], provenance: dict[str, Any], step: int) -> None:
        """Nothing to record at the start: the config and provenance are the run dir's own files."""

    def log(self, kind: str, step: int, epoch: int, values: dict[str, Any]) -> None:
        """A row's scalars as one event (what ``add_scalar`` writes, each value its own tag): an event
        a scalar queued 14 events a log point for the writer's thread, and a long run spent more time
        waiting on that queue than writing (27 s against 3 s for the rows of a 1,000,000-step run)."""
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard.summary import scalar

        scalars = [v for key, value in values.items() if isinstance(value, (int, float)) and not isinstance(value, bool)
                   for v in scalar(f"{kind}/{key}", value).value]
        if scalars:
            self.writer().file_writer.add_summary(Summary(value=scalars), step)

    def image(self, tag: str, pixels: Any, step: int) -> None:
        """An RGB uint8 [H, W, 3] image (a rendered figure)."""
        self.writer().add_image(tag, pixels, step, dataformats="HWC")

    def rewind(self, step: int) -> None:
        """A resumed run continues after ``step``: what was written after it is hidden from now on."""
        self._close()
        self._purge = step + 1

    def end(self, status: str) -> None:
        self._close()

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def writer(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.dir), purge_step=self._purge)
        return self._writer
