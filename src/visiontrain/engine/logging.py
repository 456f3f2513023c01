"""What a run writes as it goes: metrics.jsonl, TensorBoard under tb/, and the console.

On a terminal the console is a rich progress bar (epoch, step, loss, lr, samples/s, ETA); when
stdout is not a terminal (CI, a log file) it is one plain line per log point. Only rank 0 writes.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from visiontrain.engine.hooks import Hook


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class RunLogger:
    def __init__(self, run_dir: Path | None, *, total_steps: int, progress: str = "auto",
                 enabled: bool = True) -> None:
        self.enabled = enabled and run_dir is not None
        self.total_steps = total_steps
        self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1) if self.enabled else None
        # TensorBoard's writer opens an events file as it is made: made at the first event, so a
        # run that logs nothing (a resume of a finished run) leaves tb/ as it was
        self._tb_dir = str(run_dir / "tb") if self.enabled else None
        self._tb: Any = None
        self._tb_purge: int | None = None
        use_bar = progress == "bar" or (progress == "auto" and sys.stdout.isatty())
        self._bar = None
        if self.enabled and use_bar:
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                       TimeRemainingColumn)

            self._bar = Progress(TextColumn("[bold]epoch {task.fields[epoch]}"), BarColumn(),
                                 MofNCompleteColumn(), TimeRemainingColumn(),
                                 TextColumn("{task.fields[info]}", markup=False), transient=False)
            self._bar.start()
            self._task = self._bar.add_task("train", total=total_steps, epoch=0, info="")

    def log(self, kind: str, step: int, epoch: int, values: dict[str, Any]) -> None:
        """One event: a JSON line, TensorBoard scalars, and a console line or bar update."""
        if not self.enabled:
            return
        record = {"kind": kind, "step": step, "epoch": epoch, "time": round(time.time(), 3), **values}
        self._jsonl.write(json.dumps(record, allow_nan=True) + "\n")
        for key, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.tb().add_scalar(f"{kind}/{key}", value, step)
        if kind == "train":
            info = "  ".join(f"{k} {_fmt(values[k])}" for k in ("total", "lr", "samples_per_s")
                             if k in values)
            eta = f"eta {format_eta(values.get('eta_s', float('nan')))}"
            if self._bar is not None:
                self._bar.update(self._task, completed=step, epoch=epoch, info=info)
                return
            self.print(f"step {step}/{self.total_steps}  epoch {epoch}  {info}  {eta}")
        else:
            self.print(f"[{kind}] step {step} epoch {epoch}  " +
                       "  ".join(f"{k} {_fmt(v)}" for k, v in values.items()))

    def rewind(self, step: int) -> None:
        """A resumed run continues from ``step``: what was logged after it (before the crash or kill)
        is dropped, with a line cut short by a kill, so metrics.jsonl and TensorBoard hold each
        step once. The rewrite is atomic: a kill during it leaves the old file."""
        if not self.enabled:
            return
        self._jsonl.close()
        path = Path(self._jsonl.name)
        kept = []
        for line in path.read_text().splitlines(keepends=True):
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short by a kill
            if line.endswith("\n") and record.get("step", 0) <= step:
                kept.append(line)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)
        self._jsonl = open(path, "a", buffering=1)
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self._tb_purge = step + 1  # the next writer hides what the old one wrote after `step`

    def tb(self) -> Any:
        """The TensorBoard writer, made at the first event (rank 0 with a run dir only)."""
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(self._tb_dir, purge_step=self._tb_purge)
        return self._tb

    def table(self, title: str, rows: dict[str, Any]) -> None:
        """A compact end-of-epoch / end-of-run table."""
        if not self.enabled:
            return
        if self._bar is not None:
            from rich.table import Table

            table = Table(title=title, show_header=False)
            for k, v in rows.items():  # plain strings: rows are not rich markup
                table.add_row(k, _fmt(v))
            self._bar.console.print(table)
        else:
            self.print(f"{title}: " + "  ".join(f"{k} {_fmt(v)}" for k, v in rows.items()))

    def image(self, tag: str, pixels: Any, step: int) -> None:
        """An RGB uint8 [H, W, 3] image (a rendered figure) in TensorBoard."""
        if self.enabled:
            self.tb().add_image(tag, pixels, step, dataformats="HWC")

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def hooks(self) -> list[Hook]:
        """On a terminal, a hook that moves the bar every step (host-side only, at most 10 Hz)."""
        return [_BarHook(self)] if self._bar is not None else []

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()


class _BarHook(Hook):
    def __init__(self, logger: RunLogger) -> None:
        self.logger, self.last = logger, 0.0

    def after_step(self) -> None:
        now = time.perf_counter()
        if now - self.last >= 0.1:
            self.last = now
            bar = self.logger._bar
            bar.update(self.logger._task, completed=self.trainer.step, epoch=self.trainer.epoch)
