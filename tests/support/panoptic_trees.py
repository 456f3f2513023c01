"""A tiny COCO panoptic tree in the layout a user points ``data.root`` at (docs/datasets.md):
``annotations/panoptic_<split>.json``, ``annotations/panoptic_<split>/*.png`` (segment ids as
colours) and ``<split>/*.png``; and the same scenes as a Cityscapes panoptic tree
(``write_cityscapes_panoptic``).

Every image is flat regions whose grey level is their category's (``GREY``), so that a test can tell
from the pixels alone which category a mask or a semantic label should say: two stuff categories
(sky above, ground below), two thing categories (boxes and a bar) placed by the image's index, and a
VOID strip (no segment) along the bottom."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

from visiontrain.core.panoptic_format import write_panoptic_png

CATEGORIES = [{"id": 1, "name": "box", "isthing": 1}, {"id": 2, "name": "bar", "isthing": 1},
              {"id": 3, "name": "sky", "isthing": 0}, {"id": 4, "name": "ground", "isthing": 0}]
GREY = {1: 160, 2: 240, 3: 40, 4: 90}  # category id -> the grey of its pixels; VOID: 0


def scene(index: int, height: int = 48, width: int = 64) -> tuple[np.ndarray, list[dict]]:
    """(ids uint32 [H, W], segments_info) of image ``index``."""
    ids = np.zeros((height, width), np.uint32)
    ids[: height // 2] = 1            # sky
    ids[height // 2: height - 2] = 2  # ground; the last two rows VOID
    segments = [{"id": 1, "category_id": 3, "iscrowd": 0}, {"id": 2, "category_id": 4, "iscrowd": 0}]
    r = index % 4
    for k, (y, x, h, w, category) in enumerate([(4 + r, 4 + 2 * r, 12, 12, 1), (20, 30 + r, 14, 10, 1),
                                                (30, 6, 6, 40 - 2 * r, 2)]):
        ids[y:y + h, x:x + w] = 10 + k
        segments.append({"id": 10 + k, "category_id": category, "iscrowd": 0})
    for s in segments:
        rows, cols = np.nonzero(ids == s["id"])
        s["area"] = int(len(rows))
        s["bbox"] = [int(cols.min()), int(rows.min()), int(cols.max() - cols.min() + 1),
                     int(rows.max() - rows.min() + 1)]
    return ids, segments


def rgb_of(ids: np.ndarray, segments: list[dict]) -> np.ndarray:
    """The image an id map draws: each segment's pixels the grey of its category, VOID black."""
    grey = np.zeros(ids.shape, np.uint8)
    for s in segments:
        grey[ids == s["id"]] = GREY[s["category_id"]]
    return np.repeat(grey[..., None], 3, axis=-1)


def write_coco_panoptic(root: Path, splits: dict[str, int] | None = None) -> Path:
    """``root`` as a COCO panoptic tree: ``splits`` name -> image count (default train 6, val 3)."""
    for split, n in (splits or {"train": 6, "val": 3}).items():
        (root / split).mkdir(parents=True, exist_ok=True)
        (root / "annotations" / f"panoptic_{split}").mkdir(parents=True, exist_ok=True)
        images, annotations = [], []
        for i in range(n):
            ids, segments = scene(i)
            name = f"{i:04d}.png"
            Image.fromarray(rgb_of(ids, segments)).save(root / split / name)
            write_panoptic_png(root / "annotations" / f"panoptic_{split}" / name, ids)
            images.append({"id": i + 1, "file_name": name, "height": ids.shape[0], "width": ids.shape[1]})
            annotations.append({"image_id": i + 1, "file_name": name, "segments_info": segments})
        (root / "annotations" / f"panoptic_{split}.json").write_text(json.dumps(
            {"images": images, "annotations": annotations, "categories": CATEGORIES}))
    return root


# ----------------------------------------------------------------------------- Cityscapes panoptic
#: The categories cityscapesscripts' createPanopticImgs lists: the 19 train classes by label id, the 8
#: with instances things.
CITYSCAPES_CATEGORIES = [{"id": i, "name": n, "isthing": int(i >= 24)} for i, n in [
    (7, "road"), (8, "sidewalk"), (11, "building"), (12, "wall"), (13, "fence"), (17, "pole"), (19, "traffic light"),
    (20, "traffic sign"), (21, "vegetation"), (22, "terrain"), (23, "sky"), (24, "person"), (25, "rider"), (26, "car"),
    (27, "truck"), (28, "bus"), (31, "train"), (32, "motorcycle"), (33, "bicycle")]]
#: The scene's categories as Cityscapes labels: the boxes cars, the bar a person, the sky sky, the ground road.
AS_CITYSCAPES = {1: 26, 2: 24, 3: 23, 4: 7}
CITIES = ("aachen", "frankfurt")


def cityscapes_scene(index: int) -> tuple[np.ndarray, list[dict]]:
    """``scene(index)`` with Cityscapes' ids, as createPanopticImgs numbers segments: a stuff segment's
    id its label id, a thing's label id * 1000 + its instance."""
    ids, segments = scene(index)
    out_ids, out_segments = np.zeros_like(ids), []
    for k, s in enumerate(segments):
        label = AS_CITYSCAPES[s["category_id"]]
        new = label * 1000 + k if label >= 24 else label
        out_ids[ids == s["id"]] = new
        out_segments.append({**s, "id": new, "category_id": label})
    return out_ids, out_segments


def cityscapes_image_id(i: int) -> str:
    """Image ``i`` of a split: the cities in turn (``aachen_000000_000019``, ``frankfurt_000001_000019``...)."""
    return f"{CITIES[i % 2]}_{i:06d}_000019"


def write_cityscapes_panoptic(root: Path, splits: dict[str, int] | None = None) -> Path:
    """``root`` as Cityscapes after createPanopticImgs: ``leftImg8bit/<split>/<city>/<id>_leftImg8bit.png``,
    ``gtFine/cityscapes_panoptic_<split>.json`` (string image ids, each ``images`` entry's file_name the
    ``..._gtFine_leftImg8bit.png`` the script writes, no file) and ``gtFine/cityscapes_panoptic_<split>/``;
    ``splits``: name -> image count (default train 6, val 3). Each image is ``scene(i)``'s pixels."""
    for split, n in (splits or {"train": 6, "val": 3}).items():
        pngs = root / "gtFine" / f"cityscapes_panoptic_{split}"
        pngs.mkdir(parents=True, exist_ok=True)
        images, annotations = [], []
        for i in range(n):
            image_id = cityscapes_image_id(i)
            city = root / "leftImg8bit" / split / image_id.split("_")[0]
            city.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rgb_of(*scene(i))).save(city / f"{image_id}_leftImg8bit.png")
            ids, segments = cityscapes_scene(i)
            write_panoptic_png(pngs / f"{image_id}_gtFine_panoptic.png", ids)
            images.append({"id": image_id, "file_name": f"{image_id}_gtFine_leftImg8bit.png",
                           "height": ids.shape[0], "width": ids.shape[1]})
            annotations.append({"image_id": image_id, "file_name": f"{image_id}_gtFine_panoptic.png",
                                "segments_info": segments})
        (root / "gtFine" / f"cityscapes_panoptic_{split}.json").write_text(json.dumps(
            {"images": images, "annotations": annotations, "categories": CITYSCAPES_CATEGORIES}))
    return root
