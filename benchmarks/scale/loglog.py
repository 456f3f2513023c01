"""What every axis of the scale benchmark shares: the log-log slope of a cost against a size, the
figure that draws it, and the process's resident memory (Linux ``/proc/self/status``)."""
from __future__ import annotations

from pathlib import Path

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


#: Where the figures go.
RESULTS = Path(__file__).resolve().parents[1] / "results"
