"""What a run writes as it goes: metrics.jsonl, the console, and what it hands its trackers.

On a terminal the console is a rich progress bar (epoch, step, loss, lr, samples/s, the share of the
log window spent waiting for data, ETA); when stdout is not a terminal (CI, a log file) it is one plain
line per log point. Only rank 0 writes.
What a metrics.jsonl row holds, and the one reader of the file, are in ``metrics_file``.
``RunLogger.log`` is the one funnel for metrics: every event also goes to each of its trackers
(``engine.records.tracking``: TensorBoard, MLflow), which start and end with the run, not with the
logger.

Plain lines start with the local wall-clock time (``2026-11-24 22:15:03``), not the time since
start: a job that is preempted and resumed writes one log across several processes, and wall-clock
times stay in order across them and line up with the scheduler's and the system's own logs. Each
quantity has one number format for the whole run (``format_value``), and an entry longer than
``WIDTH`` columns (DETR's epoch summary has dozens of terms) wraps onto indented continuation lines.

After an evaluation, a task's per-class table (``metrics_file.PER_CLASS``) is printed under its
line, one row per class in the task's order, columns aligned (a rich table on a terminal); above
``MAX_CLASS_ROWS`` classes (ImageNet's 1000) only the ``LOWEST_ROWS`` lowest in the first column
are printed, the whole table being in metrics.jsonl and the report.

Every JSON a user reads (metrics.jsonl, summary.json, the CLI's result lines) goes through
``dumps_json``: a NaN or infinity (COCO's APs on a set without small objects) is written as
``null``, so the files parse with every strict JSON parser, not only Python's.
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from visiontrain.engine.protocols.hooks import Hook
from visiontrain.rundir.metrics_file import (COMPUTE_S, DATA_S, SAMPLES_PER_S, UNDEFINED, is_per_class, make_row,
                                             model_key, per_class_tables, rewind)
from visiontrain.engine.records.tracking import Tracker
from visiontrain.rundir.run_files import METRICS_FILE
from visiontrain.rundir.write_failure import WriteError, why_not_written

#: Plain lines wrap at this many columns; continuation lines are indented under the text.
WIDTH = 100
#: Accuracies and error rates, in percent (0-100) everywhere; an EMA twin (``EMA_PREFIX``) is one too.
PERCENT = frozenset({"top1", "top5", "acc", "class_error", "knn_top1"})
#: Shown as whole numbers, also as an epoch's mean: throughput and counts.
WHOLE = frozenset({SAMPLES_PER_S, "skipped_steps", "fp16_overflow_skips"})
#: Scheduled values that span decades (1e-3 -> 1e-6): always in scientific notation.
SCIENTIFIC = frozenset({"lr", "weight_decay"})
#: A per-class table of more classes than this is printed as its ``LOWEST_ROWS`` lowest rows.
MAX_CLASS_ROWS, LOWEST_ROWS = 100, 20
#: A log window waiting for data more than this share of its time is input-bound: the run says so once
#: (``input_bound_hint``; ``engine.parts.log_point``), and so does its report.
INPUT_BOUND = 0.2
#: A class name longer than this is cut in the console table (never in the files).
NAME_WIDTH = 28
#: What a per-class table shows for a value that is not defined (a class without ground truth): an em dash.


def json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinite float, at any depth, replaced by None (JSON null):
    strict parsers (JavaScript, jq, Go, Rust) refuse Python's NaN/Infinity tokens."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def dumps_json(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` for every JSON a user reads: non-finite floats become null, and anything else
    that is not valid JSON raises instead of being written."""
    return json.dumps(json_safe(value), allow_nan=False, **kwargs)


def format_value(key: str, value: Any) -> str:
    """One number format per quantity, chosen by its name (never by the value's size), so a column
    reads the same all run: lr and weight decay ``3.000e-03``, percentages ``91.75``, samples/s and
    step counts whole, seconds ``1.23``, any other int as is, everything else (losses, AP) ``0.1234``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    name = model_key(key)
    if not math.isfinite(value):
        return str(float(value))  # nan, inf, -inf
    if name in SCIENTIFIC or name.startswith("lr/"):
        return f"{value:.3e}"
    if name in WHOLE:
        return str(round(value))
    if name == "ema_decay":
        return f"{value:.6f}"  # 0.9996 and 0.99996 differ
    if name in PERCENT or name.endswith(("_s", "_gb")):
        return f"{value:.2f}"
    if isinstance(value, int):
        return str(value)
    return f"{value:.4f}"


def format_items(values: dict[str, Any]) -> list[str]:
    """``key value`` for each entry, each value in its quantity's format."""
    return [f"{k} {format_value(k, v)}" for k, v in values.items()]


