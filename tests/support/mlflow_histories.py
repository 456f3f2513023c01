"""What MLflow should hold of a run: its metrics.jsonl as metric histories, for the tests that read
a run back from an MLflow store (tests/engine/test_tracking.py, tests/tune/test_tune.py)."""
from __future__ import annotations

import math
from pathlib import Path

from visiontrain.rundir.metrics_file import ROW_KEYS, is_number, read_metrics


def histories(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as MLflow should hold it: every number of every row, under kind/key (a missing
    value, null in the file, is not sent)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for kind, rows in zip(("train", "eval"), read_metrics(run_dir)):
        for row in rows:
            for key, value in row.items():
                if key not in ROW_KEYS and is_number(value) and math.isfinite(value):
                    out.setdefault(f"{kind}/{key}", []).append((row["step"], float(value)))
    return out
