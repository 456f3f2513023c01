"""Shared by the detection CLI tests: run the CLI in a subprocess, and a few-image fashion-mosaic
laid out as a COCO dataset (``annotations/instances_<split>.json``, ``<split>/*.png``). And for the
instance-mask tests: scenes of flat shapes, each painted in its class's colour, written as a COCO
dataset with polygon ``segmentation``s (``masks_coco``) or as a YOLO segmentation dataset
(``masks_yolo``), so a test can read every object's mask back from the image's pixels."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any, Sequence

from procs import run_cli


def vt(*args: str) -> subprocess.CompletedProcess:
    """``python -m visiontrain ARGS`` on one thread, output captured (a hang fails with its stacks)."""
    return run_cli(*args, timeout=600)


def mosaic_coco(tmp_path_factory, train_images: int, val_images: int, classes: int | None = None) -> Path:
    """A small fashion-mosaic as COCO; ``classes`` keeps only the first N categories (and their boxes)."""
    return mosaic_coco_at(tmp_path_factory.mktemp("mosaic"), tmp_path_factory.mktemp("coco"), train_images,
                          val_images, classes)


def mosaic_coco_at(cache: Path, root: Path, train_images: int, val_images: int, classes: int | None = None) -> Path:
    """``mosaic_coco`` built in ``cache`` and laid out as COCO in ``root``."""
    from visiontrain.data.detection.embedded import build_fashion_mosaic

    base = build_fashion_mosaic(cache, train_images=train_images, val_images=val_images)
    (root / "annotations").mkdir(parents=True)
    for split in ("train", "val"):
        data = json.loads((base / "annotations" / f"{split}.json").read_text())
        if classes is not None:
            keep = {c["id"] for c in data["categories"][:classes]}
            data["categories"] = [c for c in data["categories"] if c["id"] in keep]
            data["annotations"] = [a for a in data["annotations"] if a["category_id"] in keep]
        (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(data))
        shutil.copytree(base / split, root / split)
    return root


# ------------------------------------------------------------------------------ instance masks

MASK_CLASSES = ("red", "green", "blue")
MASK_COLOURS = ((230, 40, 40), (40, 230, 40), (40, 40, 230))  # the colour of label 0, 1, 2
MASK_BACKGROUND = (100, 100, 100)
Scene = tuple[int, int, Sequence[tuple[int, Sequence[float]]]]  # (width, height, [(label, polygon in pixels)])
#: Two wide and two tall images (two aspect-ratio groups) of shapes that touch neither each other nor the border.
MASK_SCENES: tuple[Scene, ...] = (
    (64, 48, ((0, (6, 6, 28, 6, 28, 24, 6, 24)), (1, (36, 8, 58, 40, 36, 40)))),
    (72, 40, ((2, (40, 4, 66, 20, 40, 34)), (1, (4, 10, 30, 10, 30, 30, 4, 30)), (0, (34, 28, 38, 28, 38, 36)))),
    (40, 60, ((0, (8, 30, 20, 42, 32, 30, 20, 52)), (2, (6, 4, 32, 4, 32, 22, 6, 22)))),
    (36, 64, ((1, (4, 6, 30, 6, 18, 40)), (2, (4, 46, 30, 46, 30, 60, 4, 60)))),
)


def scene_masks(scene: Scene) -> Any:
    """uint8 [N, H, W]: each polygon of ``scene`` rasterised as COCO rasterises it (pycocotools)."""
    from pycocotools import mask as coco_mask

    from visiontrain.data.detection.masks import decode  # pycocotools' decode, its NumPy 2 warning filtered

    width, height, objects = scene
    rles = [coco_mask.frPyObjects([list(map(float, poly))], height, width)[0] for _, poly in objects]
    return decode([rle["counts"].decode("ascii") for rle in rles], height, width)


def scene_image(scene: Scene) -> Any:
    """uint8 [H, W, 3]: the background, with each object's mask pixels in its label's colour."""
    import numpy as np

    width, height, objects = scene
    pixels = np.empty((height, width, 3), np.uint8)
    pixels[:] = MASK_BACKGROUND
    for (label, _), mask in zip(objects, scene_masks(scene)):
        pixels[mask.astype(bool)] = MASK_COLOURS[label]
    return pixels


def _polygon_box(poly: Sequence[float]) -> list[float]:
    xs, ys = poly[0::2], poly[1::2]
    return [min(xs), min(ys), max(xs) - min(xs), max(ys) - min(ys)]


def masks_coco(root: Path, scenes: Sequence[Scene] = MASK_SCENES, splits: Sequence[str] = ("train", "val"),
               extra: Sequence[dict[str, Any]] = ()) -> Path:
    """``scenes`` as a COCO dataset under ``root`` (every split the same images, ``<split>/<i>.png``):
    one annotation an object, its ``segmentation`` the polygon, its bbox the polygon's box; ``extra``
    annotations (given whole: a test's crowd region or bad mask) are added to each split."""
    from PIL import Image

    (root / "annotations").mkdir(parents=True)
    for split in splits:
        (root / split).mkdir()
        images, anns = [], []
        for i, scene in enumerate(scenes, 1):
            Image.fromarray(scene_image(scene)).save(root / split / f"{i}.png")
            images.append({"id": i, "file_name": f"{i}.png", "width": scene[0], "height": scene[1]})
            for label, poly in scene[2]:
                anns.append({"id": len(anns) + 1, "image_id": i, "category_id": label + 1, "iscrowd": 0,
                             "bbox": _polygon_box(poly), "segmentation": [list(poly)]})
        cats = [{"id": c + 1, "name": n} for c, n in enumerate(MASK_CLASSES)]
        (root / "annotations" / f"instances_{split}.json").write_text(
            json.dumps({"images": images, "annotations": anns + list(extra), "categories": cats}))
    return root


def yolo_polygon_line(label: int, poly: Sequence[float], width: int, height: int) -> str:
    """Ultralytics' segmentation line: ``class x1 y1 x2 y2 ...``, divided by the image width and height."""
    return " ".join([str(label), *(repr(v / (width if k % 2 == 0 else height)) for k, v in enumerate(poly))])


def masks_yolo(root: Path, scenes: Sequence[Scene] = MASK_SCENES, splits: Sequence[str] = ("train", "val")) -> Path:
    """``scenes`` as a YOLO segmentation dataset under ``root`` (every split the same images): one
    polygon line an object, in ``labels/<split>/<i>.txt``."""
    from PIL import Image

    for split in splits:
        (root / "images" / split).mkdir(parents=True)
        (root / "labels" / split).mkdir(parents=True)
        for i, scene in enumerate(scenes, 1):
            width, height, objects = scene
            Image.fromarray(scene_image(scene)).save(root / "images" / split / f"{i}.png")
            (root / "labels" / split / f"{i}.txt").write_text(
                "".join(yolo_polygon_line(label, poly, width, height) + "\n" for label, poly in objects))
    (root / "data.yaml").write_text(f"names: [{', '.join(MASK_CLASSES)}]\n")
    return root


# ---------------------------------------------------------------------------------------- COCO
def coco_truth() -> dict:
    """6 images, categories 1/5/9; small (<32^2), medium and large boxes, a crowd region, an image
    without annotations."""
    images = [{"id": i, "width": 640, "height": 480, "file_name": f"{i}.jpg"} for i in (1, 2, 3, 4, 5, 7)]
    raw = [  # image, category, bbox xywh, iscrowd
        (1, 1, [10, 10, 20, 20], 0), (1, 5, [100, 100, 60, 50], 0), (1, 9, [200, 150, 200, 150], 0),
        (2, 1, [50, 60, 25, 30], 0), (2, 1, [300, 200, 150, 120], 0), (2, 9, [0, 0, 400, 300], 1),
        (3, 5, [30, 40, 15, 18], 0), (3, 5, [400, 300, 80, 90], 0), (3, 9, [100, 100, 300, 250], 0),
        (4, 9, [20, 20, 64, 64], 0), (4, 1, [500, 400, 12, 10], 0),  # the last one is never found
        (5, 5, [10, 200, 200, 200], 0), (5, 1, [250, 50, 40, 40], 0),
    ]  # image 7: no annotations
    anns = [{"id": k + 1, "image_id": im, "category_id": c, "bbox": b, "area": float(b[2] * b[3]),
             "iscrowd": cr} for k, (im, c, b, cr) in enumerate(raw)]
    cats = [{"id": 1, "name": "a"}, {"id": 5, "name": "b"}, {"id": 9, "name": "c"}]
    return {"images": images, "annotations": anns, "categories": cats}


def coco_detections() -> list[dict]:
    """Detections of ``coco_truth``'s images: near hits, loose hits, false positives, a hit on the crowd region."""
    d = [  # image, category, bbox xywh, score: near hits, loose hits, FPs, a hit on the crowd region
        (1, 1, [11, 10, 20, 21], 0.95), (1, 5, [104, 98, 58, 55], 0.80), (1, 9, [210, 160, 190, 150], 0.90),
        (1, 1, [300, 300, 30, 30], 0.60),
        (2, 1, [52, 58, 22, 30], 0.70), (2, 1, [310, 190, 150, 130], 0.85), (2, 9, [10, 10, 100, 100], 0.50),
        (3, 5, [33, 42, 15, 18], 0.40), (3, 5, [390, 310, 90, 80], 0.75), (3, 9, [120, 90, 290, 240], 0.65),
        (3, 1, [100, 100, 50, 50], 0.30),
        (4, 9, [22, 18, 60, 66], 0.88), (5, 5, [0, 220, 190, 200], 0.55), (5, 1, [250, 50, 40, 40], 0.99),
        (7, 5, [10, 10, 100, 80], 0.45), (7, 9, [100, 100, 200, 200], 0.35),
    ]
    return [{"image_id": i, "category_id": c, "bbox": [float(v) for v in b], "score": s} for i, c, b, s in d]
