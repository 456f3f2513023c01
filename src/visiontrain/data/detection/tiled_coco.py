"""`visiontrain tile`: a detection source's splits cut into overlapping tiles (``tiles.tile_grid``),
written as a COCO dataset that ``data.name=coco data.root=OUT`` reads back, split names unchanged:

    OUT/annotations/instances_<split>.json
    OUT/<split>/<source>__x0512_y0000.jpg    (the source's path under its split's folder, the tile's offset)

Large aerial and medical images train at a size a detector can take without losing their small
objects to a resize. The samples come from ``visiontrain.data.shards.raw`` (the readers training
uses, with their checks and bad-data policies); boxes and masks are cut by ``tiles.cut_objects``.
Each tile's image entry names its ``source_file``, ``source_image_id``, ``offset`` ([x, y] of its
corner in the source) and the source's size, so a prediction on a tile maps back to its image; each
annotation its ``source_annotation_id`` (-1: the source had none). A JPEG source's tiles are JPEG
(quality 95), any other's PNG (lossless). Tiles without an object are mostly background: of the
train split's, ``keep_empty`` are kept (chosen by a hash of the tile's file name, the same every
time), of the other splits all (an evaluation on the tiles with objects only would count none of
the false detections on the rest).
"""
from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from visiontrain.data.detection import masks as rle
from visiontrain.data.detection.tiles import Tile, TileObjects, check_tiling, cut_objects, rle_pieces, tile_grid
from visiontrain.data.images import decode_rgb
from visiontrain.data.shards.raw import RawData, RawSplit

#: How a tile is written, by its source's extension: (extension, PIL format, save options); PNG otherwise.
ENCODINGS = {"jpg": ("jpg", "JPEG", {"quality": 95}), "jpeg": ("jpg", "JPEG", {"quality": 95})}
LOSSLESS = ("png", "PNG", {"compress_level": 1})


@dataclass(frozen=True)
class TileOptions:
    """How `visiontrain tile` cuts: the tile's side in pixels, the share of it a neighbour overlaps,
    the share of a box's area a tile must show to keep it, the share of the train split's empty
    tiles kept."""

    size: int
    overlap: float = 0.2
    min_visibility: float = 0.3
    keep_empty: float = 0.1

    def check(self) -> None:
        """A ``ValueError`` naming the option (as `visiontrain tile` spells it) that is out of range."""
        check_tiling(self.size, self.overlap, ("--size", "--overlap"))
        for name, value in (("--min-visibility", self.min_visibility), ("--keep-empty", self.keep_empty)):
            if not 0 <= value <= 1:
                raise ValueError(f"{name}: a share in [0, 1], got {value!r}")


def source_stems(paths: Sequence[str]) -> list[str]:
    """Each image's name for its tiles: its path under the images' deepest common folder, without
    its extension (``a/img``, ``b/img`` stay apart); a name taken twice (``x.jpg`` and ``x.png``)
    gets ``-2``, ``-3``..."""
    if not paths:
        return []
    root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
    stems, taken = [], set()
    for path in paths:
        stem = Path(os.path.relpath(os.path.abspath(path), root)).with_suffix("").as_posix()
        name, n = stem, 1
        while name.lower() in taken:  # lower: a case-insensitive file system clashes too
            n += 1
            name = f"{stem}-{n}"
        taken.add(name.lower())
        stems.append(name)
    return stems


def keeps_empty(name: str, share: float) -> bool:
    """Whether an empty tile is kept: a hash of its file name under ``share`` (the same at every run,
    whatever the order the images are read in)."""
    return zlib.crc32(name.encode()) / 2**32 < share


def refuse_written(out: Path, names: Sequence[str]) -> None:
    """Nothing is written over an earlier tiling: a split's folder with files, or its annotation file,
    is an error before anything is read."""
    for name in names:
        folder, ann = out / name, out / "annotations" / f"instances_{name}.json"
        if ann.exists() or (folder.is_dir() and any(folder.iterdir())):
            raise ValueError(f"--out {out}: split {name!r} is there already ({ann if ann.exists() else folder}); "
                             f"remove it, or choose another --out")


def write_tiles(raw: RawData, out: Path, options: TileOptions, train_split: str,
                advance: Callable[[int], None] = lambda n: None) -> dict[str, dict[str, int]]:
    """Every split of ``raw`` (detection samples) cut into tiles under ``out`` (the module docstring);
    ``train_split`` names the split whose empty tiles are thinned; ``advance(1)`` after each source
    image. Returns, by split: its source images, tiles, boxes and empty tiles left out."""
    if raw.kind != "detection" or raw.category_ids is None:
        raise ValueError("visiontrain tile cuts detection data (boxes and masks); this source is "
                         f"{raw.kind}: a classifier takes a whole image")
    options.check()
    splits = list({split.name: split for split in raw.splits}.values())  # a split named twice is written once
    refuse_written(out, [split.name for split in splits])
    categories = [{"id": c, "name": n} for c, n in zip(raw.category_ids, raw.class_names)]
    return {split.name: write_split(split, out, categories, options,
                                    options.keep_empty if split.name == train_split else 1.0, advance)
            for split in splits}


