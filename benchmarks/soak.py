"""Soak run: a long `visiontrain fit` watched from outside for memory growth and leaked file handles.

    python benchmarks/soak.py [--run-dir DIR] [--out benchmarks/results/soak] [k=v ...]

Defaults: classify-fashion with batch 32 for 6 epochs (11,250 steps) on one thread, a DataLoader
worker with the basic augmentation, an evaluation every epoch, last.pt every 500 steps. Every 2 s the resident
memory (VmRSS) and the open file descriptors of the training process and of its workers are read
from /proc, with the step reached (metrics.jsonl). The process tree changes shape during a run
(an evaluation starts its own worker, the last one overlaps the end of training), so growth is
compared at like moments: the first sample after each evaluation of the run but the last. The
run passes when the training process and each worker grow by less than --max-growth-mib from the
first of these moments to the last, and the open descriptors are the same at all of them.
Writes OUT.json (with every sample) and OUT.png.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(c) for c in path.read_text().split()] if path.is_file() else []


def sample(pid: int, run_dir: Path) -> dict[str, float]:
    kids = children(pid)
    rows = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").is_file() else []
    last = json.loads(rows[-1]) if rows and rows[-1].endswith("}") else {}
    evals = sum('"kind": "eval"' in r for r in rows)
    return {"t": time.time(), "step": last.get("step", 0), "evals": evals, "rss_mib": proc_rss_mib(pid),
            "workers_rss_mib": sum(proc_rss_mib(k) for k in kids), "workers": len(kids),
            "fds": len(list(Path(f"/proc/{pid}/fd").iterdir()))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", type=Path)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/soak"))
    p.add_argument("--max-growth-mib", type=float, default=32.0)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    run_dir = args.run_dir or Path(tempfile.mkdtemp()) / "soak"
    overrides = ["data.batch_size=32", "trainer.epochs=6", "data.num_workers=1", "data.augment=basic", "trainer.threads=1",
                 "eval.every=1", "checkpoint.every=500", "checkpoint.unit=steps", "trainer.log_every=50",
                 "trainer.progress=plain", *args.overrides]
    cmd = [sys.executable, "-m", "visiontrain", "fit", "classify-fashion", *overrides, "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples, start = [], time.time()
    while proc.poll() is None:
        try:
            samples.append(sample(proc.pid, run_dir))
        except (FileNotFoundError, ProcessLookupError):
            break  # the process ended between poll() and the read
        time.sleep(2.0)
    err = proc.communicate()[1]
    if proc.returncode != 0:
        raise SystemExit(f"the soak run failed ({proc.returncode}): {err[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    evals = max(s["evals"] for s in samples)
    points = [next(s for s in samples if s["evals"] == k) for k in range(1, evals)]  # after evals 1 .. n-1
    per_worker = [p["workers_rss_mib"] / max(p["workers"], 1) for p in points]
    result = {
        "command": " ".join(["visiontrain", "fit", "classify-fashion", *overrides]),
        "steps": summary["steps"], "wall_s": round(time.time() - start, 1), "final": summary["final"],
        "after_each_evaluation": [{k: round(p[k], 1) for k in ("step", "rss_mib", "workers", "workers_rss_mib", "fds")}
                                  for p in points],
        "rss_growth_mib": round(points[-1]["rss_mib"] - points[0]["rss_mib"], 1),
        "worker_rss_growth_mib": round(per_worker[-1] - per_worker[0], 1),
        "max_rss_mib": round(max(s["rss_mib"] for s in samples), 1),
        "max_growth_mib": args.max_growth_mib,
        "samples": samples,
    }
    result["passed"] = (result["rss_growth_mib"] < args.max_growth_mib and result["worker_rss_growth_mib"] <
                        args.max_growth_mib and len({p["fds"] for p in points}) == 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(samples, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}))


def plot(samples: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    steps = [s["step"] for s in samples]
    ax.plot(steps, [s["rss_mib"] for s in samples], label="training process")
    ax.plot(steps, [s["workers_rss_mib"] for s in samples], label="DataLoader workers (sum)")
    ax.set_xlabel("step")
    ax.set_ylabel("resident memory (MiB)")
    ax2 = ax.twinx()
    ax2.plot(steps, [s["fds"] for s in samples], color="grey", linestyle=":", label="open files (training process)")
    ax2.set_ylabel("open file descriptors")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("soak run: classify-fashion, 11,250 steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
