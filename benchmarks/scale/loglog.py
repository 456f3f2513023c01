"""What every axis of the scale benchmark shares: the log-log slope of a cost against a size, the
figure that draws it, and the process's resident memory (Linux ``/proc/self/status``)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np


def slope(xs: list[float], ys: list[float]) -> float:
    """The log-log slope of a least-squares line: 1 is linear in the size."""
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def draw(panels: list[tuple[str, str, dict[str, tuple[list[float], list[float]]]]], out: Path,
         title: str | None = None) -> None:
    """One log-log panel per (x label, y label, {curve label: (xs, ys)}), each curve's slope in its
    label; written to ``out`` (PNG, matplotlib's Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels) + 1, 4), squeeze=False)
    for ax, (xlabel, ylabel, curves) in zip(axes[0], panels):
        for label, (xs, ys) in curves.items():
            ax.loglog(xs, ys, "o-", label=f"{label} (slope {slope(xs, ys):.2f})")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def rss_kib(field: str = "VmRSS") -> int:
    """This process's resident memory (``VmRSS``) or its high-water mark (``VmHWM``, which writing
    5 to ``/proc/self/clear_refs`` starts again), in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def in_child(script: str, *args: str) -> dict[str, Any]:
    """``python SCRIPT --one ARGS``: one measurement in a fresh process (its memory and caches its
    own); the JSON line it prints last."""
    out = subprocess.run([sys.executable, script, "--one", *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(doc: str, run: Callable[[bool], list[dict]], measure: Callable[[str], dict], quick_help: str) -> None:
    """An axis's command line: every row as a JSON line (``--quick``: the small sizes), or, with
    ``--one ARG`` (what ``in_child`` runs), one measurement."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one)))
        return
    for row in run(args.quick):
        print(json.dumps(row))


#: Where the figures go.
RESULTS = Path(__file__).resolve().parents[1] / "results"
