"""The schema of a run's ``metrics.jsonl``, next to the one place that writes it and the one reader.

``RunLogger`` appends one JSON object per line, built by ``make_row``: ``kind`` (``"train"``, a log
window's means, or ``"eval"``, one evaluation), the optimizer ``step`` it was logged at, the
``epoch``, the wall-clock ``time`` and then the scalars themselves. An evaluation of the EMA's
weights logs its metrics under ``EMA_PREFIX`` (``ema/top1`` beside ``top1``). A NaN or infinity is
written as ``null`` (``dumps_json``) and read back as NaN: a missing value, drawn as a gap.

One evaluation key is not a scalar: ``PER_CLASS`` (and its EMA twin ``ema/per_class``) holds the
task's table ``{class name: {column: value}}`` (per-class AP for a detector, precision / recall /
F1 for a classifier). Everything that wants numbers (curves, best checkpoints, ``compare``) passes
over it: ``numeric_keys`` by its type, ``Metrics.eval_keys`` by ``is_per_class``; the console
prints it as a table and ``visiontrain report`` as an HTML table.

A run killed mid-line leaves a last line cut short, and rows logged after its last checkpoint.
When it resumes, ``rewind`` drops both, so the file of a resumed run holds each step once, as an
uninterrupted run's does. Until then a reader sees the cut line: ``read_metrics`` either names it
(``visiontrain compare`` / ``report``: the user asked about this file) or passes over it (the
plots: a view of the run that must never stop it).

Kept free of torch and of the rest of the engine, so that ``compare``, ``report`` and the
benchmark scripts read runs without loading a training stack.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, NamedTuple

from visiontrain.rundir.run_files import METRICS_FILE

#: The row kinds: a training log window, and an evaluation.
TRAIN, EVAL = "train", "eval"
#: What every row carries besides its scalars; readers leave these out of the metric keys.
KIND, STEP, EPOCH, TIME = "kind", "step", "epoch", "time"
ROW_KEYS = (KIND, STEP, EPOCH, TIME)
#: A training row's throughput: samples per second over its log window, and the window's seconds spent
#: waiting for data and computing.
SAMPLES_PER_S, DATA_S, COMPUTE_S = "samples_per_s", "data_s", "compute_s"
#: The prefix of the EMA model's evaluation metrics (``ema/top1``): one spelling for writer and readers.
EMA_PREFIX = "ema/"
#: The evaluation key of a task's per-class table, ``{class name: {column: value}}``.
PER_CLASS = "per_class"

Row = dict[str, Any]


def ema_key(key: str) -> str:
    """The EMA twin of a model metric (``top1`` -> ``ema/top1``)."""
    return EMA_PREFIX + key


def is_ema(key: str) -> bool:
    return key.startswith(EMA_PREFIX)


def model_key(key: str) -> str:
    """The model metric an EMA key twins (``ema/top1`` -> ``top1``); any other key as is."""
    return key.removeprefix(EMA_PREFIX)


def is_per_class(key: str) -> bool:
    """A per-class table (``per_class`` or ``ema/per_class``), not a scalar metric."""
    return model_key(key) == PER_CLASS


def model_scalars(metrics: dict[str, Any]) -> list[str]:
    """The model's scalar metrics of an evaluation, sorted: what ``eval.metric`` may name."""
    return sorted(k for k in metrics if not is_ema(k) and not is_per_class(k))