def wrap_items(head: str, items: list[str], width: int = WIDTH, indent: int = 4) -> str:
    """``head`` then the items two spaces apart, wrapped between items before ``width`` columns;
    continuation lines start with ``indent`` spaces (an item is never split)."""
    lines, line = [], head
    for item in items:
        if line.strip() and len(line) + 2 + len(item) > width:
            lines.append(line)
            line = " " * indent + item
        else:
            line = f"{line}  {item}" if line.strip() else line + item
    return "\n".join([*lines, line])


def class_cell(column: str, value: Any) -> str:
    """One cell of a per-class table: an undefined value (NaN while running, null once read back from
    a JSON file, or absent) is ``UNDEFINED`` in every table, never ``nan`` in one and ``None`` in another."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return UNDEFINED
    return format_value(column, value)


def class_table_rows(title: str, table: dict[str, dict[str, Any]]) -> tuple[str, list[str], list[list[str]]]:
    """(title, column names, rows of strings) of a per-class table as the console shows it: the
    task's class order, each column in its quantity's format; above ``MAX_CLASS_ROWS`` classes the
    ``LOWEST_ROWS`` lowest in the first column (NaN last), and the title says so."""
    columns: list[str] = []
    for row in table.values():
        columns += [c for c in row if c not in columns]
    names = list(table)
    if len(names) > MAX_CLASS_ROWS and columns:
        first = columns[0]

        def key(name: str) -> tuple[bool, float]:
            value = table[name].get(first)
            number = float(value) if isinstance(value, (int, float)) else math.nan
            return (math.isnan(number), number)

        names = sorted(names, key=key)[:LOWEST_ROWS]
        title = f"{title}: the {LOWEST_ROWS} lowest {first} of {len(table)} classes (all in {METRICS_FILE})"
    rows = [[name if len(name) <= NAME_WIDTH else name[:NAME_WIDTH - 3] + "...",
             *(class_cell(c, table[name].get(c)) for c in columns)] for name in names]
    return title, ["class", *columns], rows


def class_table_text(title: str, table: dict[str, dict[str, Any]]) -> str:
    """A per-class table as aligned plain lines: names left, numbers right, under a title line."""
    title, columns, rows = class_table_rows(title, table)
    widths = [max(len(r[i]) for r in [columns, *rows]) for i in range(len(columns))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in [columns, *rows]]
    return "\n".join([f"{title}:", *lines])


def timestamp(now: float | None = None) -> str:
    """Local wall-clock time to the second: the prefix of every plain line."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))


def plain_line(text: str, now: float | None = None) -> str:
    """A plain (non-terminal) entry: the timestamp before its first line, its continuation lines
    indented by the timestamp's width so they read as one entry."""
    stamp = timestamp(now)
    pad = " " * (len(stamp) + 1)
    first, *rest = text.split("\n")
    return "\n".join([f"{stamp} {first}", *(pad + line for line in rest)])


def data_wait_item(values: dict[str, Any]) -> list[str]:
    """``data 34%``: the share of a train row's window spent waiting for the loader, so an input-bound
    run shows on its log line (none without the window's times)."""
    data_s, compute_s = values.get(DATA_S), values.get(COMPUTE_S)
    if not isinstance(data_s, (int, float)) or not isinstance(compute_s, (int, float)):
        return []
    return [f"data {100 * data_s / max(data_s + compute_s, 1e-12):.0f}%"]


