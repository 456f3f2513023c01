"""The same recipe trained from files and from tar shards of the same files, one after the other:
detect-yolov3 on fashion-mosaic (its files) and ssl-dino on an image folder of Fashion-MNIST PNGs,
each against `visiontrain shard`'s shards of that data. Both runs of a pair use the recipe as
shipped apart from the data and the run's length; they read the same images through the same
transforms, in another order, so their metrics should agree within run-to-run noise.

    python benchmarks/shards/side_by_side.py [--yolo-epochs 8] [--dino-epochs 2] [--dino-images 20000]
                                             [--seed 0] [--only yolo dino]

Writes benchmarks/results/shards_side_by_side_seed<SEED>.json and prints a markdown table. A second
seed gives the run-to-run spread the two sources' difference is measured against.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"


def visiontrain(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "visiontrain", *args], check=True, stdout=subprocess.DEVNULL)


def fashion_folder(root: Path, train: int, val: int) -> Path:
    """ROOT/train/<class>/*.png and ROOT/val/<class>/*.png: the first Fashion-MNIST images."""
    from PIL import Image

    from visiontrain.data.datasets.fashion_mnist import CLASS_NAMES, load_fashion_mnist

    (tx, ty), (vx, vy) = load_fashion_mnist(None, False)
    for split, images, labels, n in (("train", tx, ty, train), ("val", vx, vy, val)):
        for i in range(n):
            folder = root / split / CLASS_NAMES[int(labels[i])].replace("/", "-")
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(images[i, 0].numpy()).save(folder / f"{i:06d}.png")
    return root


def fit(recipe: str, run_dir: Path, *overrides: str) -> dict:
    start = time.perf_counter()
    visiontrain("fit", recipe, *overrides, "--run-dir", str(run_dir))
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"final": {k: v for k, v in summary["final"].items() if not isinstance(v, dict)},
            "samples_per_s": round(summary["samples_per_s"], 1), "wall_s": round(time.perf_counter() - start, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--yolo-epochs", type=int, default=8)
    parser.add_argument("--dino-epochs", type=int, default=2)
    parser.add_argument("--dino-images", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="+", choices=["yolo", "dino"], default=["yolo", "dino"])
    args = parser.parse_args()
    seed = f"seed={args.seed}"
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "yolo" in args.only:
            visiontrain("shard", "detect-yolov3", "--out", str(work / "mosaic-shards"), "--shard-size", "64MB")
            yolo = (f"trainer.epochs={args.yolo_epochs}", seed)
            results["detect-yolov3 files"] = fit("detect-yolov3", work / "yolo-files", *yolo)
            results["detect-yolov3 shards"] = fit("detect-yolov3", work / "yolo-shards", "data.name=shards",
                                                  f"data.shards={work / 'mosaic-shards'}", *yolo)
        if "dino" in args.only:
            folder = fashion_folder(work / "fashion", args.dino_images, 2_000)
            files = ("data.name=image-folder", f"data.root={folder}")
            visiontrain("shard", "ssl-dino", *files, "--out", str(work / "fashion-shards"), "--shard-size", "64MB")
            dino = (f"trainer.epochs={args.dino_epochs}", seed)
            results["ssl-dino files"] = fit("ssl-dino", work / "dino-files", *files, *dino)
            results["ssl-dino shards"] = fit("ssl-dino", work / "dino-shards", "data.name=shards",
                                             f"data.shards={work / 'fashion-shards'}", *dino)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"shards_side_by_side_seed{args.seed}.json"
    out.write_text(json.dumps({"args": vars(args), "runs": results}, indent=1))
    print("| run | metric | images/s | wall |\n|---|---|---|---|")
    for name, r in results.items():
        metric = ", ".join(f"{k} {v:.4g}" for k, v in r["final"].items() if k != "wall_s" and v is not None)
        print(f"| {name} | {metric} | {r['samples_per_s']} | {r['wall_s']} s |")


if __name__ == "__main__":
    main()
