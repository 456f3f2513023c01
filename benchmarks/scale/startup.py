"""Start-up against the size of the data: reading COCO- and LVIS-sized annotations (with the
up-front check of every image file) and listing and checking ImageNet-sized image folders; the
main process's peak memory above its start; and the pickle each forkserver or spawned DataLoader
worker receives (the dataset, sent once per worker).

The data is synthetic with the real shapes: one tiny JPEG (64 x 48) written under every file name,
COCO's 7.27 boxes per image over 80 classes (LVIS: 1,203 classes, 12.7 per image), 1,000 class
folders for the image folder (every file a hard link to one JPEG of its folder); Pascal VOC XML
(2.4 boxes an image over 20 classes, as VOC) and YOLO txt (COCO's boxes) at COCO's sizes. Each
measurement runs in a process of its own, after its imports.

    python benchmarks/scale/startup.py [--quick] [--only coco lvis image-folder voc yolo]
"""
from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loglog import RESULTS, draw, rss_kib

COCO_SIZES = (1_000, 10_000, 40_000, 118_287)
FOLDER_SIZES = (10_000, 40_000, 300_000, 1_281_167)
QUICK_COCO, QUICK_FOLDER = (1_000, 5_000), (10_000,)


def _tiny_jpeg() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (64, 48), (120, 90, 60)).save(out, "JPEG", quality=80)
    return out.getvalue()


def _boxes(rng: random.Random, boxes_per_image: float, classes: int) -> list[tuple[float, float, float, float, int]]:
    """An image's synthetic boxes, (x, y, w, h, category id from 1) inside a 64 x 48 image."""
    out = []
    for _ in range(int(boxes_per_image) + (rng.random() < boxes_per_image % 1)):
        x, y = rng.uniform(0, 50), rng.uniform(0, 35)
        out.append((x, y, rng.uniform(2, 64 - x), rng.uniform(2, 48 - y), rng.randint(1, classes)))
    return out


def make_coco(root: Path, images: int, classes: int, boxes_per_image: float) -> Path:
    """ROOT/train/*.jpg and ROOT/annotations/instances_train.json; the annotation file's path."""
    rng, jpeg = random.Random(0), _tiny_jpeg()
    (root / "train").mkdir(parents=True)
    (root / "annotations").mkdir()
    entries, anns = [], []
    for i in range(1, images + 1):
        name = f"{i:012d}.jpg"
        (root / "train" / name).write_bytes(jpeg)
        entries.append({"id": i, "file_name": name, "width": 64, "height": 48})
        for x, y, w, h, c in _boxes(rng, boxes_per_image, classes):
            anns.append({"id": len(anns) + 1, "image_id": i, "category_id": c, "bbox": [x, y, w, h], "area": 10.0,
                         "iscrowd": 0})
    data = {"images": entries, "annotations": anns,
            "categories": [{"id": c, "name": f"class{c}"} for c in range(1, classes + 1)]}
    path = root / "annotations" / "instances_train.json"
    path.write_text(json.dumps(data))
    return path


def make_voc(root: Path, images: int, classes: int = 20, boxes_per_image: float = 2.4) -> Path:
    """ROOT/ImageSets/Main/train.txt, ROOT/Annotations/*.xml, ROOT/JPEGImages/*.jpg (VOC's 2.4 boxes an image)."""
    rng, jpeg = random.Random(0), _tiny_jpeg()
    for d in ("ImageSets/Main", "Annotations", "JPEGImages"):
        (root / d).mkdir(parents=True)
    for i in range(images):
        (root / "JPEGImages" / f"{i:06d}.jpg").write_bytes(jpeg)
        objects = "".join(f"<object><name>class{c}</name><difficult>0</difficult><bndbox><xmin>{x + 1:.1f}</xmin>"
                          f"<ymin>{y + 1:.1f}</ymin><xmax>{x + w:.1f}</xmax><ymax>{y + h:.1f}</ymax></bndbox></object>"
                          for x, y, w, h, c in _boxes(rng, boxes_per_image, classes))
        (root / "Annotations" / f"{i:06d}.xml").write_text(
            f"<annotation><filename>{i:06d}.jpg</filename><size><width>64</width><height>48</height>"
            f"<depth>3</depth></size>{objects}</annotation>")
    (root / "ImageSets" / "Main" / "train.txt").write_text("".join(f"{i:06d}\n" for i in range(images)))
    return root


def make_yolo(root: Path, images: int, classes: int = 80, boxes_per_image: float = 7.27) -> Path:
    """ROOT/images/train/*.jpg, ROOT/labels/train/*.txt (normalised centre and size), ROOT/data.yaml."""
    rng, jpeg = random.Random(0), _tiny_jpeg()
    for d in ("images/train", "labels/train"):
        (root / d).mkdir(parents=True)
    for i in range(images):
        (root / "images" / "train" / f"{i:012d}.jpg").write_bytes(jpeg)
        (root / "labels" / "train" / f"{i:012d}.txt").write_text("".join(
            f"{c - 1} {(x + w / 2) / 64:.6f} {(y + h / 2) / 48:.6f} {w / 64:.6f} {h / 48:.6f}\n"
            for x, y, w, h, c in _boxes(rng, boxes_per_image, classes)))
    (root / "data.yaml").write_text("names: [" + ", ".join(f"class{c}" for c in range(1, classes + 1)) + "]\n")
    return root