def input_bound_hint(share: float, workers: Any) -> str:
    """The one line a run whose loader holds the step back gets: what to raise, and how to see what
    the step alone can do (a synthetic benchmark replays one batch: no loading)."""
    return (f"waiting for data {100 * share:.0f} % of the step time: raise data.num_workers (now {workers}), "
            f"or set data.cache=ram / data.normalize_on_device=true where the source has them; "
            f"`visiontrain benchmark RECIPE --synthetic` shows what the step alone can do")


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class RunLogger:
    def __init__(self, run_dir: Path | None, *, total_steps: int, progress: str = "auto",
                 enabled: bool = True, trackers: list[Tracker] = ()) -> None:
        self.enabled = enabled and run_dir is not None
        self.total_steps = total_steps
        self.trackers = list(trackers) if self.enabled else []
        # metrics.jsonl is opened at the first row: a run refused while it is set up (a --resume
        # checkpoint that is no checkpoint) leaves no file behind
        self._jsonl_path = run_dir / METRICS_FILE if self.enabled else None
        self._jsonl: Any = None
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
        # wrapped entries fit WIDTH columns with the timestamp that starts each plain line
        self._width = WIDTH if self._bar is not None else WIDTH - len(timestamp()) - 1

    def log(self, kind: str, step: int, epoch: int, values: dict[str, Any]) -> None:
        """One event: a JSON line (``metrics_file.make_row``), each tracker (TensorBoard's among them),
        and a console line or bar update."""
        if not self.enabled:
            return
        self.write_row(dumps_json(make_row(kind, step, epoch, values)) + "\n")
        for tracker in self.trackers:
            tracker.log(kind, step, epoch, values)
        if kind == "train":
            info = "  ".join(format_items({k: values[k] for k in ("total", "lr", SAMPLES_PER_S)
                                           if k in values}) + data_wait_item(values))
            eta = f"eta {format_eta(values.get('eta_s', float('nan')))}"
            if self._bar is not None:
                self._bar.update(self._task, completed=step, epoch=epoch, info=info)
                return
            self.print(f"step {step}/{self.total_steps}  epoch {epoch}  {info}  {eta}")
        else:
            tables = per_class_tables(values)
            scalars = {k: v for k, v in values.items() if k not in tables}
            self.print(wrap_items(f"[{kind}] step {step} epoch {epoch}", format_items(scalars), self._width))
            for key, table in tables.items():
                self.class_table(f"[{kind}] {key} at step {step}", table)

    def write_row(self, line: str) -> None:
        """One line of metrics.jsonl. A failed write (a full disk) names the file and what is kept."""
        try:
            if self._jsonl is None:
                self._jsonl = open(self._jsonl_path, "a", buffering=1)
            self._jsonl.write(line)
        except OSError as err:
            path = self._jsonl_path
            if self._jsonl is not None:  # its buffer holds the line cut short: closing would write it again
                with contextlib.suppress(OSError):
                    self._jsonl.close()
                self._jsonl = None
            raise WriteError(f"could not write {path}: {why_not_written(err, path.parent)}; the checkpoints "
                             f"written before are intact (a line cut short is dropped when the run resumes): "
                             f"continue with --resume auto once it can be written") from err

    def rewind(self, step: int) -> None:
        """A resumed run continues from ``step``: what was logged after it (before the crash or kill)
        is dropped, with a line cut short by a kill, so metrics.jsonl and the trackers that can
        rewind (TensorBoard) hold each step once (``metrics_file.rewind``: atomic, a kill during it
        leaves the old file)."""
        if not self.enabled:
            return
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None  # reopened at the next row
        if self._jsonl_path.is_file():
            rewind(self._jsonl_path, step)
        for tracker in self.trackers:
            if hasattr(tracker, "rewind"):
                tracker.rewind(step)

    def table(self, title: str, rows: dict[str, Any]) -> None:
        """A compact end-of-epoch / end-of-run table of scalars (per-class tables are printed after
        each evaluation, not again here)."""
        if not self.enabled:
            return
        rows = {k: v for k, v in rows.items() if not is_per_class(k)}
        if self._bar is not None:
            from rich.table import Table

            table = Table(title=title, show_header=False)
            for k, v in rows.items():  # plain strings: rows are not rich markup
                table.add_row(k, format_value(k, v))
            self._bar.console.print(table)
        else:
            self.print(wrap_items(f"{title}:", format_items(rows), self._width))

    def class_table(self, title: str, table: dict[str, dict[str, Any]]) -> None:
        """A per-class table (``class_table_rows``): a rich table on a terminal, aligned lines otherwise."""
        if not self.enabled:
            return
        if self._bar is None:
            self.print(class_table_text(title, table))
            return
        from rich.table import Table
        from rich.text import Text

        title, columns, rows = class_table_rows(title, table)
        shown = Table(title=Text(title), title_justify="left")
        for i, column in enumerate(columns):
            shown.add_column(column, justify="left" if i == 0 else "right")
        for row in rows:  # plain strings: class names are not rich markup
            shown.add_row(*(Text(cell) for cell in row))
        self._bar.console.print(shown)

    def image(self, tag: str, pixels: Any, step: int) -> None:
        """An RGB uint8 [H, W, 3] image (a rendered figure), to each tracker that shows images."""
        for tracker in self.trackers:
            if hasattr(tracker, "image"):
                tracker.image(tag, pixels, step)

    def print(self, text: str) -> None:
        """A console entry: as is under the bar; as plain lines, after a timestamp."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            print(plain_line(text), flush=True)

    def hooks(self) -> list[Hook]:
        """On a terminal, a hook that moves the bar every step (host-side only, at most 10 Hz)."""
        return [_BarHook(self)] if self._bar is not None else []

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
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
