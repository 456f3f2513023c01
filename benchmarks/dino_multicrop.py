"""Cost per batch of ssl-dino's two multi-crop paths, and of its student step with either attention.

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/dino_multicrop.py [--batches 12] [k=v ...]

On one thread, the recipe's training data and batch (64 images, 2 global crops of 28 px and 4 local
ones of 14 px), the same batches through each path as the loader makes them (``SeededDataset``
seeds each batch, then the collate):
- ``per_sample``: torchvision v2 per image (``task.multicrop=per_sample``), the milliseconds of
  one batch's loading and collate;
- ``batched``: the uint8 images and each batch's drawn parameters, then every crop at once
  (``task.multicrop=batched``), split into the loading (reading, drawing, stacking) and the crops,
  which run in the loader's worker on the CPU or in the step on a GPU.
Then the student's forward and backward on one batch of crops under the recipe's bf16 autocast, with
``F.scaled_dot_product_attention`` and with timm's plain matmul and softmax (``task.fused_attention``).
The first two batches of each are a warm-up and are not counted; the rest are averaged.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable

import torch
from torch.utils.data import default_collate

from visiontrain.core._tv_compat import ensure_torchvision

ensure_torchvision()
from visiontrain.core import config as C  # noqa: E402
from visiontrain.data.multicrop_batched import BatchedMultiCrop, collate_raw  # noqa: E402
from visiontrain.data.samplers import SeededDataset  # noqa: E402
from visiontrain.models.dino import set_fused_attention  # noqa: E402
from visiontrain.tasks import build_task  # noqa: E402

WARMUP = 2


def mean_ms(times: list[float]) -> float:
    return round(1e3 * sum(times[WARMUP:]) / len(times[WARMUP:]), 2)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def data_costs(overrides: list[str], batches: int) -> dict[str, Any]:
    """Milliseconds per batch of each path, on the same (indices, seed) keys."""
    out: dict[str, Any] = {}
    for mode in ("per_sample", "batched"):
        cfg = C.load_config("ssl-dino", [*overrides, f"task.multicrop={mode}"])
        data = build_task(cfg).build_data()
        dataset, size = SeededDataset(data.train), cfg.data.batch_size
        keys = [[(b * size + i, b) for i in range(size)] for b in range(batches)]
        if mode == "per_sample":
            load = [timed(lambda k=k: default_collate(dataset.__getitems__(k)))[0] for k in keys]
            out[mode] = {"ms_per_batch": mean_ms(load)}
            continue
        crop = BatchedMultiCrop(data.train.spec)
        load, crops = [], []
        for k in keys:
            seconds, raw = timed(lambda k=k: collate_raw(dataset.__getitems__(k)))
            load.append(seconds)
            crops.append(timed(lambda raw=raw: crop(raw[0], raw[2]))[0])
        out[mode] = {"ms_per_batch": round(mean_ms(load) + mean_ms(crops), 2), "load_ms": mean_ms(load),
                     "crops_ms": mean_ms(crops)}
    out["per_sample_over_batched"] = round(out["per_sample"]["ms_per_batch"] / out["batched"]["ms_per_batch"], 1)
    return out


def step_costs(overrides: list[str], batches: int) -> dict[str, float]:
    """Milliseconds of the student's forward and backward on one batch of crops, per attention."""
    cfg = C.load_config("ssl-dino", [*overrides, "task.multicrop_in=loader"])  # the crops from the collate
    task = build_task(cfg)
    data = task.build_data()
    model = task.build_model(data.info)
    keys = [(i, 0) for i in range(cfg.data.batch_size)]
    crops, _ = data.train_collate(SeededDataset(data.train).__getitems__(keys))
    out = {}
    for fused in (True, False):
        set_fused_attention(model, fused)
        times = []
        for _ in range(batches):
            def step() -> None:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(crops).float().sum()
                loss.backward()
            times.append(timed(step)[0])
        out["fused_ms" if fused else "plain_ms"] = mean_ms(times)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=12)
    p.add_argument("overrides", nargs="*", help="key=value overrides of the ssl-dino recipe")
    args = p.parse_args()
    torch.set_num_threads(1)
    result = {"data": data_costs(args.overrides, args.batches), "student_step": step_costs(args.overrides, 6)}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
