"""Loss and evaluation curves of a run dir's metrics.jsonl, as one PNG (matplotlib, Agg).

    python benchmarks/plot_run.py RUN_DIR [--out RUN_DIR/curves.png] [--terms total loss_ce ...]

Two panels, the training terms on one and the evaluation metrics on the other, for a figure in
BENCHMARKS.md. The rows are read and the curves drawn by the engine's own code
(``metrics_file.read_metrics``, ``plots.draw_panel``), so this figure and RUN_DIR/plots/ agree.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from visiontrain.rundir.metrics_file import Row, is_ema, numeric_keys, read_metrics
from visiontrain.engine.records.plots import draw_panel, save_figure
from visiontrain.evaluation.panels import panel_grid


def default_terms(train: list[Row]) -> list[str]:
    """Each loss term (not its weighted copy ``_w``, not a decoder layer's ``_0``) and the total."""
    terms = [k for k in numeric_keys(train[:1]) if k.startswith("loss") and not k.endswith("_w")
             and not k[-1].isdigit()]
    return terms + ["total"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--terms", nargs="*", help="train scalars to plot (default: every loss term and total)")
    args = p.parse_args()
    train, evals = read_metrics(args.run_dir)
    terms = args.terms or default_terms(train)
    metrics = [k for k in numeric_keys(evals) if not is_ema(k)] or numeric_keys(evals)  # EMA-only: DINO's teacher
    fig, (ax1, ax2) = panel_grid(2, title=args.run_dir.name, width=6.0, height=4.5)
    draw_panel(ax1, train, terms, title="training", legend=True)
    draw_panel(ax2, evals, metrics, marker="o", title="evaluation", legend=bool(metrics))
    out = args.out or args.run_dir / "curves.png"
    save_figure(fig, out)
    print(out)


if __name__ == "__main__":
    main()
