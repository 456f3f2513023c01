"""`visiontrain benchmark` against `visiontrain fit`: the step time each gives for the same steps of a
small recipe as shipped, side by side.

    python benchmarks/benchmark_vs_fit.py [--recipes classify-fashion,ssl-dino] [--steps 20] [--repeats 2]
        [--trained N]

For each recipe, in alternating order (machine load falls on both alike):

- ``visiontrain fit RECIPE trainer.max_steps=2N trainer.log_every=N``: the step time of its second
  log window (steps N+1 to 2N: ``data_s + compute_s`` of that row of metrics.jsonl over N), after the
  first N as warm-up; no evaluation or checkpoint falls inside it;
- ``visiontrain benchmark RECIPE --warmup N --steps N``: its ``step_ms``.

Both are the recipe as shipped (its workers, start method, precision, transforms). ``--trained N``
first trains the recipe for N steps and starts both from those weights (``--init``): the step of a
detector costs more once it finds objects (an R-CNN's mask and box heads run on the proposals that
match a box: few at initialisation), and a run spends most of its steps trained.

Prints one line a run and, per recipe, the median of each and ``benchmark/fit``; ``--out FILE``
writes the records as JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# The fit's final evaluation (after the window) on a few images, to keep the benchmark short; ssl-dino's
# k-NN bank is the training set
SMALL_EVAL = {"ssl-dino": ["data.limit_val=8", "task.knn_bank=256"]}
SMALL = ("classify-fashion", "ssl-dino", "detect-yolov3", "detect-detr", "detect-faster-rcnn", "segment-mask-rcnn",
         "segment-panoptic", "segment-semantic")


def visiontrain(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "visiontrain", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"visiontrain {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def fit_step_ms(recipe: str, steps: int, work: Path, init: list[str]) -> float:
    """The fit's second window: steps ``steps+1 .. 2*steps``, data wait and compute together."""
    run = work / f"fit-{recipe}"
    visiontrain("fit", recipe, f"trainer.max_steps={2 * steps}", f"trainer.log_every={steps}",
                *SMALL_EVAL.get(recipe, ["data.limit_val=8"]), "trainer.progress=plain", "--run-dir", str(run), *init)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    window = next(r for r in rows if r["kind"] == "train" and r["step"] == 2 * steps)
    subprocess.run(["rm", "-rf", str(run)], check=True)
    return 1e3 * (window["data_s"] + window["compute_s"]) / steps


def benchmark_step_ms(recipe: str, steps: int, init: list[str]) -> float:
    out = visiontrain("benchmark", recipe, "--warmup", str(steps), "--steps", str(steps), *init)
    return json.loads(out.strip().splitlines()[-1])["step_ms"]


def trained_weights(recipe: str, steps: int, work: Path) -> list[str]:
    """``--init`` of the recipe trained for ``steps`` steps (none when ``steps`` is 0)."""
    if not steps:
        return []
    run = work / f"trained-{recipe}"
    visiontrain("fit", recipe, f"trainer.max_steps={steps}", "eval.every=0", "trainer.progress=plain",
                "--run-dir", str(run))
    return ["--init", str(run / "model.safetensors")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default=",".join(SMALL))
    parser.add_argument("--steps", type=int, default=20, help="warm-up steps, then timed steps, in each")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--trained", type=int, default=0, help="start both from the recipe trained this long")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for recipe in args.recipes.split(","):
            init = trained_weights(recipe, args.trained, Path(tmp))
            fit, bench = [], []
            for repeat in range(args.repeats):
                order = ("fit", "benchmark") if repeat % 2 == 0 else ("benchmark", "fit")
                for which in order:
                    if which == "fit":
                        fit.append(fit_step_ms(recipe, args.steps, Path(tmp), init))
                    else:
                        bench.append(benchmark_step_ms(recipe, args.steps, init))
                    print(f"{recipe} {which}: {(fit if which == 'fit' else bench)[-1]:.1f} ms a step", flush=True)
            record = {"recipe": recipe, "steps": args.steps, "trained": args.trained, "fit_ms": fit,
                      "benchmark_ms": bench, "ratio": statistics.median(bench) / statistics.median(fit)}
            records.append(record)
            print(f"{recipe}: fit {statistics.median(fit):.1f} ms, benchmark {statistics.median(bench):.1f} ms, "
                  f"benchmark/fit {record['ratio']:.3f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
