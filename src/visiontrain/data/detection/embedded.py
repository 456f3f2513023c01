"""Two detection datasets built on the fly into a cache dir, as standard COCO (read with ``read_coco``);
fashion-mosaic as COCO panoptic too.

``build_fashion_mosaic``: textured canvases (smooth colour field + stripes + noise) of random width and
height with 1-8 Fashion-MNIST items pasted at random scales and positions; 10 categories (ids 1..10,
Fashion-MNIST's names). Train items come from Fashion-MNIST's train set, val and test items from its test
set (the test split is for ``visiontrain validate --split test``; training never sees its items).
An item is pasted through its mask (scaled intensity >= ``MASK_THRESHOLD``), tinted by a random colour,
so the texture shows around it. A later item may hide part of an earlier one (box IoU <= 0.3 and at
most 30% of an item's mask hidden, else the placement is retried); every box is the tight box of the
item's *visible* mask pixels (``paste_item`` returns the box of a whole mask), and its ``segmentation``
those pixels, as compressed RLE (instance segmentation's ground truth).

Behind the items, two kinds of "stuff" for panoptic segmentation: the textured canvas is the *wall*;
in about 75% of the images the pixels below a slightly slanted line (at 40-85% of the height) are a
*floor* instead, tiles or planks of 8-32 px with darker grout lines 1-2 px wide, per-tile shades and
a little noise: sharp straight edges repeating every tile, which the wall's smooth field and soft
stripes lack, so floor and wall can be told apart locally, not only by position. Every draw of the
floor comes from its own generator (seeded by the seed, the split and the image), never from the
split's stream: the items, their boxes and masks are those of version 3, which had no floor.
``annotations/panoptic_{split}.json`` and ``annotations/panoptic_{split}/*.png`` hold each split in
COCO's panoptic format: one segment per item (its visible pixels, exactly its instance mask), one
"wall" (category 11) and one "floor" (12) segment of the remaining pixels, where there are any; every
pixel is in one segment (no VOID); the PNGs are written by ``core.panoptic_format``.

``build_neon_trees``: the NEON aerial images with hand-drawn tree crowns that ship in the ``deepforest``
2.1.0 wheel, annotated from the wheel's Pascal VOC XML files (the only annotation that every image has;
the CSVs are partial copies: example.csv has 79 of the 279 boxes of the YELL crop). VOC coordinates are
taken as they are (DeepForest's convention: pixel edges, 0-based). Every label ("Tree", and SOAP_061's
"Dead" / "Alive") becomes the single category 1 "Tree". Each image is cut into a grid of ``tile`` x
``tile`` tiles without overlap; the last row / column is padded with black on the right / bottom, so no
pixel is in two tiles and the train/val split (by tile) leaks nothing. A box is clipped to its tile and
kept if it keeps >= 50% of its area and >= 2 px on each side.

Both builds are deterministic from the seed, happen once (a complete dir is reused), and are atomic:
written into a temporary dir next to the target, then renamed into place.
"""
from __future__ import annotations

import colorsys
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
from PIL import Image

from visiontrain.core.panoptic_format import write_panoptic_png
from visiontrain.data.datasets import fashion_mnist
from visiontrain.data.detection.masks import encode, mask_area, rle_dict
from visiontrain.data.detection.tiles import Tile, clip_boxes

log = logging.getLogger("visiontrain")

MASK_THRESHOLD = 32          # scaled item intensity at or above which a pixel belongs to the item
MAX_IOU, MAX_HIDDEN, TRIES = 0.3, 0.3, 10
SCALE_RANGE = (0.8, 3.0)     # x 28 px
FLOOR_SHARE = 0.75           # the share of fashion-mosaic images with a floor
FLOOR_HEIGHT = (0.4, 0.85)   # the floor line's height at mid-width, x the image height from the top
FLOOR_SLOPE = 0.1            # the floor line's largest slope, rows per column (about 6 degrees)
TILE_SIDE, GROUT = (8, 32), (1, 2)   # px: a floor tile's width and height, a grout line's width
WALL_ID, FLOOR_ID = 11, 12   # the stuff categories of the panoptic annotation (the items are 1..10)
NEON_IMAGES = ("OSBS_029", "SOAP_061", "2019_YELL_2_541000_4977000_image_crop",
               "2019_YELL_2_528000_4978000_image_crop2")
