"""Loss and evaluation curves of a run dir's metrics.jsonl, as one PNG (matplotlib, Agg).

    python benchmarks/plot_run.py RUN_DIR [--out RUN_DIR/curves.png] [--terms total loss_ce ...]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--terms", nargs="*", help="train scalars to plot (default: every loss term and total)")
    args = p.parse_args()
    rows = [json.loads(line) for line in (args.run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    terms = args.terms or [k for k in train[0] if k.startswith("loss") and not k.endswith("_w")
                           and not k[-1].isdigit()] + ["total"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for term in terms:
        ax1.plot([r["step"] for r in train], [r[term] for r in train], label=term)
    ax1.set(xlabel="step", ylabel="train scalars", title=f"{args.run_dir.name}: training")
    ax1.legend()
    metrics = [k for k in (evals[0] if evals else {}) if k not in ("kind", "step", "epoch", "time")]
    metrics = [k for k in metrics if not k.startswith("ema/")] or metrics  # EMA-only runs (DINO's teacher)
    for m in metrics:
        ax2.plot([r["step"] for r in evals], [r[m] for r in evals], marker="o", label=m)
    ax2.set(xlabel="step", ylabel="metric", title="evaluation")
    if metrics:
        ax2.legend()
    out = args.out or args.run_dir / "curves.png"
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    print(out)


if __name__ == "__main__":
    main()
