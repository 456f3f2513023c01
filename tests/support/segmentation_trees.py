"""Tiny semantic segmentation trees in the layouts a user points ``data.root`` at (docs/datasets.md):
a segmentation folder (``images/<split>/*.png`` and ``labels/<split>/*.png``, grey label PNGs,
``classes.txt``) and Pascal VOC's (``ImageSets/Segmentation``, ``JPEGImages``, ``SegmentationClass``
as palette PNGs with a 255 border round each object, as VOC draws it).

Every image is a few flat rectangles on a dark ground, each rectangle's grey level ``GREY[class]``,
so that a test can tell from the pixels alone which class a label should say."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

FOLDER_CLASSES = ("ground", "square", "bar")
GREY = (0, 120, 240)  # the pixels of each class, in every channel


def scene(index: int, height: int = 40, width: int = 56) -> np.ndarray:
    """uint8 [H, W] class map of image ``index``: ground 0, a square (1) and a bar (2) placed by the index."""
    labels = np.zeros((height, width), np.uint8)
    r = index % 5
    labels[4 + r:20 + r, 6 + 2 * r:22 + 2 * r] = 1
    labels[24:34, 10 + r:50] = 2
    return labels


def rgb_of(labels: np.ndarray) -> np.ndarray:
    """The image a class map draws: each pixel ``GREY`` of its class (any value of no class: black)."""
    grey = np.asarray(GREY, np.uint8)[np.minimum(labels, len(GREY) - 1)]
    return np.repeat(grey[..., None], 3, axis=-1)


def write_segmentation_folder(root: Path, splits: dict[str, int] | None = None) -> Path:
    """``root`` as a segmentation folder with ``classes.txt``: ``splits`` name -> image count
    (default train 6, val 3, test 2). Returns ``root``."""
    for split, n in (splits or {"train": 6, "val": 3, "test": 2}).items():
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "labels" / split).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            labels = scene(i)
            Image.fromarray(rgb_of(labels)).save(root / "images" / split / f"{split}_{i}.png")
            Image.fromarray(labels, mode="L").save(root / "labels" / split / f"{split}_{i}.png")
    (root / "classes.txt").write_text("\n".join(FOLDER_CLASSES) + "\n")
    return root


def voc_palette() -> list[int]:
    """VOC's colour map (its devkit's bitwise rule): 256 RGB triples, flattened."""
    palette = []
    for k in range(256):
        r = g = b = 0
        c = k
        for j in range(8):
            r |= ((c >> 0) & 1) << (7 - j)
            g |= ((c >> 1) & 1) << (7 - j)
            b |= ((c >> 2) & 1) << (7 - j)
            c >>= 3
        palette += [r, g, b]
    return palette


def voc_border(labels: np.ndarray) -> np.ndarray:
    """``labels`` with the 1 px edge of each object set to 255, as VOC's SegmentationClass draws it."""
    padded = np.pad(labels, 1, mode="edge")
    edge = ((padded[1:-1, 1:-1] != padded[:-2, 1:-1]) | (padded[1:-1, 1:-1] != padded[2:, 1:-1])
            | (padded[1:-1, 1:-1] != padded[1:-1, :-2]) | (padded[1:-1, 1:-1] != padded[1:-1, 2:]))
    return np.where(edge & (labels > 0), 255, labels).astype(np.uint8)


def write_voc_segmentation(root: Path, splits: dict[str, int] | None = None) -> Path:
    """``root`` as VOC2012's segmentation part: class 1 (aeroplane) where ``scene`` has a square and
    15 (person) where it has a bar, each object's edge 255; JPEG images, palette label PNGs."""
    (root / "ImageSets" / "Segmentation").mkdir(parents=True, exist_ok=True)
    (root / "JPEGImages").mkdir(exist_ok=True)
    (root / "SegmentationClass").mkdir(exist_ok=True)
    for split, n in (splits or {"train": 4, "val": 2}).items():
        ids = [f"2007_{split}_{i:03d}" for i in range(n)]
        (root / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("\n".join(ids) + "\n")
        for i, name in enumerate(ids):
            labels = scene(i)
            Image.fromarray(rgb_of(labels)).save(root / "JPEGImages" / f"{name}.jpg", quality=95)
            voc = voc_border(np.array([0, 1, 15], np.uint8)[labels])
            png = Image.fromarray(voc, mode="P")
            png.putpalette(voc_palette())
            png.save(root / "SegmentationClass" / f"{name}.png")
    return root


def interior(labels: torch.Tensor, reach: int = 2) -> torch.Tensor:
    """The pixels whose label is that of every pixel within ``reach`` of them, and not within ``reach``
    of the crop's edge (the image may blend with what lay beyond it, or a resize across an edge)."""
    padded = torch.nn.functional.pad(labels, (reach,) * 4, value=-1)
    h, w = labels.shape
    same = torch.ones_like(labels, dtype=torch.bool)
    for dy in range(2 * reach + 1):
        for dx in range(2 * reach + 1):
            same &= padded[dy:dy + h, dx:dx + w] == labels
    return same
