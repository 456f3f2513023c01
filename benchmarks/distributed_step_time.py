"""Step time of one process vs torchrun with N processes, DDP and FSDP, at the same global batch.

    python benchmarks/distributed_step_time.py [--nproc 2] [--steps 300] [--global-batch 128]
        [--strategies ddp,fsdp] [--recipe R] [k=v ...]

One process gets all the threads (trainer.threads = nproc); each of the N ranks gets one thread and
global_batch / N images. All run the same recipe for the same steps, one after the other in this
one invocation; the figure is the median step time over the log windows after the first
(start-up excluded), read from metrics.jsonl.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from visiontrain.rundir.metrics_file import read_metrics


def step_time(run_dir: Path, global_batch: int) -> float:
    rates = [r["samples_per_s"] for r in read_metrics(run_dir).train][1:]
    return global_batch / statistics.median(rates)


def fit(run_dir: Path, nproc: int, args: argparse.Namespace, strategy: str = "ddp") -> float:
    threads = args.nproc if nproc == 1 else 1
    cmd = [sys.executable, "-m", "visiontrain", "fit", args.recipe, *args.overrides, f"distributed.strategy={strategy}",
           f"data.batch_size={args.global_batch // nproc}", f"trainer.max_steps={args.steps}",
           f"trainer.threads={threads}", "trainer.log_every=25", "eval.every=0", "checkpoint.every=0",
           "trainer.progress=plain", "--run-dir", str(run_dir)]
    if nproc > 1:
        cmd += ["--nproc", str(nproc)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return step_time(run_dir, args.global_batch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="classify-fashion")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--strategies", default="ddp,fsdp", help="comma-separated: ddp, fsdp")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    result = {"recipe": args.recipe, "overrides": args.overrides, "global_batch": args.global_batch,
              "steps": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        single = fit(Path(tmp) / "single", 1, args)
        result["step_ms_1_process"] = round(1e3 * single, 2)
        for strategy in args.strategies.split(","):
            multi = fit(Path(tmp) / strategy, args.nproc, args, strategy)
            result[f"step_ms_{args.nproc}_processes_{strategy}"] = round(1e3 * multi, 2)
            result[f"ratio_{strategy}"] = round(multi / single, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
