"""detect-detr on fashion-mosaic: AP at equal steps for the paper's DETR, each fast option alone,
and all of them, with and without a backbone pretrained on Fashion-MNIST.

Every row is ``visiontrain fit detect-detr`` with the same seed, data, lr schedule, batch and bf16
precision; only the ``task.*`` options differ (and ``task.backbone_weights`` for the pretrained
rows). Runs go two at a time with one thread each (this machine has two cores), so wall times are
not comparable between rows; the AP at the same step is.

    python benchmarks/detr_ablation.py --out runs/detr-ablation [--epochs 4] [--every 2] [--only NAME ...]

The pretrained rows first train the backbone: ``visiontrain fit classify-fashion task.model=resnet18``
(``--pretrain-steps`` steps), whose ``model.safetensors`` becomes ``task.backbone_weights``.
Prints a markdown table: one row per configuration, AP50 at each evaluation (an epoch is 249 steps
of 8 images), AP and AP75 at the last.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import re
import subprocess
import sys
from pathlib import Path

from visiontrain.rundir.metrics_file import METRICS_FILE, read_metrics

PAPER = ["task.class_loss=ce", "task.cost_class=1", "task.box_refine=false", "task.two_stage=false",
         "task.query_groups=1", "task.dn_groups=0", "task.deformable_levels=0"]
ALONE = {  # the paper's DETR with one option switched to the shipped recipe's value
    "focal loss": ["task.class_loss=focal", "task.cost_class=2"],
    "reference boxes, refined": ["task.box_refine=true"],
    "two-stage selection": ["task.two_stage=true"],
    "3 query groups": ["task.query_groups=3"],
    "3 denoising copies": ["task.dn_groups=3"],
    "deformable attention, 2 levels": ["task.deformable_levels=2"],
}


SHIPPED = "all (the shipped recipe)"


def configs(pretrained: str | None) -> dict[str, list[str]]:
    rows = {"paper DETR": PAPER, **{name: PAPER + extra for name, extra in ALONE.items()},
            SHIPPED: [], "all, varifocal instead of focal": ["task.class_loss=varifocal"]}
    if pretrained:
        rows["paper DETR, pretrained backbone"] = PAPER + [f"task.backbone_weights={pretrained}"]
        rows["all, pretrained backbone"] = [f"task.backbone_weights={pretrained}"]
    return rows


def fit(args: list[str], run_dir: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "visiontrain", "fit", *args, "trainer.threads=1", "trainer.progress=plain",
           "--run-dir", str(run_dir)]
    with open(run_dir.with_suffix(".log"), "w") as log:
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)


def evaluations(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir).evals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--every", type=int, default=2, help="evaluate every N epochs")
    ap.add_argument("--pretrain-steps", type=int, default=300)
    ap.add_argument("--no-pretrained", action="store_true", help="skip the pretrained-backbone rows")
    ap.add_argument("--only", nargs="*", help="run only these rows (names as printed)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--table-only", action="store_true", help="run nothing: print the rows already measured")
    ap.add_argument("--shipped", type=Path, help="a run dir of the shipped recipe to read its row from "
                                                 "(e.g. the 30-minute run) instead of running it")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    weights = args.out / "resnet18-fashion" / "model.safetensors"
    if not args.no_pretrained and not args.table_only and not weights.exists():
        fit(["classify-fashion", "task.model=resnet18", f"trainer.max_steps={args.pretrain_steps}"], weights.parent)
    if weights.exists():
        top1 = evaluations(weights.parent)[-1].get("top1")
        print(f"backbone: resnet18 on Fashion-MNIST ({args.pretrain_steps} steps), test top-1 {top1}")
    rows = configs(None if args.no_pretrained else str(weights))
    if args.only:
        rows = {k: v for k, v in rows.items() if k in args.only}
    length = [f"trainer.epochs={args.epochs}", f"eval.every={args.every}", "eval.unit=epochs"]

    def run_dir(name: str) -> Path:
        if name == SHIPPED and args.shipped:
            return args.shipped
        return args.out / re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")

    def run(item: tuple[str, list[str]]) -> None:
        name, extra = item
        if not (run_dir(name) / "summary.json").exists():
            fit(["detect-detr", *extra, *length], run_dir(name))

    if not args.table_only:
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(run, rows.items()))

    table = {name: {e["step"]: e for e in evaluations(run_dir(name))} for name in rows
             if (run_dir(name) / METRICS_FILE).exists()}
    measured = {step for name, evals in table.items() if name != SHIPPED for step in evals}
    steps = sorted(measured or {step for evals in table.values() for step in evals})  # the ablation's steps
    print("| configuration | " + " | ".join(f"AP50 @ {s} steps" for s in steps) + f" | AP / AP75 @ {steps[-1]} |")
    print("|---|" + "---:|" * (len(steps) + 1))
    for name, evals in table.items():
        cells = [f"{evals[s]['AP50']:.4f}" if s in evals else "—" for s in steps]
        last = evals.get(steps[-1])
        tail = f"{last['AP']:.4f} / {last['AP75']:.4f}" if last else "—"
        print(f"| {name} | " + " | ".join(cells) + f" | {tail} |")


if __name__ == "__main__":
    main()
