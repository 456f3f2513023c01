"""Time per epoch with the decoded-image cache (``data.cache=ram``) and without (``none``).

    python benchmarks/data_cache.py [--repeats 5] [--epochs 3] [--max-batches N] [--cases yolov3-mosaic,rcnn-neon]
    python benchmarks/data_cache.py --fit [--repeats 3] [--cases yolov3-mosaic,rcnn-mosaic] [--target-ap50 0.6]

Without ``--fit`` (the data side): each case's training loader, built by the engine as a run builds
it (the recipe's workers, start method, persistent workers, sampler, transforms and collate), is
read for ``--epochs`` epochs and each epoch timed. With the cache the first epoch decodes and fills
it and the later ones read it back, so the first epoch and the later ones are reported apart (a first read of one batch,
untimed, starts the forkserver beforehand; starting the workers is in each first epoch).
Cases: ``yolov3-mosaic`` is fashion-mosaic through detect-yolov3 (2,000 images, 128-256 px),
``rcnn-neon`` the neon-trees tiles (42 of 400 px) through detect-faster-rcnn at the sizes its
recipe comment gives for them, ``rcnn-mosaic`` detect-faster-rcnn as shipped (fashion-mosaic).

With ``--fit`` (training): ``visiontrain fit`` runs each case to its recipe's end (``k=v`` sets
e.g. ``trainer.epochs``; the neon settings of the recipe comment other than the sizes are
overrides too). Reported: the time of each epoch after the
first (from one epoch-end row of metrics.jsonl to the next, so an evaluation at an epoch's end is
in it) and the time from launch to the first evaluation with AP50 at ``--target-ap50`` or above
(null where the run never gets there).

The settings alternate within each repeat (none then ram, the next repeat ram then none), so load
on the machine hits both alike; every figure is the median over the repeats, and the line of each
single run is printed as it ends. ``k=v`` overrides go to every case (e.g. ``trainer.threads=1``).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from visiontrain.core._tv_compat import ensure_torchvision

ensure_torchvision()
from visiontrain.core import config as C  # noqa: E402
from visiontrain.engine.setup.loaders import loaders  # noqa: E402
from visiontrain.engine.parallel.distributed import DistInfo  # noqa: E402
from visiontrain.rundir.metrics_file import read_metrics  # noqa: E402
from visiontrain.tasks import build_task  # noqa: E402

NEON = ["data.name=neon-trees", "data.batch_size=4", "task.train_scales=[352,384,416,448]", "task.max_size=512"]
CASES = {"yolov3-mosaic": ("detect-yolov3", []), "rcnn-neon": ("detect-faster-rcnn", NEON),
         "rcnn-mosaic": ("detect-faster-rcnn", [])}
LOADER_CASES, FIT_CASES = "yolov3-mosaic,rcnn-neon", "yolov3-mosaic,rcnn-mosaic"
SETTINGS = ("none", "ram")


def loader_epochs(recipe: str, overrides: list[str], epochs: int, max_batches: int | None) -> list[float]:
    """Seconds to read each epoch of the training loader the engine builds for this config."""
    cfg = C.load_config(recipe, overrides)
    data = build_task(cfg).build_data()
    source, _ = loaders(data, cfg, DistInfo(), torch.device("cpu"))
    times = []
    for epoch in range(epochs):
        start = time.perf_counter()
        for n, _batch in enumerate(source.batches(epoch), 1):
            if max_batches is not None and n >= max_batches:
                break
        times.append(time.perf_counter() - start)
    source.close()
    del data, source
    gc.collect()  # the cache's files go with it, before the next setting's run
    return times


def fit_times(recipe: str, overrides: list[str], run_dir: Path, target: float) -> dict:
    """One ``visiontrain fit`` run: its epoch times after the first and its time to ``target`` AP50."""
    launched = time.time()
    subprocess.run([sys.executable, "-m", "visiontrain", "fit", recipe, *overrides, "trainer.progress=plain",
                    "--run-dir", str(run_dir)], check=True, stdout=subprocess.DEVNULL)
    train, evals = read_metrics(run_dir)
    ends: dict[int, float] = {}
    for row in train:  # the last train row of an epoch is its epoch-end row
        ends[row["epoch"]] = row["time"]
    marks = [ends[e] for e in sorted(ends)]
    reached = [row["time"] - launched for row in evals if row.get("AP50", float("nan")) >= target]
    return {"epoch_s": [b - a for a, b in zip(marks, marks[1:])],
            "to_target_s": reached[0] if reached else None, "last_ap50": evals[-1].get("AP50") if evals else None}


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def run_case(name: str, args: argparse.Namespace, scratch: Path) -> dict:
    recipe, case_overrides = CASES[name]
    per = {s: [] for s in SETTINGS}
    if not args.fit:  # untimed: starts the forkserver (seconds, once a process) and reads the files once
        loader_epochs(recipe, [*case_overrides, *args.overrides], 1, 1)
    for rep in range(args.repeats):
        for setting in SETTINGS if rep % 2 == 0 else SETTINGS[::-1]:
            overrides = [*case_overrides, *args.overrides, f"data.cache={setting}"]
            if args.fit:
                result = fit_times(recipe, overrides, scratch / f"{name}-{setting}-{rep}", args.target_ap50)
            else:
                result = {"epoch_s": loader_epochs(recipe, overrides, args.epochs, args.max_batches)}
            per[setting].append(result)
            print(json.dumps({"case": name, "cache": setting, "repeat": rep, **result}), flush=True)
    summary = {"case": name, "recipe": recipe, "overrides": case_overrides + args.overrides}
    for setting, runs in per.items():
        if args.fit:
            reached = [r["to_target_s"] for r in runs if r["to_target_s"] is not None]
            summary[setting] = {"epoch_s": median([t for r in runs for t in r["epoch_s"]]),
                                f"to_ap50_{args.target_ap50:g}_s": median(reached) if len(reached) == len(runs)
                                else None, "last_ap50": [r["last_ap50"] for r in runs]}
        else:
            summary[setting] = {"first_epoch_s": median([r["epoch_s"][0] for r in runs]),
                                "later_epoch_s": median([t for r in runs for t in r["epoch_s"][1:]])}
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fit", action="store_true", help="time whole training runs (visiontrain fit)")
    p.add_argument("--cases", default=None, help=f"of {', '.join(CASES)}; default: {LOADER_CASES}, with --fit "
                   f"{FIT_CASES}")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--epochs", type=int, default=3, help="loader: epochs read per run (the first fills the cache)")
    p.add_argument("--max-batches", type=int, default=None, help="loader: batches read per epoch (a quick check)")
    p.add_argument("--target-ap50", type=float, default=0.6)
    p.add_argument("--scratch", default=None, help="--fit: where the run dirs go (default: a temporary directory)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cases = (args.cases or (FIT_CASES if args.fit else LOADER_CASES)).split(",")
    if unknown := [c for c in cases if c not in CASES]:
        p.error(f"--cases: unknown {unknown} (known: {', '.join(CASES)})")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(args.scratch or tmp)
        for name in cases:
            print(json.dumps({"summary": run_case(name, args, scratch)}), flush=True)


if __name__ == "__main__":
    main()
