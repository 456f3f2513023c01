"""COCO's panoptic format, shared by the readers (``data``) and the metric (``evaluation``): an
image's segmentation is a PNG whose colour is a segment id, ``id = R + 256 G + 256² B`` (``rgb2id``,
``id2rgb``), and a JSON list ``segments_info`` gives each id its ``category_id``, ``iscrowd`` and
``area`` (``parse_segments``; ``read_panoptic`` reads a PNG and its list, checked against each other).
Id 0 (``VOID``) is no segment."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterable, Mapping

import numpy as np
from PIL import Image

__all__ = ["VOID", "ID_LIMIT", "Segment", "SegmentsInfo", "rgb2id", "id2rgb", "parse_segments", "read_panoptic",
           "write_panoptic_png", "id_map", "pixel_counts"]

#: The id of no segment (black in the PNG).
VOID = 0
#: Ids are three 8-bit channels: every id is below this, which also packs a (gt, pred) pair in one uint64.
ID_LIMIT = 256 ** 3
#: The PNG modes whose colours are the ids (a palette PNG is converted to its colours).
_COLOUR_MODES = ("RGB", "RGBA", "P")


def rgb2id(rgb: np.ndarray) -> np.ndarray:
    """Segment ids [H, W] (uint32) of a COCO panoptic PNG's pixels [H, W, 3]: R + 256 G + 256² B.

    Widened before the sum: in uint8, ``256 * G`` would wrap around."""
    rgb = np.asarray(rgb)
    if rgb.ndim != 3 or rgb.shape[-1] not in (3, 4):
        raise ValueError(f"rgb2id needs an [H, W, 3] colour array, got shape {tuple(rgb.shape)}")
    rgb = rgb[..., :3].astype(np.uint32)
    return rgb[..., 0] + 256 * rgb[..., 1] + 256 * 256 * rgb[..., 2]


def id2rgb(ids: np.ndarray) -> np.ndarray:
    """The colours [H, W, 3] (uint8) of segment ids [H, W], the inverse of ``rgb2id``."""
    ids = id_map(ids, "id2rgb")
    return np.stack([ids % 256, ids // 256 % 256, ids // (256 * 256)], axis=-1).astype(np.uint8)


@dataclass(frozen=True)
class Segment:
    """One entry of a ``segments_info`` list. ``area`` is kept as the JSON says, for the record only:
    PQ counts the id map's pixels instead (``visiontrain.evaluation.panoptic``)."""

    id: int
    category_id: int
    iscrowd: bool = False
    area: int | None = None


#: A ``segments_info`` list as the JSON has it (mappings), or as ``Segment``s.
SegmentsInfo = Iterable[Mapping[str, Any] | Segment]


def parse_segments(segments_info: SegmentsInfo, where: str = "segments_info") -> list[Segment]:
    """``Segment``s from a JSON ``segments_info`` list (``Segment``s pass as they are); ``where``
    names the list in the errors, which say which entry lacks what."""
    out = []
    for entry in segments_info:
        if isinstance(entry, Segment):
            out.append(entry)
            continue
        missing = [key for key in ("id", "category_id") if key not in entry]
        if missing:
            raise ValueError(f"{where}: an entry has no {' and no '.join(missing)}: {dict(entry)}")
        area = entry.get("area")
        out.append(Segment(int(entry["id"]), int(entry["category_id"]), bool(entry.get("iscrowd", 0)),
                           None if area is None else int(area)))
    return out


def read_panoptic(png_path: str | Path | IO[bytes], segments_info: SegmentsInfo,
                  where: str | None = None) -> tuple[np.ndarray, list[Segment]]:
    """The id map [H, W] of a COCO panoptic PNG and its ``Segment``s, checked against each other: every
    id of the PNG listed, every listed id in the PNG, no id twice (errors name the file, or ``where``:
    what a PNG's bytes in a file object are, a shard's member)."""
    where = where or str(png_path)
    with Image.open(png_path) as image:
        if image.mode not in _COLOUR_MODES:
            raise ValueError(f"{where}: a panoptic PNG holds colours (RGB), this one is mode {image.mode}: "
                             f"a semantic label map rather than segment ids?")
        ids = rgb2id(np.asarray(image.convert("RGB")))
    segments = parse_segments(segments_info, where=where)
    pixel_counts(ids, segments, where=where)
    return ids, segments


def write_panoptic_png(png_path: str | Path, ids: np.ndarray) -> None:
    """Write an id map [H, W] as a COCO panoptic PNG (a prediction to hand to other tools)."""
    Image.fromarray(id2rgb(ids)).save(png_path)  # uint8 [H, W, 3]: RGB


def id_map(ids: Any, where: str) -> np.ndarray:
    """An id map as a 2-D int64 array, checked: integers in [0, 256³), the ids a PNG can hold."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{where}: an id map is a 2-D array of integers, got {ids.dtype} of shape {tuple(ids.shape)}")
    ids = ids.astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= ID_LIMIT):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise ValueError(f"{where}: segment id {bad} is outside [0, 256³), the ids a panoptic PNG can hold")
    return ids


def pixel_counts(ids: np.ndarray, segments: list[Segment], where: str) -> dict[int, int]:
    """The pixel count of each listed segment, once the id map and its list are known to agree: a
    disagreement is what turns a PQ into nonsense without a word (detectron2#5420)."""
    listed: set[int] = set()
    for segment in segments:
        if segment.id == VOID:
            raise ValueError(f"{where}: segments_info lists id 0, which is VOID (no segment) in the id map")
        if segment.id in listed:
            raise ValueError(f"{where}: segments_info lists segment id {segment.id} twice")
        listed.add(segment.id)
    values, counts = np.unique(ids, return_counts=True)
    area = {int(v): int(c) for v, c in zip(values, counts)}
    for ids_here, ids_there, text in ((set(area) - {VOID}, listed, "is in the id map but not in segments_info"),
                                      (listed, set(area), "is in segments_info but not in the id map")):
        extra = sorted(ids_here - ids_there)
        if extra:
            more = f" (and {len(extra) - 1} more ids)" if len(extra) > 1 else ""
            raise ValueError(f"{where}: segment id {extra[0]} {text}{more}")
    return area
