"""What a user looks at before trusting a run: images as the model receives them, with their
labels, boxes and instance masks, and the statistics of a detection training set's labels
(Ultralytics' ``train_batch*.jpg`` and ``labels.jpg``). A wrong label map, a transform that drops or
shifts the boxes or masks, or a class with ten boxes in all shows here before a week of GPU time is
spent on it.

The batch is one RGB image composed with PIL, the labels a ``matplotlib.figure.Figure`` (no pyplot
state), both from plain tensors and arrays: the tasks say what each image is, this module draws.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from visiontrain.evaluation.fonts import use_fonts_with_glyphs

#: A colour per class, cycling: boxes of one class look alike across the images.
PALETTE = ("#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6", "#bfef45",
           "#fabed4", "#469990", "#dcbeff", "#9a6324", "#800000", "#aaffc3", "#808000", "#000075")
#: How much of a filled mask's class colour covers the image under it: the image stays readable.
MASK_ALPHA = 0.45


def class_rgb(label: int) -> np.ndarray:
    """The class's ``PALETTE`` colour as RGB floats in [0, 1]."""
    colour = PALETTE[int(label) % len(PALETTE)]
    return np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)], np.float64) / 255.0


def mask_outline(mask: np.ndarray, width: int = 1) -> np.ndarray:
    """The pixels of a bool mask [h, w] within ``width`` pixels of its edge (a neighbour, up, down,
    left or right, outside it or outside the image)."""
    inner = np.asarray(mask, bool)
    for _ in range(width):
        padded = np.pad(inner, 1)
        inner = inner & padded[:-2, 1:-1] & padded[2:, 1:-1] & padded[1:-1, :-2] & padded[1:-1, 2:]
    return np.asarray(mask, bool) & ~inner


def paint_masks(pixels: np.ndarray, masks: np.ndarray | None, labels: Sequence[int], *, outline: bool = False,
                alpha: float = MASK_ALPHA) -> np.ndarray:
    """An image ([H, W] or [H, W, 3] in [0, 1]) with instance masks (bool [N, h, w], one class index
    each) drawn in their class colours: filled, the colour at ``alpha`` over the image (what a model
    predicted), or ``outline``d opaque (the ground truth, left visible under a prediction). A mask
    smaller than the image covers its top-left corner, where a padded batch holds the image before
    its padding. Returns a new RGB [H, W, 3] array. An outline is 1 px wide per 300 px of the image's
    longer side (at least 1), so that it stays visible in a figure's panel."""
    rgb = np.repeat(pixels[..., None], 3, axis=-1) if pixels.ndim == 2 else pixels[..., :3]
    rgb = np.array(rgb, np.float64)
    if masks is None or not len(masks):
        return rgb
    masks = np.asarray(masks, bool)
    h, w = masks.shape[-2:]
    region = rgb[:h, :w]  # a view: painting it paints rgb
    width = max(1, round(max(rgb.shape[:2]) / 300))
    for mask, label in zip(masks, labels):
        colour = class_rgb(label)
        if outline:
            region[mask_outline(mask, width)] = colour
        else:
            region[mask] = (1 - alpha) * region[mask] + alpha * colour
    return rgb


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
    the image's pixels) each with a class index into the figure's names, and the boxes' instance
    masks where the data has them (bool [N, h, w], drawn filled: ``paint_masks``)."""
    pixels: np.ndarray
    caption: str = ""
    boxes: np.ndarray = field(default_factory=lambda: np.zeros((0, 4)))
    labels: Sequence[int] = ()
    masks: np.ndarray | None = None


def tiles_image(rows: list[list[Tile]], *, title: str, class_names: Sequence[str] = (), cell: int = 160) -> np.ndarray:
    """The tiles (rows may differ in length: DINO's global and local crops) composed into one RGB
    uint8 image under ``title``: each scaled to fill a cell ``cell`` pixels wide
    (as tall as the tallest tile's aspect needs; nearest neighbour, so small inputs keep their
    pixels), its caption above it, its masks filled and its boxes drawn in their class's colour with
    the class name.
    Drawn with PIL on one canvas, not as a matplotlib figure: a grid of axes took seconds at the
    start of every run."""
    from PIL import Image, ImageDraw

    aspect = max(t.pixels.shape[0] / t.pixels.shape[1] for r in rows for t in r)  # height / width
    cell_h, caption, gap, head = int(round(cell * aspect)), 14, 4, 24
    cols = max(len(r) for r in rows)
    canvas = Image.new("RGB", (cols * (cell + gap) + gap, head + len(rows) * (cell_h + caption + gap) + gap), "white")
    draw = ImageDraw.Draw(canvas)
    draw.text((gap, 6), title, fill="black")
    for r, row in enumerate(rows):
        for c, tile in enumerate(row):
            x0, y0 = gap + c * (cell + gap), head + gap + r * (cell_h + caption + gap) + caption
            painted = paint_masks(tile.pixels, tile.masks, tile.labels) if tile.masks is not None else tile.pixels
            pixels = np.clip(painted * 255.0 + 0.5, 0, 255).astype(np.uint8)
            h, w = pixels.shape[:2]
            scale = min(cell / w, cell_h / h)
            size = (max(1, round(w * scale)), max(1, round(h * scale)))
            canvas.paste(Image.fromarray(pixels).convert("RGB").resize(size, Image.NEAREST), (x0, y0))
            draw.text((x0, y0 - caption + 1), tile.caption, fill="black")
            for box, label in zip(np.asarray(tile.boxes).reshape(-1, 4).tolist(), tile.labels):
                colour = PALETTE[int(label) % len(PALETTE)]
                x1, y1, x2, y2 = (x0 + box[0] * scale, y0 + box[1] * scale, x0 + box[2] * scale, y0 + box[3] * scale)
                draw.rectangle((x1, y1, x2, y2), outline=colour, width=1)
                name = str(class_names[int(label)]) if int(label) < len(class_names) else str(int(label))
                left, top, right, bottom = draw.textbbox((x1, y1), name)
                draw.rectangle((x1, y1 - (bottom - top) - 2, x1 + right - left + 2, y1), fill=colour)
                draw.text((x1 + 1, y1 - (bottom - top) - 2), name, fill="white")
    return np.asarray(canvas)


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
    return use_fonts_with_glyphs(fig)