def write_split(split: RawSplit, out: Path, categories: list[dict[str, Any]], options: TileOptions,
                keep_empty: float, advance: Callable[[int], None]) -> dict[str, int]:
    """One split's tiles and ``annotations/instances_<split>.json`` (written last, through a
    temporary name: a split whose file is there is whole)."""
    folder = out / split.name
    folder.mkdir(parents=True, exist_ok=True)
    coco: dict[str, Any] = {"images": [], "annotations": [], "categories": categories}
    category_ids, left_out = [c["id"] for c in categories], 0
    for i, stem in enumerate(source_stems([split.source(i) for i in range(split.count)])):
        sample = split.load(i)
        left_out += tile_image(decoded(sample.image, sample.labels), sample.labels, stem, folder, coco, category_ids,
                               options, keep_empty)
        advance(1)
    ann = out / "annotations" / f"instances_{split.name}.json"
    ann.parent.mkdir(parents=True, exist_ok=True)
    partial = ann.with_name(f".{ann.name}.partial")
    partial.write_text(json.dumps(coco, separators=(",", ":")))
    os.replace(partial, ann)
    return {"images": split.count, "tiles": len(coco["images"]), "boxes": len(coco["annotations"]),
            "empty_tiles_left_out": left_out}


def decoded(data: bytes, labels: dict[str, Any]) -> Image.Image:
    """The sample's image, upright RGB, as training decodes it, checked against the reader's size."""
    image = decode_rgb(data, f"image file {labels['source']}")
    if image.size != (labels["width"], labels["height"]):
        raise ValueError(f"image file {labels['source']}: decoded as {image.size[0]}x{image.size[1]} (WxH), but "
                         f"its header said {labels['width']}x{labels['height']} when it was read (the file changed?)")
    return image


def tile_image(image: Image.Image, labels: dict[str, Any], stem: str, folder: Path, coco: dict[str, Any],
               category_ids: list[int], options: TileOptions, keep_empty: float) -> int:
    """One source image's tiles written into ``folder`` and entered in ``coco``; returns how many
    empty tiles were left out."""
    ext, fmt, save = ENCODINGS.get(Path(labels["source"]).suffix.lower().lstrip("."), LOSSLESS)
    height, width = labels["height"], labels["width"]
    boxes = np.asarray(labels["boxes"], dtype=np.float64).reshape(-1, 4)
    pieces = rle_pieces(labels["masks"], height, width) if "masks" in labels else None
    left_out = 0
    for tile in tile_grid(height, width, options.size, options.overlap):
        objects = cut_objects(boxes, pieces, tile, options.min_visibility)
        name = tile.name(stem, ext)
        if not len(objects.index) and not keeps_empty(name, keep_empty):
            left_out += 1
            continue
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        image.crop((tile.x0, tile.y0, tile.x1, tile.y1)).save(folder / name, fmt, **save)
        image_id = len(coco["images"]) + 1
        coco["images"].append({"id": image_id, "file_name": name, "width": tile.width, "height": tile.height,
                               "source_file": labels["source"], "source_image_id": labels["image_id"],
                               "offset": [tile.x0, tile.y0], "source_width": width, "source_height": height})
        coco["annotations"] += annotations(objects, labels, tile, image_id, len(coco["annotations"]) + 1,
                                           category_ids)
    return left_out


def annotations(objects: TileObjects, labels: dict[str, Any], tile: Tile, image_id: int, first_id: int,
                category_ids: list[int]) -> list[dict[str, Any]]:
    """A tile's objects as COCO annotations (ids from ``first_id``), each mask as compressed RLE, its
    area the mask's (COCO's rule) or else the box's."""
    counts = rle.encode(objects.masks) if objects.masks is not None else None
    crowd = labels.get("crowd")
    out = []
    for k, i in enumerate(objects.index.tolist()):
        x1, y1, x2, y2 = (float(v) for v in objects.boxes[k])
        ann = {"id": first_id + k, "image_id": image_id, "category_id": category_ids[labels["labels"][i]],
               "bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1),
               "iscrowd": int(bool(crowd[i])) if crowd else 0, "source_annotation_id": labels["ann_ids"][i]}
        if counts is not None:
            ann["segmentation"] = rle.rle_dict(counts[k], tile.height, tile.width)
            ann["area"] = rle.mask_area(counts[k], tile.height, tile.width)
        out.append(ann)
    return out