DEEPFOREST_HINT = ("pip install --no-deps deepforest==2.1.0 (scripts/setup.sh installs it; --no-deps: only "
                   "its data files are used, deepforest itself is never imported)")
_MARKER = "BUILD.json"
_REQUIRED = ("annotations/train.json", "annotations/val.json")   # what a complete build holds, at least


def _is_complete(target: Path, params: dict, required: tuple[str, ...] = _REQUIRED) -> bool:
    try:
        return json.loads((target / _MARKER).read_text()) == params and all(
            (target / name).is_file() for name in required)
    except (OSError, ValueError):
        return False


def _build_atomically(target: Path, params: dict, what: str, write: Callable[[Path], None],
                      required: tuple[str, ...] = _REQUIRED) -> Path:
    """Run ``write(tmp_dir)`` and rename ``tmp_dir`` to ``target``, unless ``target`` is already complete:
    built with ``params`` and holding the ``required`` files."""
    if _is_complete(target, params, required):
        return target
    if target.exists():  # incomplete, or built by other code or parameters: replaced
        log.warning("replacing %s: incomplete or built with other parameters", target)
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        log.info("building %s into %s (once; reused afterwards)", what, target)
        write(tmp)
        (tmp / _MARKER).write_text(json.dumps(params))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished the same build first
            if not _is_complete(target, params, required):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_coco(path: Path, images: list, annotations: list, categories: list, description: str) -> None:
    coco = {"info": {"description": description, "version": "1"}, "licenses": [], "images": images,
            "annotations": annotations, "categories": categories}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(coco, separators=(",", ":")))


def _ann(ann_id: int, image_id: int, category_id: int, x1: int, y1: int, x2: int, y2: int,
         segmentation: dict | None = None) -> dict:
    """A COCO annotation; with a ``segmentation``, ``area`` is its pixel count (COCO's rule)."""
    w, h = x2 - x1, y2 - y1
    ann = {"id": ann_id, "image_id": image_id, "category_id": category_id, "bbox": [x1, y1, w, h],
           "area": w * h, "iscrowd": 0}
    if segmentation is not None:
        ann["segmentation"] = segmentation
        ann["area"] = mask_area(segmentation["counts"], *segmentation["size"])
    return ann


