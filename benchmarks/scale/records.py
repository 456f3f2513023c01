"""Scale, a long run's records: what reading and writing metrics.jsonl costs as a run grows.

    python benchmarks/scale/records.py [--quick] [--out benchmarks/results/scale-records]

A run dir is synthesized for each size (10k, 100k, 300k, 1M steps; --quick: 10k, 30k, 100k, 300k)
with the metrics.jsonl a real classification run of that length writes: a training row every 50
steps and an evaluation every 5,000 (and at the end), each row of the same keys and kinds as the
rows of a tiny real run (`visiontrain fit classify-fashion data.name=digits`, run first), with its
per-class table in every evaluation; the values follow smooth curves with noise, so the plots
draw what a real run's would. Beside it: that run's config.yaml and a summary.json of the new length.

Timed at each size:
- report: `visiontrain report RUN` (a fresh process, as a user runs it; the run dir has no plots
  yet, so the report draws the curves too: the worst case), and the same inside this process,
  which leaves out the start-up (about 3 s of imports) and shows how the work grows;
- compare: `visiontrain compare RUN RUN2` (two runs of that size), also both ways;
- plots: ``write_curves``, the curves a run draws at each evaluation and at its end;
- tensorboard: every row's scalars through ``TensorBoardTracker``, as the run logs them (a row one
  event), and beside it the tracker's path before (an ``add_scalar``, so an event, for each value);
- rewind: ``metrics_file.rewind`` of the file (and a line cut short by a kill) to a checkpoint
  5,000 steps before the end, as a resumed run does.
For each cost the log-log slope against the number of steps is fitted; the table is printed and
the costs are drawn against size on log-log axes (OUT.png), the rows written to OUT.json.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

LOG_EVERY, EVAL_EVERY = 50, 5_000
SIZES, QUICK_SIZES = (10_000, 100_000, 300_000, 1_000_000), (10_000, 30_000, 100_000, 300_000)
TARGETS_S = {"report": 10.0, "compare": 10.0}  # the targets at 1,000,000 steps
RESULTS = Path(__file__).resolve().parents[1] / "results"


def cli(*args: str) -> float:
    """Seconds a `visiontrain` command takes in a fresh process (start-up included, as a user sees it)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "visiontrain", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"visiontrain {' '.join(args)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return time.perf_counter() - start


def real_template(work: Path) -> dict[str, Any]:
    """The rows of a tiny real run: the shape every synthesized row copies."""
    run = work / "template"
    cli("fit", "classify-fashion", "data.name=digits", "trainer.max_steps=20", "trainer.log_every=5",
        "trainer.plots=false", "--run-dir", str(run))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {"train": next(r for r in rows if r["kind"] == "train"),
            "eval": [r for r in rows if r["kind"] == "eval"][-1],
            "config": (run / "config.yaml").read_text(),
            "summary": json.loads((run / "summary.json").read_text())}


def _vary(row: dict[str, Any], step: int, total: int, rng: random.Random) -> dict[str, Any]:
    """The row's numbers along a training curve: losses fall, accuracies rise, with noise; counts stay."""
    progress = step / total
    out: dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out[key] = _vary(value, step, total, rng)
        elif isinstance(value, bool) or not isinstance(value, float):
            out[key] = value
        elif key in ("acc", "top1", "top5", "precision", "recall", "F1"):
            top = 100.0 if value > 1.0 else 1.0
            out[key] = min(top, top * (1 - 0.9 * math.exp(-5 * progress)) * (1 + 0.01 * rng.gauss(0, 1)))
        else:
            out[key] = value * (0.05 + math.exp(-3 * progress)) * (1 + 0.05 * rng.gauss(0, 1))
    return out


