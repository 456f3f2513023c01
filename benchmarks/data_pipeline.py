"""Decode + augment throughput of the detection recipes' training transforms, and where the time goes.

    python benchmarks/data_pipeline.py [--images 200] [--recipes detect-detr,detect-faster-rcnn,detect-yolov3] [k=v ...]

For each recipe, on its default data (fashion-mosaic, 2,000 train images): the time per image of
the decode (file -> uint8 tensor) and of each step of the training transform, applied in turn to
the same images in one process; then the images/s a DataLoader delivers, collated into the
recipe's batches, with 0, 1 and 2 worker processes (this machine has 2 cores); last, the same
with ``data.normalize_on_device=true`` (the pipeline ends at uint8; the GPU scales and normalises),
and the bytes of one collated batch each way.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from torch.utils.data import DataLoader

from visiontrain.core._tv_compat import ensure_torchvision

ensure_torchvision()
from visiontrain.core import config as C  # noqa: E402
from visiontrain.tasks import build_task  # noqa: E402


def stage_times(raw, transform, n: int) -> dict[str, float]:
    """Milliseconds per image of the decode and of each transform step."""
    times = {"decode": 0.0}
    steps = list(getattr(transform, "transforms", [transform]))
    for i in range(n):
        t = time.perf_counter()
        sample = raw.load(i % len(raw))
        times["decode"] += time.perf_counter() - t
        for k, step in enumerate(steps):
            name = f"{k}:{type(step).__name__}"
            t = time.perf_counter()
            sample = step(*sample)
            times[name] = times.get(name, 0.0) + time.perf_counter() - t
    return {k: round(1e3 * v / n, 3) for k, v in times.items()}


def loader_rate(dataset, collate, batch: int, workers: int, n: int) -> float:
    loader = DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers, collate_fn=collate,
                        generator=torch.Generator().manual_seed(0), persistent_workers=False)
    it, seen = iter(loader), 0
    next(it)  # start-up (worker processes) excluded
    t = time.perf_counter()
    while seen < n:
        next(it)
        seen += batch
    return seen / (time.perf_counter() - t)


def batch_megabytes(dataset, collate, batch: int) -> float:
    images = next(iter(DataLoader(dataset, batch_size=batch, collate_fn=collate)))[0]
    return round(images.numel() * images.element_size() / 2**20, 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=200)
    p.add_argument("--recipes", default="detect-detr,detect-faster-rcnn,detect-yolov3")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    torch.set_num_threads(1)
    for recipe in args.recipes.split(","):
        cfg = C.load_config(recipe, args.overrides)
        task = build_task(cfg)
        data = task.build_data()
        raw = data.train.with_transform(None)
        stages = stage_times(raw, data.train.transform, args.images)
        total = sum(stages.values())
        result = {"recipe": recipe, "data": cfg.data.name, "batch": cfg.data.batch_size,
                  "ms_per_image": round(total, 3), "images_per_s_one_core": round(1e3 / total, 1),
                  "stages_ms": stages,
                  "loader_images_per_s": {w: round(loader_rate(data.train, data.train_collate, cfg.data.batch_size,
                                                               w, args.images), 1) for w in (0, 1, 2)},
                  "batch_mb": batch_megabytes(data.train, data.train_collate, cfg.data.batch_size)}
        u8 = build_task(C.load_config(recipe, args.overrides + ["data.normalize_on_device=true"])).build_data()
        result["normalize_on_device"] = {
            "loader_images_per_s": {w: round(loader_rate(u8.train, u8.train_collate, cfg.data.batch_size, w,
                                                         args.images), 1) for w in (0, 2)},
            "batch_mb": batch_megabytes(u8.train, u8.train_collate, cfg.data.batch_size)}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