def per_class_tables(values: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """The per-class tables among an evaluation's values (the model's, then the EMA's), by key."""
    return {k: v for k, v in values.items() if is_per_class(k) and isinstance(v, dict)}


def make_row(kind: str, step: int, epoch: int, values: dict[str, Any], now: float | None = None) -> Row:
    """One row as ``RunLogger`` writes it (before ``dumps_json``); the bookkeeping keys come first so
    that a person reading the file with ``head`` sees what each line is."""
    return {KIND: kind, STEP: step, EPOCH: epoch, TIME: round(time.time() if now is None else now, 3), **values}


def nan_for_null(value: Any) -> Any:
    """The reader's side of ``dumps_json``: null back to NaN (at any depth), the missing value
    the plots and tables already handle."""
    if value is None:
        return math.nan
    if isinstance(value, dict):
        return {k: nan_for_null(v) for k, v in value.items()}
    if isinstance(value, list):
        return [nan_for_null(v) for v in value]
    return value


def is_number(value: Any) -> bool:
    """A scalar that can be drawn or compared (a bool is logged as a flag, not a quantity)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def numeric_keys(rows: list[Row]) -> list[str]:
    """Every key with a number in some row, bookkeeping left out, in first-seen order: the order the
    task logged them in, which is the order a person expects the panels and columns in."""
    seen: dict[str, None] = {}
    for row in rows:
        for k, v in row.items():
            if k not in ROW_KEYS and is_number(v):
                seen.setdefault(k, None)
    return list(seen)


def series(rows: list[Row], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one key over the rows that logged it as a number; NaN stays in (a gap)."""
    points = [(row["step"], float(row[key])) for row in rows if is_number(row.get(key))]
    return [p[0] for p in points], [p[1] for p in points]


class Metrics(NamedTuple):
    """A run's rows by kind, in file order (a tuple, so ``train, evals = read_metrics(...)`` works)."""

    train: list[Row]
    evals: list[Row]

    @property
    def eval_keys(self) -> list[str]:
        """The scalar metrics of the last evaluation (an earlier one, DINO's at step 0, may lack
        some); its per-class tables are not among them."""
        return [k for k in (self.evals[-1] if self.evals else {}) if k not in ROW_KEYS and not is_per_class(k)]

    @property
    def last_step(self) -> int:
        """The last step logged: how far an unfinished run (no summary.json) got."""
        return max((row["step"] for row in self.train + self.evals if "step" in row), default=0)


def metrics_path(run_dir_or_path: str | Path) -> Path:
    """The metrics file of a run dir; a path to an existing file is that file (a copy kept elsewhere).
    Anything else is taken as a run dir, so a missing file is reported as a run dir's."""
    path = Path(run_dir_or_path)
    return path if path.is_file() else path / METRICS_FILE


def read_metrics(run_dir_or_path: str | Path, *, strict: bool = True) -> Metrics:
    """The rows of a run dir's (or a file's) metrics, with null read back as NaN.

    ``strict``: a line that is not a JSON object is an error naming the file and line (the user
    should know the file is damaged); otherwise it is passed over, as a line cut short by a kill
    is. Blank lines and rows of another kind are always passed over. A missing file is an error
    either way, naming the path that was expected."""
    path = metrics_path(run_dir_or_path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: {run_dir_or_path} is not a visiontrain run dir "
                                f"(expected the --run-dir of a `visiontrain fit`)")
    train: list[Row] = []
    evals: list[Row] = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if strict:
                raise ValueError(f"{path}, line {n}: not a JSON object ({err.msg})") from None
            continue
        if not isinstance(row, dict):
            if strict:
                raise ValueError(f"{path}, line {n}: not a JSON object (a {type(row).__name__})")
            continue
        kind = row.get("kind")
        if kind in (TRAIN, EVAL):
            (train if kind == TRAIN else evals).append(nan_for_null(row))
    return Metrics(train, evals)


def rewind(path: Path, step: int) -> None:
    """Cut the file back to what was logged up to ``step`` (the checkpoint a run resumes from):
    rows after it are logged again by the resumed run, and a line cut short by a kill is dropped.
    The rewrite is atomic: a kill during it leaves the old file."""
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        if line.endswith("\n") and isinstance(row, dict) and row.get("step", 0) <= step:
            kept.append(line)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


#: An undefined value (NaN in memory, null once written to JSON, or absent) in every table a person
#: reads: the log's, the report's, ``compare``'s and ``tune``'s; never ``nan`` in one and ``None`` in another.
UNDEFINED = "\u2014"


def value_text(value: Any) -> str:
    """A metric or setting as a table shows it: 4 significant digits, ``UNDEFINED`` for a missing or
    NaN value, a mapping (VOC's per-class AP) as ``key value`` pairs cut at 80 characters."""
    if value is None:  # null is how a NaN is written (dumps_json): a missing value, as NaN is
        return UNDEFINED
    if isinstance(value, float):
        return UNDEFINED if math.isnan(value) else f"{value:.4g}"
    if isinstance(value, (dict, list)):
        text = ", ".join(f"{k} {value_text(v)}" for k, v in value.items()) if isinstance(value, dict) else str(value)
        return text if len(text) <= 80 else text[:77] + "..."
    return str(value)