def make_folder(root: Path, images: int, classes: int = 1000) -> None:
    """ROOT/train/<class>/*.jpg and a small ROOT/val (one image a class). Every name in a class folder
    is a hard link to one tiny JPEG of that folder, so ImageNet's 1.28 M names take directory entries,
    not 1.28 M files' blocks (and stay under a file system's limit of links to one file)."""
    jpeg = _tiny_jpeg()
    for split, count in (("train", images), ("val", classes)):
        for c in range(classes):
            (root / split / f"n{c:08d}").mkdir(parents=True)
        for i in range(count):
            path = root / split / f"n{i % classes:08d}" / f"{i:08d}.JPEG"
            if i < classes:
                path.write_bytes(jpeg)
            else:
                os.link(root / split / f"n{i % classes:08d}" / f"{i % classes:08d}.JPEG", path)


def measure(kind: str, path: str) -> dict:
    """In this process: read the data as `fit` does, timed, with the memory it took."""
    from visiontrain.core._tv_compat import ensure_torchvision

    ensure_torchvision()
    from visiontrain.data.datasets.image_folder import build_image_folder
    from visiontrain.data.datasets.sources import ClassificationReader
    from visiontrain.data.detection.coco import read_coco
    from visiontrain.data.detection.voc import read_voc
    from visiontrain.data.detection.yolo import read_yolo

    Path("/proc/self/clear_refs").write_text("5")
    before = rss_kib("VmRSS")
    start = time.perf_counter()
    if kind == "coco":
        dataset = read_coco(path, str(Path(path).parents[1] / "train"))
    elif kind == "voc":
        dataset = read_voc(path, "train")
    elif kind == "yolo":
        dataset = read_yolo(path, "train")
    else:
        dataset, _, _, _ = build_image_folder(ClassificationReader(root=path, image_size=32))
        dataset.check_files("error", 0.0)
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 2), "peak_extra_mib": round((rss_kib("VmHWM") - before) / 1024, 1),
            "worker_pickle_mib": round(len(pickle.dumps(dataset)) / 2**20, 1)}


def _one(kind: str, path: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", kind, str(path)], capture_output=True, text=True,
                         check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cases(quick: bool) -> list[tuple[str, int, int, float]]:
    """(data, images, classes, boxes an image) of every row."""
    cases = [("coco", n, 80, 7.27) for n in (QUICK_COCO if quick else COCO_SIZES)]
    cases += [("lvis", QUICK_COCO[-1] if quick else 100_170, 1203, 12.7)]
    cases += [("image-folder", n, 1000, 0) for n in (QUICK_FOLDER if quick else FOLDER_SIZES)]
    cases += [("voc", n, 20, 2.4) for n in (QUICK_COCO[:1] if quick else COCO_SIZES)]
    cases += [("yolo", n, 80, 7.27) for n in (QUICK_COCO[:1] if quick else COCO_SIZES)]
    return cases


def _row(name: str, images: int, classes: int, boxes: float) -> dict:
    """One data set made in a temporary directory, measured in a process of its own, removed."""
    tmp = Path(tempfile.mkdtemp(prefix="scale-startup-"))
    try:
        if name == "image-folder":
            make_folder(tmp, images, classes)
            return _one("folder", tmp)
        if name in ("voc", "yolo"):
            return _one(name, (make_voc if name == "voc" else make_yolo)(tmp, images, classes, boxes))
        return _one("coco", make_coco(tmp, images, classes, boxes))
    finally:
        shutil.rmtree(tmp)


def run(quick: bool = False, only: list[str] | None = None) -> list[dict]:
    """One row per data set and size (``only``: those data sets, and no figure)."""
    rows = []
    for name, images, classes, boxes in _cases(quick):
        if only and name not in only:
            continue
        rows.append({"data": name, "images": images, "classes": classes, **_row(name, images, classes, boxes)})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if not quick and not only:
        panels = []
        for key, label in (("seconds", "read and check (s)"),
                           ("peak_extra_mib", "main process: peak above start (MiB)")):
            curves = {d: ([r["images"] for r in rows if r["data"] == d], [r[key] for r in rows if r["data"] == d])
                      for d in ("coco", "image-folder", "voc", "yolo")}
            panels.append(("images", label, curves))
        draw(panels, RESULTS / "scale-startup.png", "start-up against the size of the data")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes only")
    parser.add_argument("--only", nargs="+", choices=("coco", "lvis", "image-folder", "voc", "yolo"),
                        help="these data sets only (no figure)")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one)))
        return
    for row in run(args.quick, args.only):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
