"""A figure of small panels, the layout shared by the training curves and the evaluation figures.

It lives with the evaluation figures rather than in the engine because evaluation must not import
the engine (the engine's plots import it). No torch here: ``visiontrain report`` and ``compare``
draw curves without loading a training stack.
"""
from __future__ import annotations

from typing import Any


def panel_grid(n: int, *, title: str, width: float = 3.6, height: float = 2.6,
               columns: int = 4) -> tuple[Any, list[Any]]:
    """A Figure with ``n`` small panels (up to ``columns`` a row) of ``width`` x ``height`` inches;
    returns it and the used axes (the rest of the last row is hidden)."""
    from matplotlib.figure import Figure

    cols = min(columns, max(n, 1))
    rows = -(-max(n, 1) // cols)
    w, h = width * cols, height * rows + 0.5
    fig = Figure(figsize=(w, h))
    # fixed margins, in inches: a layout engine would double the drawing time
    fig.subplots_adjust(left=0.55 / w, right=1 - 0.15 / w, bottom=0.45 / h, top=1 - 0.55 / h,
                        hspace=0.55, wspace=0.3)
    fig.suptitle(title)
    axes = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]
