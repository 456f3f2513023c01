"""Start-up against the size of the data: reading COCO- and LVIS-sized annotations (with the
up-front check of every image file) and listing and checking ImageNet-sized image folders; the
main process's peak memory above its start; and the pickle each forkserver or spawned DataLoader
worker receives (the dataset, sent once per worker).

The data is synthetic with the real shapes: one tiny JPEG (64 x 48) written under every file name,
COCO's 7.27 boxes per image over 80 classes (LVIS: 1,203 classes, 12.7 per image), 1,000 class
folders for the image folder (every file a hard link to one JPEG). Each measurement runs in a process of its own, after its imports.

    python benchmarks/scale/startup.py [--quick]
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
        for _ in range(int(boxes_per_image) + (rng.random() < boxes_per_image % 1)):
            x, y = rng.uniform(0, 50), rng.uniform(0, 35)
            anns.append({"id": len(anns) + 1, "image_id": i, "category_id": rng.randint(1, classes),
                         "bbox": [x, y, rng.uniform(2, 64 - x), rng.uniform(2, 48 - y)], "area": 10.0, "iscrowd": 0})
    data = {"images": entries, "annotations": anns,
            "categories": [{"id": c, "name": f"class{c}"} for c in range(1, classes + 1)]}
    path = root / "annotations" / "instances_train.json"
    path.write_text(json.dumps(data))
    return path


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
    from visiontrain._tv_compat import ensure_torchvision

    ensure_torchvision()
    from visiontrain.data.datasets.image_folder import build_image_folder
    from visiontrain.data.detection.coco import read_coco

    Path("/proc/self/clear_refs").write_text("5")
    before = rss_kib("VmRSS")
    start = time.perf_counter()
    if kind == "coco":
        dataset = read_coco(path, str(Path(path).parents[1] / "train"))
    else:
        dataset, _, _, _ = build_image_folder(path, image_size=32, augment="none", limit_train=None,
                                              limit_val=None)
        dataset.check_files("error", 0.0)
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 2), "peak_extra_mib": round((rss_kib("VmHWM") - before) / 1024, 1),
            "worker_pickle_mib": round(len(pickle.dumps(dataset)) / 2**20, 1)}


def _one(kind: str, path: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", kind, str(path)], capture_output=True, text=True,
                         check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> list[dict]:
    """One row per data set and size."""
    rows = []
    cases = [("coco", n, 80, 7.27) for n in (QUICK_COCO if quick else COCO_SIZES)]
    cases += [("lvis", QUICK_COCO[-1] if quick else 100_170, 1203, 12.7)]
    cases += [("image-folder", n, 1000, 0) for n in (QUICK_FOLDER if quick else FOLDER_SIZES)]
    for name, images, classes, boxes in cases:
        tmp = Path(tempfile.mkdtemp(prefix="scale-startup-"))
        try:
            if name == "image-folder":
                make_folder(tmp, images, classes)
                row = _one("folder", tmp)
            else:
                row = _one("coco", make_coco(tmp, images, classes, boxes))
        finally:
            shutil.rmtree(tmp)
        rows.append({"data": name, "images": images, "classes": classes, **row})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if not quick:
        panels = []
        for key, label in (("seconds", "read and check (s)"),
                           ("peak_extra_mib", "main process: peak above start (MiB)")):
            curves = {d: ([r["images"] for r in rows if r["data"] == d], [r[key] for r in rows if r["data"] == d])
                      for d in ("coco", "image-folder")}
            panels.append(("images", label, curves))
        draw(panels, RESULTS / "scale-startup.png", "start-up against the size of the data")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes only")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(*args.one)))
        return
    for row in run(args.quick):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
