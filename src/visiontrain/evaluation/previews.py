"""What a user looks at before trusting a run: images as the model receives them, with their
labels and boxes, and the statistics of a detection training set's labels (Ultralytics'
``train_batch*.jpg`` and ``labels.jpg``). A wrong label map, a transform that drops or shifts the
boxes, or a class with ten boxes in all shows here before a week of GPU time is spent on it.

Built with ``matplotlib.figure.Figure`` (no pyplot state), from plain tensors and arrays: the tasks
say what each image is, this module only draws.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

#: A colour per class, cycling: boxes of one class look alike across the images.
PALETTE = ("#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6", "#bfef45",
           "#fabed4", "#469990", "#dcbeff", "#9a6324", "#800000", "#aaffc3", "#808000", "#000075")


def display_pixels(image: torch.Tensor, mean: Sequence[float] | None = None,
                   std: Sequence[float] | None = None) -> np.ndarray:
    """A [C, H, W] image as the model receives it, made viewable: uint8 as is; a normalised float
    image back to [0, 1] with its ``mean``/``std``, or, where they are not known, stretched to its
    own range (exact for one channel, close for three). Returns [H, W] or [H, W, 3] in [0, 1]."""
    x = image.detach().cpu().float()
    if image.dtype == torch.uint8:
        x = x / 255.0
    elif mean is not None and std is not None:
        x = x * torch.tensor(std).view(-1, 1, 1) + torch.tensor(mean).view(-1, 1, 1)
    else:
        low, high = x.min(), x.max()
        x = (x - low) / (high - low).clamp_min(1e-12)
    x = x.clamp(0.0, 1.0)
    return x[0].numpy() if x.shape[0] == 1 else x[:3].permute(1, 2, 0).numpy()


@dataclass
class Tile:
    """One image of a grid: its pixels ([H, W] or [H, W, 3] in [0, 1]), a caption, and boxes (XYXY in
    the image's pixels) each with a class index into the figure's names."""
    pixels: np.ndarray
    caption: str = ""
    boxes: np.ndarray = field(default_factory=lambda: np.zeros((0, 4)))
    labels: Sequence[int] = ()


def tiles_figure(rows: list[list[Tile]], *, title: str, class_names: Sequence[str] = (), size: float = 2.4) -> Any:
    """A grid of tiles (rows may differ in length: DINO's global and local crops), boxes drawn in
    their class's colour with the class name."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    cols = max(len(r) for r in rows)
    aspect = max(t.pixels.shape[0] / t.pixels.shape[1] for r in rows for t in r)  # height / width
    height = (size * aspect + 0.25) * len(rows) + 0.6  # 0.25 in: each row's captions
    fig = Figure(figsize=(size * cols, height))
    fig.subplots_adjust(left=0.02, right=0.98, bottom=0.02, top=1 - 0.75 / height, hspace=0.25, wspace=0.05)
    fig.suptitle(title, fontsize=10)
    axes = fig.subplots(len(rows), cols, squeeze=False)
    for r, row in enumerate(rows):
        for c in range(cols):
            ax = axes[r][c]
            ax.set_axis_off()
            if c >= len(row):
                continue
            tile = row[c]
            ax.imshow(tile.pixels, cmap="gray" if tile.pixels.ndim == 2 else None, vmin=0.0, vmax=1.0)
            for box, label in zip(np.asarray(tile.boxes).reshape(-1, 4).tolist(), tile.labels):
                colour = PALETTE[int(label) % len(PALETTE)]
                x1, y1, x2, y2 = box
                ax.add_patch(Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, edgecolor=colour, linewidth=1.0))
                name = class_names[int(label)] if int(label) < len(class_names) else str(int(label))
                ax.text(x1, y1, str(name), color="white", fontsize=5, va="bottom",
                        bbox=dict(facecolor=colour, alpha=0.75, pad=0.5, linewidth=0))
            if tile.caption:
                ax.set_title(tile.caption, fontsize=7)
    return fig


def boxes_caption(n: int) -> str:
    return f"{n} box" if n == 1 else f"{n} boxes"


def grid(tiles: list[Tile], cols: int) -> list[list[Tile]]:
    """Tiles in rows of ``cols``."""
    return [tiles[i:i + cols] for i in range(0, len(tiles), cols)]


def labels_figure(boxes: np.ndarray, labels: np.ndarray, image_sizes: np.ndarray, class_names: Sequence[str], *,
                  title: str) -> Any:
    """A detection training set's labels at a glance: boxes per class, box width and height
    relative to their image, and where the box centres fall.

    ``boxes`` [N, 4] XYXY pixels, ``labels`` [N], ``image_sizes`` [N, 2] = (height, width) of each
    box's image."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13.0, 3.8))
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.2, top=0.85, wspace=0.3)
    fig.suptitle(title, fontsize=10)
    ax_count, ax_size, ax_centre = fig.subplots(1, 3)
    c = len(class_names)
    counts = np.bincount(labels.astype(np.int64), minlength=c)[:c] if len(labels) else np.zeros(c, np.int64)
    ax_count.bar(range(c), counts, color=[PALETTE[i % len(PALETTE)] for i in range(c)])
    ax_count.set_title(f"boxes per class ({int(counts.sum())} in all)", fontsize=9)
    if c <= 40:
        ax_count.set_xticks(range(c), [str(n) for n in class_names], rotation=60, ha="right", fontsize=7)
    ax_count.tick_params(labelsize=7)
    h, w = image_sizes[:, 0].astype(np.float64), image_sizes[:, 1].astype(np.float64)
    bw, bh = (boxes[:, 2] - boxes[:, 0]) / np.maximum(w, 1), (boxes[:, 3] - boxes[:, 1]) / np.maximum(h, 1)
    cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2 / np.maximum(w, 1), (boxes[:, 1] + boxes[:, 3]) / 2 / np.maximum(h, 1)
    for ax, x, y, name in ((ax_size, bw, bh, ("width / image width", "height / image height")),
                           (ax_centre, cx, cy, ("centre x / image width", "centre y / image height"))):
        if len(x):
            ax.hist2d(x, y, bins=40, range=[[0, 1], [0, 1]], cmap="Blues", cmin=1)
        else:
            ax.text(0.5, 0.5, "no boxes", ha="center", va="center", transform=ax.transAxes)
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel=name[0], ylabel=name[1])
        ax.xaxis.label.set_size(8)
        ax.yaxis.label.set_size(8)
        ax.tick_params(labelsize=7)
    ax_size.set_title("box sizes", fontsize=9)
    ax_centre.set_title("box centres", fontsize=9)
    ax_centre.invert_yaxis()  # image coordinates: y down
    return fig