# ---------------------------------------------------------------------------------- fashion-mosaic
def scale_item(item: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """(pixels uint8 [s, s], mask bool [s, s]) of a square grey item resized by ``scale`` (bilinear)."""
    side = max(1, int(round(item.shape[0] * scale)))
    pixels = np.asarray(Image.fromarray(np.ascontiguousarray(item, dtype=np.uint8)).resize(
        (side, side), Image.BILINEAR))
    return pixels, pixels >= MASK_THRESHOLD


def _mask_box(mask: np.ndarray) -> tuple[int, int, int, int]:
    rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
    if rows.size == 0:
        raise ValueError("the item has no pixel >= MASK_THRESHOLD")
    return int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1


def paste_item(canvas: np.ndarray, item: np.ndarray, x: int, y: int, scale: float, *,
               tint: tuple[float, float, float] = (1.0, 1.0, 1.0), owner: np.ndarray | None = None,
               index: int = 0) -> tuple[int, int, int, int]:
    """Paste grey ``item`` resized by ``scale`` with its top-left corner at (x, y) into ``canvas``
    (uint8 [H, W, 3], in place) through its mask; returns the mask's tight box (x1, y1, x2, y2), pixel
    edges in canvas coordinates. ``owner`` (int [H, W]), if given, gets ``index`` under the mask."""
    pixels, mask = scale_item(item, scale)
    s = pixels.shape[0]
    if x < 0 or y < 0 or x + s > canvas.shape[1] or y + s > canvas.shape[0]:
        raise ValueError(f"a {s}x{s} item at ({x}, {y}) does not fit in a {canvas.shape[1]}x{canvas.shape[0]} canvas")
    colour = np.clip(pixels[..., None] * np.asarray(tint, dtype=np.float32), 0, 255).astype(np.uint8)
    canvas[y:y + s, x:x + s][mask] = colour[mask]
    if owner is not None:
        owner[y:y + s, x:x + s][mask] = index
    x1, y1, x2, y2 = _mask_box(mask)
    return x + x1, y + y1, x + x2, y + y2


def _texture(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Smooth random colour field + stripes + pixel noise, uint8 [h, w, 3]."""
    gh, gw = rng.integers(2, 9, size=2)
    low = rng.integers(0, 256, size=(gh, gw, 3), dtype=np.uint8)
    field = np.asarray(Image.fromarray(low).resize((w, h), Image.BICUBIC), dtype=np.float32)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    theta, period, amp = rng.uniform(0, np.pi), rng.uniform(4, 40), rng.uniform(0, 60)
    stripes = amp * np.sin(2 * np.pi * (xx * np.cos(theta) + yy * np.sin(theta)) / period + rng.uniform(0, 6.3))
    base = rng.uniform(0.3, 0.8)  # keep the background darker than the brightest items, on average
    noise = rng.normal(0, rng.uniform(2, 20), size=(h, w, 1)).astype(np.float32)
    return np.clip(field * base + stripes[..., None] + noise, 0, 255).astype(np.uint8)


def _floor_region(rng: np.random.Generator, h: int, w: int) -> np.ndarray | None:
    """The floor of an image, bool [h, w]: the pixels whose centre lies below a line through a height
    drawn in ``FLOOR_HEIGHT`` at mid-width, of slope up to ``FLOOR_SLOPE``; None (no floor) for about
    ``1 - FLOOR_SHARE`` of the images, where the wall fills the canvas as in version 3."""
    if rng.random() >= FLOOR_SHARE:
        return None
    middle, slope = rng.uniform(*FLOOR_HEIGHT) * h, rng.uniform(-FLOOR_SLOPE, FLOOR_SLOPE)
    return np.arange(h)[:, None] + 0.5 >= middle + slope * (np.arange(w)[None] + 0.5 - w / 2)


def _floor_texture(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Tiles (or planks, or bricks: each row of tiles shifted against the one above), uint8 [h, w, 3]: each
    tile a shade of one colour, between darker grout lines, + pixel noise. Its sharp straight edges
    repeat every 8-32 px, which the wall (``_texture``: smooth field, soft stripes) never shows."""
    tile_w, tile_h = (int(v) for v in rng.integers(TILE_SIDE[0], TILE_SIDE[1] + 1, size=2))
    grout = int(rng.integers(GROUT[0], GROUT[1] + 1))
    y = np.arange(h)[:, None] + int(rng.integers(0, tile_h))
    x = np.arange(w)[None] + int(rng.integers(0, tile_w)) + (y // tile_h) * int(rng.integers(0, tile_w))
    row, col = y // tile_h, x // tile_w
    base = rng.uniform(40, 180, size=3)  # as dark as the wall, about: the items stay the brightest
    tiles = (int(row.max()) + 1, int(col.max()) + 1)
    shade = rng.normal(1, rng.uniform(0.04, 0.15), size=(*tiles, 1)) + rng.normal(0, 0.03, size=(*tiles, 3))
    pixels = (base * shade).astype(np.float32)[row, col]
    pixels[(y % tile_h < grout) | (x % tile_w < grout)] = base * rng.uniform(0.3, 0.55)
    noise = rng.normal(0, rng.uniform(2, 8), size=(h, w, 1)).astype(np.float32)
    return np.clip(pixels + noise, 0, 255).astype(np.uint8)


def _iou(a: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    iw = np.clip(np.minimum(a[2], boxes[:, 2]) - np.maximum(a[0], boxes[:, 0]), 0, None)
    ih = np.clip(np.minimum(a[3], boxes[:, 3]) - np.maximum(a[1], boxes[:, 1]), 0, None)
    inter = iw * ih
    area = lambda b: (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])  # noqa: E731
    return inter / (area(a) + area(boxes) - inter)


class _Mosaic(NamedTuple):
    """One fashion-mosaic image: its pixels, its items' ``(category_id, x1, y1, x2, y2, rle)``, the index
    of the item that shows at each pixel (-1: none) and its floor pixels (None: no floor)."""

    canvas: np.ndarray
    anns: list[tuple[int, int, int, int, int, str]]
    owner: np.ndarray
    floor: np.ndarray | None


def _place_items(rng: np.random.Generator, canvas: np.ndarray, owner: np.ndarray,
                 items: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Paste 1-8 random items into ``canvas`` (and their indices into ``owner``), each placement retried
    while it overlaps a placed box too much or hides too much of a placed item; returns each placed
    item's (source index, x, y, side)."""
    h, w = owner.shape
    placed: list[tuple[int, int, int, int]] = []
    boxes, totals = np.zeros((0, 4), np.float64), []
    for _ in range(int(rng.integers(1, 9))):
        src = int(rng.integers(0, len(items)))
        tint = tuple(rng.uniform(0.6, 1.0, size=3))
        for _ in range(TRIES):
            scale = min(rng.uniform(*SCALE_RANGE), min(h, w) / items.shape[1])
            pixels, mask = scale_item(items[src], scale)
            s = pixels.shape[0]
            x, y = int(rng.integers(0, w - s + 1)), int(rng.integers(0, h - s + 1))
            mx1, my1, mx2, my2 = _mask_box(mask)
            box = np.array([x + mx1, y + my1, x + mx2, y + my2], np.float64)
            if len(boxes) and _iou(box, boxes).max() > MAX_IOU:
                continue
            hidden = np.bincount(owner[y:y + s, x:x + s][mask].astype(np.int64) + 1, minlength=len(placed) + 1)[1:]
            visible = np.bincount(owner[owner >= 0].astype(np.int64), minlength=len(placed))
            if len(placed) and ((visible - hidden) < (1 - MAX_HIDDEN) * np.asarray(totals)).any():
                continue
            paste_item(canvas, items[src], x, y, scale, tint=tint, owner=owner, index=len(placed))
            placed.append((src, x, y, s))
            boxes, totals = np.vstack([boxes, box]), totals + [int(mask.sum())]
            break
    return placed


def _mosaic(rng: np.random.Generator, floor_rng: np.random.Generator, items: np.ndarray, labels: np.ndarray,
            min_size: int, max_size: int) -> _Mosaic:
    """One image: each item's box is that of its visible pixels, and its rle (compressed COCO RLE counts)
    those pixels. The floor draws only from ``floor_rng``: ``rng`` is read as version 3 read it (size,
    wall, items), so the items land where they did before there was a floor."""
    h, w = (int(v) for v in rng.integers(min_size, max_size + 1, size=2))
    canvas, owner = _texture(rng, h, w), np.full((h, w), -1, dtype=np.int16)
    floor = _floor_region(floor_rng, h, w)
    if floor is not None:
        canvas[floor] = _floor_texture(floor_rng, h, w)[floor]
    placed = _place_items(rng, canvas, owner, items)
    anns = []
    visible = encode(owner[None] == np.arange(len(placed), dtype=np.int16)[:, None, None]) if placed else []
    for i, (src, x, y, s) in enumerate(placed):
        x1, y1, x2, y2 = _mask_box(owner[y:y + s, x:x + s] == i)
        anns.append((int(labels[src]) + 1, x + x1, y + y1, x + x2, y + y2, visible[i]))
    return _Mosaic(canvas, anns, owner, floor)


def _segment(segment_id: int, category_id: int, region: np.ndarray) -> dict:
    """A COCO panoptic ``segments_info`` entry: ``area`` the pixel count, ``bbox`` the tight box (xywh)."""
    x1, y1, x2, y2 = _mask_box(region)
    return {"id": segment_id, "category_id": category_id, "area": int(region.sum()),
            "bbox": [x1, y1, x2 - x1, y2 - y1], "iscrowd": 0}


def _panoptic_segments(mosaic: _Mosaic) -> tuple[np.ndarray, list[dict]]:
    """The id map [H, W] and ``segments_info`` of one image: item i is segment i + 1 (its visible pixels,
    its instance mask), then the wall and the floor, each where it has a pixel, take the next ids."""
    ids = mosaic.owner.astype(np.int32) + 1
    segments = [_segment(i + 1, ann[0], ids == i + 1) for i, ann in enumerate(mosaic.anns)]
    free = ids == 0
    floor = mosaic.floor if mosaic.floor is not None else np.zeros_like(free)
    for category_id, region in ((WALL_ID, free & ~floor), (FLOOR_ID, free & floor)):
        if region.any():
            ids[region] = len(segments) + 1
            segments.append(_segment(len(segments) + 1, category_id, region))
    return ids, segments


def panoptic_categories() -> list[dict]:
    """fashion-mosaic's COCO panoptic categories: the ten items (things, ids 1..10, the instance json's
    names, bright colours around the hue circle), then ``wall`` and ``floor`` (stuff, dull colours)."""
    names = fashion_mnist.CLASS_NAMES
    things = [{"id": i + 1, "name": name, "supercategory": "garment", "isthing": 1,
               "color": [int(round(255 * c)) for c in colorsys.hsv_to_rgb(i / len(names), 0.7, 0.95)]}
              for i, name in enumerate(names)]
    return things + [{"id": WALL_ID, "name": "wall", "supercategory": "room", "isthing": 0, "color": [120, 120, 140]},
                     {"id": FLOOR_ID, "name": "floor", "supercategory": "room", "isthing": 0, "color": [140, 95, 50]}]


def _mosaic_split(out: Path, split: str, seed: int, split_index: int, n: int, items: np.ndarray,
                  labels: np.ndarray, sizes: tuple[int, int]) -> tuple[list, list, list]:
    """Draw a split's ``n`` images into ``out/split/`` and their panoptic PNGs into
    ``out/annotations/panoptic_{split}/``; returns (images, instance annotations, panoptic annotations).
    Each split draws from its own stream (adding one changes no other), each image's floor from its own."""
    rng = np.random.default_rng([seed, split_index])
    pan_dir = out / "annotations" / f"panoptic_{split}"
    (out / split).mkdir()
    pan_dir.mkdir(parents=True)
    images, annotations, panoptic = [], [], []
    for image_id in range(1, n + 1):
        mosaic = _mosaic(rng, np.random.default_rng([seed, split_index, image_id, 1]), items, labels, *sizes)
        h, w = mosaic.canvas.shape[:2]
        file_name = f"{image_id:06d}.png"
        Image.fromarray(mosaic.canvas).save(out / split / file_name, compress_level=1)
        images.append({"id": image_id, "file_name": file_name, "height": h, "width": w})
        for *box, counts in mosaic.anns:
            annotations.append(_ann(len(annotations) + 1, image_id, *box, segmentation=rle_dict(counts, h, w)))
        ids, segments = _panoptic_segments(mosaic)
        write_panoptic_png(pan_dir / file_name, ids)
        panoptic.append({"image_id": image_id, "file_name": file_name, "segments_info": segments})
    return images, annotations, panoptic


def build_fashion_mosaic(cache_dir: str | Path, *, seed: int = 0, train_images: int = 2000, val_images: int = 400,
                         test_images: int = 400, min_size: int = 128, max_size: int = 256,
                         fashion_root: str | None = None, download: bool = False) -> Path:
    """Build (once) ``cache_dir/fashion-mosaic-s{seed}-{train_images}-{val_images}-{test_images}/``
    (``-{min}-{max}`` appended for non-default sizes) holding ``{train,val,test}/*.png``,
    ``annotations/{train,val,test}.json`` (instances) and ``annotations/panoptic_{train,val,test}.json``
    with ``annotations/panoptic_{train,val,test}/*.png`` (COCO panoptic). Train images are made of
    Fashion-MNIST's train items; val and test images of its test items, each split from its own
    random stream: the test split is evaluated only by ``validate --split test``, and no training
    image holds one of its items. ``fashion_root`` / ``download`` go to ``load_fashion_mnist``."""
    if not 28 <= min_size <= max_size:
        raise ValueError(f"fashion-mosaic: need 28 <= min_size <= max_size, got {min_size}, {max_size}")
    name = f"fashion-mosaic-s{seed}-{train_images}-{val_images}-{test_images}"
    if (min_size, max_size) != (128, 256):
        name += f"-{min_size}-{max_size}"
    params = {"dataset": "fashion-mosaic", "seed": seed, "train_images": train_images, "val_images": val_images,
              "test_images": test_images, "min_size": min_size, "max_size": max_size, "version": 4}
    categories = [{"id": i + 1, "name": n} for i, n in enumerate(fashion_mnist.CLASS_NAMES)]

    def write(tmp: Path) -> None:
        (train_x, train_y), (test_x, test_y) = fashion_mnist.load_fashion_mnist(root=fashion_root, download=download)
        sources = {"train": (train_x, train_y, "train"), "val": (test_x, test_y, "test"),
                   "test": (test_x, test_y, "test")}
        splits = (("train", train_images), ("val", val_images), ("test", test_images))
        for split_index, (split, n) in enumerate(splits):
            x, y, source = sources[split]
            images, annotations, panoptic = _mosaic_split(tmp, split, seed, split_index, n, np.asarray(x)[:, 0],
                                                          np.asarray(y), (min_size, max_size))
            description = f"fashion-mosaic {split}: Fashion-MNIST {source} items on textures, seed {seed}"
            _write_coco(tmp / "annotations" / f"{split}.json", images, annotations, categories, description)
            _write_coco(tmp / "annotations" / f"panoptic_{split}.json", images, panoptic, panoptic_categories(),
                        f"{description}, panoptic")

    what = f"fashion-mosaic ({train_images} train / {val_images} val / {test_images} test images, seed {seed})"
    required = tuple(f"annotations/{kind}{split}.json" for split in ("train", "val") for kind in ("", "panoptic_"))
    return _build_atomically(Path(cache_dir) / name, params, what, write, required)


# ------------------------------------------------------------------------------------- neon-trees
def deepforest_data_dir() -> Path:
    """The ``data/`` folder of the installed deepforest package (found without importing it)."""
    spec = importlib.util.find_spec("deepforest")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"neon-trees needs the images inside the deepforest wheel: {DEEPFOREST_HINT}")
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    missing = [f"{n}{ext}" for n in NEON_IMAGES for ext in (".png", ".xml") if not (data / f"{n}{ext}").is_file()]
    if missing:
        raise FileNotFoundError(f"{data} lacks {', '.join(missing)}: {DEEPFOREST_HINT}")
    return data


def read_voc_boxes(xml_path: Path) -> np.ndarray:
    """All boxes of a VOC XML file as float64 [N, 4] XYXY (every label counts as a tree)."""
    root = ET.parse(xml_path).getroot()
    return np.array([[float(o.find(f"bndbox/{k}").text) for k in ("xmin", "ymin", "xmax", "ymax")]
                     for o in root.iter("object")], dtype=np.float64).reshape(-1, 4)


def tile_boxes(boxes: np.ndarray, x0: int, y0: int, tile: int) -> np.ndarray:
    """Boxes clipped to the tile at (x0, y0), in tile coordinates; kept if they keep >= 50% of their
    area and >= 2 px on each side (``tiles.clip_boxes``, the rule of `visiontrain tile` too)."""
    clipped, keep = clip_boxes(boxes, Tile(x0, y0, tile, tile), min_visibility=0.5)
    return clipped[keep]


def build_neon_trees(cache_dir: str | Path, *, tile: int = 400, val_fraction: float = 0.25, seed: int = 0) -> Path:
    """Build (once) ``cache_dir/neon-trees-t{tile}-s{seed}-v{val_fraction}/``: ``tile`` x ``tile`` tiles of
    the deepforest wheel's NEON images, split by tile (``val_fraction`` of the tiles, >= 1 with boxes)."""
    data = deepforest_data_dir()
    if tile < 2 or not 0 < val_fraction < 1:
        raise ValueError(f"neon-trees: need tile >= 2 and 0 < val_fraction < 1, got {tile}, {val_fraction}")
    name = f"neon-trees-t{tile}-s{seed}-v{val_fraction:g}"
    params = {"dataset": "neon-trees", "tile": tile, "val_fraction": val_fraction, "seed": seed, "version": 1}

    def write(tmp: Path) -> None:
        tiles = []   # (file name, pixels, boxes in tile coordinates)
        for stem in NEON_IMAGES:
            with Image.open(data / f"{stem}.png") as im:
                pixels = np.asarray(im.convert("RGB"))
            boxes = read_voc_boxes(data / f"{stem}.xml")
            h, w = pixels.shape[:2]
            for y0 in range(0, h, tile):
                for x0 in range(0, w, tile):
                    crop = np.zeros((tile, tile, 3), np.uint8)   # black padding right / bottom
                    part = pixels[y0:y0 + tile, x0:x0 + tile]
                    crop[:part.shape[0], :part.shape[1]] = part
                    tiles.append((f"{stem}_x{x0}_y{y0}.png", crop, tile_boxes(boxes, x0, y0, tile)))
        n_val = min(max(1, int(round(val_fraction * len(tiles)))), len(tiles) - 1)
        order = [int(i) for i in np.random.default_rng(seed).permutation(len(tiles))]
        if not any(len(tiles[i][2]) for i in order[:n_val]):   # make sure val has boxes
            first = next(k for k in range(n_val, len(order)) if len(tiles[order[k]][2]))
            order[n_val - 1], order[first] = order[first], order[n_val - 1]
        for split, chosen in (("train", sorted(order[n_val:])), ("val", sorted(order[:n_val]))):
            (tmp / split).mkdir()
            images, annotations = [], []
            for image_id, i in enumerate(chosen, 1):
                file_name, crop, boxes = tiles[i]
                Image.fromarray(crop).save(tmp / split / file_name, compress_level=1)
                images.append({"id": image_id, "file_name": file_name, "height": tile, "width": tile})
                for box in boxes:
                    x1, y1, x2, y2 = (int(round(v)) for v in box)
                    annotations.append(_ann(len(annotations) + 1, image_id, 1, x1, y1, x2, y2))
            _write_coco(tmp / "annotations" / f"{split}.json", images, annotations, [{"id": 1, "name": "Tree"}],
                        f"neon-trees {split}: {tile} px tiles of deepforest 2.1.0's NEON images, seed {seed}")

    return _build_atomically(Path(cache_dir) / name, params, f"neon-trees ({tile} px tiles, seed {seed})", write)