def synthesize(run_dir: Path, steps: int, template: dict[str, Any], seed: int = 0) -> int:
    """A run dir of ``steps`` steps (see the module docstring); returns the bytes of its metrics.jsonl."""
    from visiontrain.engine.records.run_log import dumps_json

    rng = random.Random(seed)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(template["config"])
    start, per_log = 1_795_000_000.0, 2.5  # wall-clock seconds: a log window of 50 steps
    lines = []
    for step in range(LOG_EVERY, steps + 1, LOG_EVERY):
        epoch, now = step // 1_251, start + step / LOG_EVERY * per_log
        row = _vary(template["train"], step, steps, rng)
        lines.append(dumps_json({**row, "step": step, "epoch": epoch, "time": round(now, 3)}))
        if step % EVAL_EVERY == 0 or step == steps:
            row = _vary(template["eval"], step, steps, rng)
            lines.append(dumps_json({**row, "step": step, "epoch": epoch, "time": round(now + 1, 3)}))
    text = "\n".join(lines) + "\n"
    (run_dir / "metrics.jsonl").write_text(text)
    summary = {**template["summary"], "steps": steps, "wall_s": steps / LOG_EVERY * per_log,
               "run_dir": str(run_dir), "report": str(run_dir / "report.html")}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return len(text.encode())


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def tensorboard_seconds(run_dir: Path, out: Path, *, event_a_scalar: bool = False) -> float:
    """Every row's scalars through the TensorBoard tracker, as the run logs them, and the writer closed.
    ``event_a_scalar``: the tracker's path before, an ``add_scalar`` (an event) for each value."""
    from torch.utils.tensorboard import SummaryWriter

    from visiontrain.rundir.metrics_file import ROW_KEYS, is_number, read_metrics
    from visiontrain.engine.records.tensorboard import TensorBoardTracker

    metrics = read_metrics(run_dir)
    rows = sorted([*metrics.train, *metrics.evals], key=lambda r: r["step"])
    start = time.perf_counter()
    if event_a_scalar:
        writer = SummaryWriter(str(out))
        for row in rows:
            for key, value in row.items():
                if key not in ROW_KEYS and is_number(value):
                    writer.add_scalar(f"{row['kind']}/{key}", value, row["step"])
        writer.close()
    else:
        tracker = TensorBoardTracker(out)
        for row in rows:
            tracker.log(row["kind"], row["step"], row["epoch"], {k: v for k, v in row.items() if k not in ROW_KEYS})
        tracker.end("FINISHED")
    return time.perf_counter() - start


def rewind_seconds(run_dir: Path, steps: int, rewind: Callable[[Path, int], None]) -> float:
    """``rewind`` of a copy of the file, with a line cut short after its end, to 5,000 steps before the end."""
    path = run_dir.parent / f"{run_dir.name}-rewound.jsonl"
    shutil.copyfile(run_dir / "metrics.jsonl", path)
    with path.open("a") as f:
        f.write('{"kind": "train", "step": 99999999, "ep')
    seconds = timed(lambda: rewind(path, max(0, steps - EVAL_EVERY)))
    path.unlink()
    return seconds


def in_process(work: Path, run: Path, other: Path, steps: int) -> dict[str, float]:
    """The costs measured inside this process (start-up left out): the growing part of each."""
    from visiontrain.report.compare import compare
    from visiontrain.rundir.metrics_file import rewind
    from visiontrain.engine.records.plots import write_curves
    from visiontrain.report.page import write_report

    return {
        "report (in process)": timed(lambda: write_report(other, work / f"report-{steps}-in.html")),
        "compare (in process)": timed(lambda: compare([str(run), str(other)], work / f"compare-{steps}-in.png")),
        "plots": timed(lambda: write_curves(other, work / f"plots-{steps}")),
        "tensorboard": tensorboard_seconds(other, work / f"tb-{steps}"),
        "tensorboard, an event a scalar (before)": tensorboard_seconds(other, work / f"tb-old-{steps}",
                                                                       event_a_scalar=True),
        "rewind": rewind_seconds(other, steps, rewind),
    }


