"""Instance masks as COCO's compressed run-length encoding (RLE), through pycocotools' ``mask`` module.

A split's masks are read once, when the dataset is built, and kept as one compressed RLE string a
box (``RecordIndex.masks``): a few hundred bytes an object instead of a bitmap the size of its image,
so a DataLoader worker's copy stays small. ``DetectionDataset.load`` decodes an image's masks when
it loads the image, as a ``tv_tensors.Mask`` [N, H, W] that the v2 transforms resize, flip and crop
with the image and its boxes.

What a reader can give, and how it is checked (``segmentation_rle``):

- COCO polygons: a list of ``[x1, y1, x2, y2, ...]`` lists in pixels, each of at least 3 points;
  every coordinate inside the image (1 px of rounding allowed, as for boxes);
- COCO RLE: ``{"size": [h, w], "counts": str | list}``, compressed or not (crowd regions use the
  uncompressed form); ``size`` must be the image's;
- YOLO segmentation lines (Ultralytics' ``class x1 y1 x2 y2 ...``, normalised): made into a polygon
  in pixels by the reader and checked as one.

A mask with no pixel at all is bad data too: it cannot be trained on or matched.
"""
from __future__ import annotations

import re
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from pycocotools import mask as coco_mask

__all__ = ["compressed_runs", "decode", "encode", "mask_area", "polygon_rle", "rle_dict", "segmentation_rle",
           "segmentations"]


def encode(masks: np.ndarray) -> list[str]:
    """Compressed RLE counts (ASCII) of bool or uint8 masks [N, H, W]."""
    masks = np.asarray(masks, dtype=np.uint8).reshape(-1, *np.shape(masks)[-2:])
    return [rle["counts"].decode("ascii") for rle in coco_mask.encode(np.asfortranarray(masks.transpose(1, 2, 0)))]


#: What pycocotools' ``mask.decode`` warns on every call under NumPy 2 (its Cython array has an
#: ``__array__`` without the ``copy`` keyword): harmless, and 1,400 of them a test run buried the rest.
NUMPY2_COPY_WARNING = "__array__ implementation doesn't accept a copy keyword"


def decode(counts: Sequence[str], height: int, width: int) -> np.ndarray:
    """uint8 [N, height, width] masks from compressed RLE counts (``encode``'s)."""
    if not len(counts):
        return np.zeros((0, height, width), np.uint8)
    with warnings.catch_warnings():  # that one warning, only here, where it is raised
        warnings.filterwarnings("ignore", message=re.escape(NUMPY2_COPY_WARNING), category=DeprecationWarning)
        stacked = coco_mask.decode([{"size": [height, width], "counts": c} for c in counts])  # [H, W, N]
    return np.ascontiguousarray(stacked.transpose(2, 0, 1))


def mask_area(counts: str, height: int, width: int) -> float:
    """Pixels in one compressed RLE mask: COCO's ``area`` of a segmentation."""
    return float(coco_mask.area({"size": [height, width], "counts": counts}))


def rle_dict(counts: str, height: int, width: int) -> dict[str, Any]:
    """A compressed RLE as COCO writes it in JSON (``segmentation`` of results and ground truth)."""
    return {"size": [int(height), int(width)], "counts": counts}


def segmentations(masks: np.ndarray) -> list[dict[str, Any]]:
    """Bool or uint8 masks [N, H, W] as COCO ``segmentation`` dicts (compressed RLE, ``rle_dict``):
    what a result in COCO's format carries, in ``detections.json`` and in evaluation alike."""
    height, width = np.shape(masks)[-2:]
    return [rle_dict(counts, height, width) for counts in encode(masks)]


def polygon_rle(polygons: Sequence[Sequence[float]], height: int, width: int) -> tuple[str | None, str]:
    """(compressed counts, "") of polygons in pixels, or (None, what is wrong with them)."""
    if not polygons:
        return None, "has an empty polygon list"
    for k, poly in enumerate(polygons):
        try:
            xy = np.asarray(poly, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError):
            return None, f"polygon {k} is not a list of numbers"
        if xy.size % 2 or xy.size < 6:
            return None, f"polygon {k} has {xy.size} coordinates (needs x, y pairs, at least 3 points)"
        if not np.isfinite(xy).all():
            return None, f"polygon {k} has a coordinate that is not finite"
        x, y = xy[0::2], xy[1::2]
        if x.min() < -1 or y.min() < -1 or x.max() > width + 1 or y.max() > height + 1:
            return None, (f"polygon {k} reaches ({x.min():g}..{x.max():g}, {y.min():g}..{y.max():g}), outside the "
                          f"{width}x{height} image")
    rles = coco_mask.frPyObjects([np.asarray(p, dtype=np.float64).reshape(-1).tolist() for p in polygons],
                                 height, width)
    return _nonempty(coco_mask.merge(rles))


def _nonempty(rle: dict[str, Any]) -> tuple[str | None, str]:
    if coco_mask.area(rle) == 0:
        return None, "is an empty mask (no pixel)"
    counts = rle["counts"]
    return (counts.decode("ascii") if isinstance(counts, bytes) else counts), ""


def compressed_runs(counts: str) -> list[int]:
    """The run lengths a compressed RLE string holds (pycocotools' ``rleFrString``, read back in
    Python): pycocotools decodes a string without checking that its runs add up to the image, and
    writes past its buffer when they add up to more, so a reader checks them before decoding."""
    runs: list[int] = []
    pos = 0
    while pos < len(counts):
        value, shift, more = 0, 0, True
        while more:
            c = ord(counts[pos]) - 48
            value |= (c & 0x1F) << shift
            more, pos, shift = bool(c & 0x20), pos + 1, shift + 5
            if not more and c & 0x10:
                value |= -1 << shift
        runs.append(value + (runs[-2] if len(runs) > 2 else 0))
    return runs


def segmentation_rle(segmentation: Any, height: int, width: int) -> tuple[str | None, str]:
    """A COCO ``segmentation`` (polygons, or RLE compressed or not) of an image of ``height`` x
    ``width`` as (compressed counts, ""), or (None, what is wrong with it) for the reader's message."""
    if isinstance(segmentation, list):
        return polygon_rle(segmentation, height, width)
    if not isinstance(segmentation, dict) or "counts" not in segmentation or "size" not in segmentation:
        return None, f"is neither polygons nor an RLE with size and counts: {str(segmentation)[:80]}"
    size = segmentation["size"]
    if not isinstance(size, (list, tuple)) or [int(v) for v in size] != [height, width]:
        return None, f"is an RLE of size {size} (h, w) for a {width}x{height} (WxH) image"
    counts = segmentation["counts"]
    try:
        if isinstance(counts, list):  # uncompressed (crowd regions)
            if sum(int(c) for c in counts) != height * width:
                return None, f"is an uncompressed RLE of {sum(int(c) for c in counts)} pixels for {height * width}"
            rle = coco_mask.frPyObjects({"size": [height, width], "counts": counts}, height, width)
        else:
            counts = counts.decode("ascii") if isinstance(counts, bytes) else str(counts)
            runs = compressed_runs(counts)
            if sum(runs) != height * width or min(runs, default=0) < 0:
                return None, f"is a compressed RLE of {sum(runs)} pixels for {height * width}"
            rle = {"size": [height, width], "counts": counts}
    except (TypeError, ValueError, OverflowError, IndexError, UnicodeDecodeError) as err:
        return None, f"is an RLE that cannot be decoded ({err})"
    return _nonempty(rle)
