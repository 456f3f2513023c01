"""Cutting a large image into overlapping tiles, with its boxes and masks: the one tiling of
``visiontrain tile`` (a dataset of tiles to train on) and of sliced prediction (``visiontrain
predict --tile``, ``visiontrain.use.tiled``), so that a model is run on the very windows it was
trained on.

The grid is SAHI's: tiles of ``size`` x ``size`` a step of ``size - floor(size * overlap)`` apart,
the last of each row and column moved back so that it ends at the image's edge (every pixel is in a
tile, no tile is padded); an image side shorter than ``size`` is one tile as long as that side, so
an image smaller than a tile is one tile, the image as it is.

A box is clipped to its tile and kept when enough of it is seen there (``clip_boxes``: the visible
share of its area at least ``min_visibility``, each side at least ``MIN_SIDE`` pixels or the whole of
a smaller box's side); the neon-trees build (``embedded.build_neon_trees``) cuts its tiles by the
same rule. A mask is cut with its tile (``MaskPiece``); an object whose mask has no pixel left in the
tile is dropped with its box, as a reader drops an empty mask.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from visiontrain.data.detection import masks as rle

#: The fewest pixels a clipped box keeps on each side (a box narrower than that from the start keeps
#: its own width): a sliver the tile's border cut off a box is no object to learn.
MIN_SIDE = 2.0


@dataclass(frozen=True)
class Tile:
    """A window of an image: its top-left corner (``x0``, ``y0``) and size, in the image's pixels."""

    x0: int
    y0: int
    width: int
    height: int

    @property
    def x1(self) -> int:
        return self.x0 + self.width

    @property
    def y1(self) -> int:
        return self.y0 + self.height

    def name(self, stem: str, ext: str) -> str:
        """The tile's file name: its source's ``stem`` and its offset, ``IMG__x0512_y0000.png``."""
        return f"{stem}__x{self.x0:04d}_y{self.y0:04d}.{ext}"


def check_tiling(size: int, overlap: float, names: tuple[str, str] = ("size", "overlap")) -> None:
    """A ``ValueError`` for a tile size that is no whole number of pixels >= 1, or an overlap outside
    [0, 1) (at 1 the tiles would not move); ``names``: how the caller calls the two."""
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"{names[0]}: the tile's side must be a whole number of pixels >= 1, got {size!r}")
    if not isinstance(overlap, (int, float)) or not 0 <= overlap < 1:
        raise ValueError(f"{names[1]}: the share of a tile its neighbour overlaps must be in [0, 1) "
                         f"(0.2: a fifth), got {overlap!r}")


def axis_starts(length: int, size: int, overlap: float) -> list[int]:
    """Where the tiles along one side of ``length`` pixels start (see the module docstring)."""
    if length <= size:
        return [0]
    step = max(1, size - math.floor(size * overlap))
    starts = list(range(0, length - size, step))
    return starts + [length - size]  # the last one flush with the edge


def tile_grid(height: int, width: int, size: int, overlap: float = 0.2) -> list[Tile]:
    """The tiles of a ``height`` x ``width`` image, row by row, each ``size`` x ``size`` (or the
    image's side where it is shorter), ``overlap`` of a tile shared with its neighbours."""
    check_tiling(size, overlap)
    return [Tile(x0, y0, min(size, width), min(size, height))
            for y0 in axis_starts(height, size, overlap) for x0 in axis_starts(width, size, overlap)]


def clip_boxes(boxes: np.ndarray, tile: Tile, min_visibility: float) -> tuple[np.ndarray, np.ndarray]:
    """(float [N, 4] XYXY boxes clipped to ``tile``, in its pixels; bool [N], which are kept): a box
    is kept when the clipped part holds at least ``min_visibility`` of its area and each of its sides
    at least ``MIN_SIDE`` pixels (or the whole side, for a box narrower than that)."""
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    clipped = np.clip(boxes - [tile.x0, tile.y0, tile.x0, tile.y0], 0, [tile.width, tile.height] * 2)
    w, h = clipped[:, 2] - clipped[:, 0], clipped[:, 3] - clipped[:, 1]
    own_w, own_h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    keep = ((w > 0) & (h > 0) & (w >= np.minimum(MIN_SIDE, own_w)) & (h >= np.minimum(MIN_SIDE, own_h))
            & (w * h >= min_visibility * own_w * own_h))
    return clipped, keep


@dataclass(frozen=True)
class MaskPiece:
    """A mask kept as the pixels of its extent (``pixels``, bool [h, w]) and where that extent's
    corner is in the image (``x0``, ``y0``): a large image's masks take the room of their objects,
    not of the image, while it is cut into tiles or put back together from them."""

    x0: int
    y0: int
    pixels: np.ndarray

    @classmethod
    def of(cls, mask: np.ndarray, x0: int = 0, y0: int = 0) -> "MaskPiece":
        """The piece of a bool [H, W] ``mask`` whose corner is at (``x0``, ``y0``) of the image."""
        rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
        if not rows.size:
            return cls(x0, y0, np.zeros((0, 0), bool))
        top, left = int(rows[0]), int(cols[0])
        return cls(x0 + left, y0 + top, np.asarray(mask[top:rows[-1] + 1, left:cols[-1] + 1], dtype=bool))

    def paste_into(self, canvas: np.ndarray, tile: Tile) -> None:
        """OR the piece's pixels inside ``tile`` into ``canvas`` (bool [tile.height, tile.width])."""
        h, w = self.pixels.shape
        left, top = max(self.x0, tile.x0), max(self.y0, tile.y0)
        right, bottom = min(self.x0 + w, tile.x1), min(self.y0 + h, tile.y1)
        if right > left and bottom > top:
            canvas[top - tile.y0:bottom - tile.y0, left - tile.x0:right - tile.x0] |= \
                self.pixels[top - self.y0:bottom - self.y0, left - self.x0:right - self.x0]


def rle_pieces(counts: Sequence[str], height: int, width: int) -> list[MaskPiece]:
    """An image's compressed RLE masks (a reader's) as pieces, decoded one at a time: a large image's
    masks are never all held at its size at once."""
    return [MaskPiece.of(rle.decode([c], height, width)[0].astype(bool)) for c in counts]


@dataclass
class TileObjects:
    """What of an image's objects a tile holds: their positions in the image's lists (``index``),
    boxes in the tile's pixels, and masks (uint8 [K, h, w]) where the image has masks."""

    index: np.ndarray
    boxes: np.ndarray
    masks: np.ndarray | None


def cut_objects(boxes: np.ndarray, pieces: Sequence[MaskPiece] | None, tile: Tile,
                min_visibility: float) -> TileObjects:
    """The objects of ``tile``: boxes by ``clip_boxes``; with ``pieces`` (the image's masks, one a
    box) their masks cut with the tile, and an object left without a mask pixel dropped."""
    clipped, keep = clip_boxes(boxes, tile, min_visibility)
    index = np.flatnonzero(keep)
    if pieces is None:
        return TileObjects(index, clipped[index], None)
    cut = np.zeros((len(index), tile.height, tile.width), bool)
    for k, i in enumerate(index):
        pieces[i].paste_into(cut[k], tile)
    seen = cut.any(axis=(1, 2)) if len(index) else np.zeros(0, bool)
    return TileObjects(index[seen], clipped[index[seen]], cut[seen].astype(np.uint8))
