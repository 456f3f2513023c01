"""Per-class results against the number of classes (10, 80, 300, 1,203: LVIS): the printed table,
the size of an evaluation row of metrics.jsonl, `visiontrain report` (time and report.html's size)
on a run of 20 evaluations, and the PR-curve figure.

The per-class table is a detection run's (``{"AP", "AP50", "recall", "n_gt"}`` for each class, the
EMA's beside the model's), with random values; the PR curves are 101-point precision curves.

    python benchmarks/scale/per_class.py [--quick]
"""
from __future__ import annotations

import io
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from loglog import in_child, main

CLASSES = (10, 80, 300, 1203)
QUICK = (10, 80)
EVALUATIONS = 20


def table(classes: int, rng: random.Random) -> dict[str, dict[str, float]]:
    return {f"class_{k:04d}": {"AP": rng.random(), "AP50": rng.random(), "recall": rng.random(),
                               "n_gt": rng.randint(1, 500)} for k in range(classes)}


def write_run(run_dir: Path, classes: int) -> int:
    """A detection run's metrics.jsonl: a training row every 50 steps, an evaluation (model and EMA,
    each with its per-class table) every 500; the size of one evaluation row in bytes."""
    from visiontrain.rundir.metrics_file import make_row
    from visiontrain.engine.records.run_log import dumps_json

    rng = random.Random(0)
    lines, eval_bytes = [], 0
    for step in range(50, EVALUATIONS * 500 + 1, 50):
        lines.append(dumps_json(make_row("train", step, step // 500, {"total": rng.random(), "lr": 1e-3})))
        if step % 500 == 0:
            values = {"AP": rng.random(), "AP50": rng.random(), "per_class": table(classes, rng),
                      "ema/AP": rng.random(), "ema/AP50": rng.random(), "ema/per_class": table(classes, rng)}
            lines.append(dumps_json(make_row("eval", step, step // 500, values)))
            eval_bytes = len(lines[-1].encode())
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run_dir / "config.yaml").write_text("task:\n  name: detr\n")
    return eval_bytes


def measure(classes: int | str) -> dict:
    classes = int(classes)
    from visiontrain.engine.records.run_log import class_table_text
    from visiontrain.evaluation.figures import pr_curves_figure

    rng = random.Random(1)
    per_class = table(classes, rng)
    start = time.perf_counter()
    text = class_table_text("per class", per_class)
    table_s = time.perf_counter() - start
    recall = np.linspace(0, 1, 101)
    curves = {name: np.sort(np.random.default_rng(k).random(101))[::-1] for k, name in enumerate(per_class)}
    start = time.perf_counter()
    fig = pr_curves_figure(recall, curves, {n: v["AP"] for n, v in per_class.items()}, title="PR")
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    figure_s = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        row_bytes = write_run(run_dir, classes)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "visiontrain", "report", str(run_dir)], check=True, capture_output=True)
        report_s = time.perf_counter() - start
        report_bytes = (run_dir / "report.html").stat().st_size
    return {"classes": classes, "table_lines": len(text.splitlines()), "table_s": round(table_s, 4),
            "eval_row_kib": round(row_bytes / 1024, 1), "report_s": round(report_s, 2),
            "report_mib": round(report_bytes / 2**20, 2), "pr_figure_s": round(figure_s, 2),
            "pr_figure_kib": round(len(png.getvalue()) / 1024, 1)}


def run(quick: bool = False) -> list[dict]:
    """One row per number of classes, each in a process of its own."""
    rows = []
    for classes in QUICK if quick else CLASSES:
        rows.append(in_child(__file__, str(classes)))
    return rows


if __name__ == "__main__":
    main(__doc__, run, measure, "10 and 80 classes only")
