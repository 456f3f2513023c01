"""Variants of one recipe trained side by side, and their evaluation curves in one table.

    python benchmarks/recipe_sweep.py RECIPE --variant NAME="k=v k=v" [--variant ...] --out DIR \\
        [--common "k=v ..."] [--parallel N] [--metrics mask_AP50,AP50]

Each variant is ``visiontrain fit RECIPE COMMON VARIANT --run-dir DIR/NAME`` in its own process
(``--parallel`` at a time: on a GPU machine several small runs share the card). The table has, for
each variant and each evaluation, the epoch, the chosen metrics and the seconds since the run
began; DIR/sweep.json holds the same. What it is for: choosing a small recipe's length and
learning rate where a single 30-minute CPU run per guess would be too slow; the recipe's own figure
is then measured as shipped on the machine it is for (BENCHMARKS.md says which).
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from visiontrain.rundir.metrics_file import read_metrics


def run_variant(recipe: str, name: str, overrides: list[str], out: Path) -> dict:
    """One variant's fit, its log in DIR/NAME.log; its evaluation rows and wall time."""
    run_dir = out / name
    start = time.time()
    with open(out / f"{name}.log", "w") as log:
        rc = subprocess.call([sys.executable, "-m", "visiontrain", "fit", recipe, *overrides,
                              "trainer.progress=plain", "--run-dir", str(run_dir)], stdout=log, stderr=subprocess.STDOUT)
    rows = []
    if (run_dir / "metrics.jsonl").is_file():
        train, evals = read_metrics(run_dir)
        rows = [dict(row) for row in evals]
    return {"name": name, "overrides": overrides, "rc": rc, "wall_s": round(time.time() - start, 1), "evals": rows,
            "start": start}


def table(results: list[dict], metrics: list[str]) -> str:
    lines = [f"| variant | epoch | {' | '.join(metrics)} | s since start |", "|---|---:|" + "---:|" * (len(metrics) + 1)]
    for r in results:
        for row in r["evals"]:
            values = " | ".join(f"{row.get(m, float('nan')):.4f}" if isinstance(row.get(m), (int, float)) else "-"
                                for m in metrics)
            lines.append(f"| {r['name']} | {row.get('epoch')} | {values} | {row.get('time', r['start']) - r['start']:.0f} |")
        if r["rc"] != 0:
            lines.append(f"| {r['name']} | exit {r['rc']} (see {r['name']}.log) | | |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("recipe")
    p.add_argument("--variant", action="append", default=[], help='NAME="k=v k=v" (repeatable)')
    p.add_argument("--common", default="", help="overrides every variant takes")
    p.add_argument("--parallel", type=int, default=1)
    p.add_argument("--metrics", default="AP50")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    variants = []
    for v in args.variant:
        name, _, spec = v.partition("=")
        variants.append((name, shlex.split(args.common) + shlex.split(spec)))
    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        results = list(pool.map(lambda nv: run_variant(args.recipe, nv[0], nv[1], args.out), variants))
    (args.out / "sweep.json").write_text(json.dumps(results, indent=1, default=str))
    print(table(results, args.metrics.split(",")))


if __name__ == "__main__":
    main()