def measure(work: Path, steps: int, template: dict[str, Any]) -> list[dict[str, Any]]:
    """Every cost at one size: the two commands in a fresh process, then the costs in this one."""
    run, other = work / f"run-{steps}", work / f"other-{steps}"
    size = synthesize(run, steps, template, seed=1)
    synthesize(other, steps, template, seed=2)
    costs = {"report": cli("report", str(run), "--out", str(work / f"report-{steps}.html")),
             "compare": cli("compare", str(run), str(other), "--out", str(work / f"compare-{steps}.png")),
             **in_process(work, run, other, steps)}
    rows = [{"axis": "steps", "size": steps, "cost": name, "seconds": round(s, 4)} for name, s in costs.items()]
    rows.append({"axis": "steps", "size": steps, "cost": "metrics.jsonl", "bytes": size})
    for d in (run, other):
        shutil.rmtree(d)
    return rows


def slopes(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The log-log slope of each cost against size: 1 is linear, above 1.1 grows faster than its size."""
    import numpy as np

    fitted = {}
    for cost in dict.fromkeys(r["cost"] for r in rows if "seconds" in r):
        points = [(r["size"], r["seconds"]) for r in rows if r["cost"] == cost and r["seconds"] > 0]
        if len(points) >= 2:
            x, y = np.log([p[0] for p in points]), np.log([p[1] for p in points])
            fitted[cost] = float(np.polyfit(x, y, 1)[0])
    return fitted


def run(quick: bool) -> list[dict[str, Any]]:
    """The rows of every cost at every size (axis, size, cost, seconds or bytes)."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="scale-records-") as tmp:
        work = Path(tmp)
        template = real_template(work)
        synthesize(work / "warm-a", 1_000, template)  # imports, font caches, the first figure: not a cost of size
        synthesize(work / "warm-b", 1_000, template, seed=1)
        in_process(work, work / "warm-a", work / "warm-b", 1_000)
        for steps in QUICK_SIZES if quick else SIZES:
            rows += measure(work, steps, template)
            print(f"  {steps:>9,} steps measured", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table: one line per size, one column per cost, then the fitted slopes."""
    costs = list(dict.fromkeys(r["cost"] for r in rows if "seconds" in r))
    sizes = sorted({r["size"] for r in rows})
    value = {(r["size"], r["cost"]): r.get("seconds", r.get("bytes")) for r in rows}
    lines = ["| steps | metrics.jsonl | " + " | ".join(f"{c} (s)" for c in costs) + " |",
             "|---:|---:|" + "---:|" * len(costs)]
    for size in sizes:
        mib = value[(size, "metrics.jsonl")] / 2**20
        lines.append(f"| {size:,} | {mib:.1f} MiB | " + " | ".join(f"{value[(size, c)]:.3g}" for c in costs) + " |")
    fitted = slopes(rows)
    lines.append("| log-log slope | | " + " | ".join(f"{fitted.get(c, math.nan):.2f}" for c in costs) + " |")
    return "\n".join(lines)


def draw(rows: list[dict[str, Any]], out: Path, title: str) -> None:
    """Each cost against size on log-log axes, with a dotted linear reference through its first point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    fitted = slopes(rows)
    for cost, slope in fitted.items():
        points = sorted((r["size"], r["seconds"]) for r in rows if r["cost"] == cost)
        line, = ax.plot(*zip(*points), marker="o", label=f"{cost} (slope {slope:.2f})")
        ax.plot([p[0] for p in points], [points[0][1] * p[0] / points[0][0] for p in points],
                linestyle=":", color=line.get_color(), alpha=0.5)
    ax.set(xscale="log", yscale="log", xlabel="steps of the run", ylabel="seconds", title=title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="sizes 10k..300k steps")
    parser.add_argument("--out", type=Path, default=RESULTS / "scale-records", help="OUT.png and OUT.json")
    args = parser.parse_args()
    rows = run(args.quick)
    print(table(rows))
    largest = max(r["size"] for r in rows)
    for cost, target in TARGETS_S.items():
        seconds = next(r["seconds"] for r in rows if r["cost"] == cost and r["size"] == largest)
        print(f"{cost} at {largest:,} steps: {seconds:.2f} s (target {target:g} s at 1,000,000)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    draw(rows, args.out.with_suffix(".png"), "a long run's records: cost against the run's steps")


if __name__ == "__main__":
    main()
