"""Images/s of the training loader on the same images: from their image folder (map-style), from
`visiontrain shard`'s shards of that folder in a local directory, and from those shards in a local
S3 server (moto, on 127.0.0.1); and the time from the loader's start to its first batch.

The images are photos' size and weight: 400 x 300 JPEGs (quality 90, about 35 KB) of smooth random
shapes with grain, 10 classes. Each source is read through the project's own loader exactly as
`fit` builds it (the task's data, `engine.setup.loaders`: the recipe's transforms, workers,
start method and sampler) with classify-fashion's settings on this data: data.name=image-folder
at 160 px with the imagenet augmentation (RandomResizedCrop + flip), 2 workers (this machine has 2
cores), batch 64. The sources take turns, ROUNDS times, so that the machine's drift falls on each;
a round reads one full epoch of each. The ratios compare medians.

    python benchmarks/shards/throughput.py [--images 3000] [--rounds 3]

Writes benchmarks/results/shards_throughput.json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"
TESTS = Path(__file__).resolve().parents[2] / "tests"
SETTINGS = ["data.image_size=160", "data.augment=imagenet", "data.num_workers=2", "data.batch_size=64",
            "trainer.precision=fp32"]


def write_folder(root: Path, images: int) -> None:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(images + images // 5):
        split, label = ("train" if i < images else "val"), i % 10
        folder = root / split / f"class{label}"
        folder.mkdir(parents=True, exist_ok=True)
        coarse = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
        smooth = np.asarray(Image.fromarray(coarse).resize((400, 300), Image.BICUBIC), dtype=np.int16)
        grain = rng.integers(-12, 13, smooth.shape, dtype=np.int16)
        Image.fromarray(np.clip(smooth + grain, 0, 255).astype(np.uint8)).save(folder / f"{i:06d}.jpg", quality=90)


def measure(overrides: list[str]) -> dict[str, float]:
    """One epoch of the training loader, in this process: seconds to the first batch, images/s after it."""
    import torch

    from visiontrain.core import config as C
    from visiontrain.engine.parallel.distributed import DistInfo
    from visiontrain.engine.setup.loaders import loaders
    from visiontrain.tasks import build_task

    cfg = C.load_config("classify-fashion", SETTINGS + overrides)
    data = build_task(cfg).build_data()
    start = time.perf_counter()
    source, _ = loaders(data, cfg, DistInfo(), torch.device("cpu"))
    batches = source.batches(0)
    next(batches)
    first = time.perf_counter() - start
    t, seen = time.perf_counter(), 0
    for images, _ in batches:
        seen += len(images)
    rate = seen / (time.perf_counter() - t)
    source.close()
    return {"first_batch_s": round(first, 2), "images_per_s": round(rate, 1)}


def run_measure(overrides: list[str], env: dict[str, str]) -> dict[str, float]:
    """``measure`` in a fresh process, as a run would start."""
    code = f"import sys, json; sys.path.insert(0, {str(Path(__file__).parent)!r}); from throughput import measure; " \
           f"print(json.dumps(measure({overrides!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def upload(directory: Path, endpoint: str) -> str:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                          region_name="us-east-1")
    client.create_bucket(Bucket="bench")
    for path in directory.iterdir():
        client.upload_file(str(path), "bench", f"shards/{path.name}")
    return "s3://bench/shards"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(TESTS))
    from s3_server import CREDENTIALS, s3_server

    with tempfile.TemporaryDirectory() as tmp, s3_server() as endpoint:
        folder, shards = Path(tmp) / "folder", Path(tmp) / "shards"
        write_folder(folder, args.images)
        files = ["data.name=image-folder", f"data.root={folder}"]
        subprocess.run([sys.executable, "-m", "visiontrain", "shard", "classify-fashion", *files, *SETTINGS,
                        "--out", str(shards), "--shard-size", "16MB"], check=True, capture_output=True)
        url = upload(shards, endpoint)
        env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
        sources = {"image folder": files, "shards, local directory": ["data.name=shards", f"data.shards={shards}"],
                   "shards, local S3 server": ["data.name=shards", f"data.shards={url}"]}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in sources}
        for _ in range(args.rounds):
            for name, overrides in sources.items():
                runs[name].append(run_measure(overrides, env))
    base = statistics.median(r["images_per_s"] for r in runs["image folder"])
    table = {name: {"images_per_s": statistics.median(r["images_per_s"] for r in rs),
                    "first_batch_s": statistics.median(r["first_batch_s"] for r in rs), "runs": rs}
             for name, rs in runs.items()}
    for row in table.values():
        row["ratio"] = round(row["images_per_s"] / base, 3)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "shards_throughput.json").write_text(json.dumps({"args": vars(args), "settings": SETTINGS,
                                                                 "sources": table}, indent=1))
    print("| source | images/s (median) | against the folder | first batch |\n|---|---|---|---|")
    for name, row in table.items():
        print(f"| {name} | {row['images_per_s']} | {row['ratio']:.3f} | {row['first_batch_s']} s |")


if __name__ == "__main__":
    main()
