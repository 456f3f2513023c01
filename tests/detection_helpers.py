"""Shared by the detection CLI tests: run the CLI in a subprocess, and a few-image fashion-mosaic
laid out as a COCO dataset (``annotations/instances_<split>.json``, ``<split>/*.png``)."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from procs import run_cli


def vt(*args: str) -> subprocess.CompletedProcess:
    """``python -m visiontrain ARGS`` on one thread, output captured (a hang fails with its stacks)."""
    return run_cli(*args, timeout=600)


def mosaic_coco(tmp_path_factory, train_images: int, val_images: int, classes: int | None = None) -> Path:
    """A small fashion-mosaic as COCO; ``classes`` keeps only the first N categories (and their boxes)."""
    from visiontrain.data.detection.embedded import build_fashion_mosaic

    base = build_fashion_mosaic(tmp_path_factory.mktemp("mosaic"), train_images=train_images, val_images=val_images)
    root = tmp_path_factory.mktemp("coco")
    (root / "annotations").mkdir()
    for split in ("train", "val"):
        data = json.loads((base / "annotations" / f"{split}.json").read_text())
        if classes is not None:
            keep = {c["id"] for c in data["categories"][:classes]}
            data["categories"] = [c for c in data["categories"] if c["id"] in keep]
            data["annotations"] = [a for a in data["annotations"] if a["category_id"] in keep]
        (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(data))
        shutil.copytree(base / split, root / split)
    return root
