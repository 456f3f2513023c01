"""A kill chain under `fit --nproc 2`: the run straight through, then the same run killed with
SIGKILL of the launcher's process group at random moments (one in four during start-up, the others
at random steps spread over the run, up to 1.5 s after the step was logged), each kill followed by
`--resume auto`, until it finishes.

Checked after every kill: every process of the run (torchrun's agent, both ranks, their forkservers,
resource trackers and DataLoader workers) is gone within 5 s. Checked at the end: the final weights
and EMA are bit-identical to the straight run's, and so is every metrics.jsonl row (all values but
the timings).

    python benchmarks/kill_chain.py --strategy ddp --kills 6 --seed 0
    python benchmarks/kill_chain.py --strategy fsdp --kills 6 --seed 1
    python benchmarks/kill_chain.py --world-sizes 1,2,3,1 --kills 6 --seed 2

The run: classify-fashion on the embedded digits, 2 ranks x 2 workers each (forkserver), EMA,
gradient accumulation over 2 micro-batches, mixup, a checkpoint every 10 steps and an evaluation
after each epoch. Prints one JSON line per kill and a summary line.

``--world-sizes``: launch k of the chain runs on the k-th number of processes of the list, in turn
(DDP; the straight run on the first), and the run is the ledger task of the tests
(tests/support/ledger_task.py): a global batch of 12, 240 samples each with one random draw, written
down by the process that trains it. Checked at the end instead of bit-identity (the reductions
change with the number of processes): every (epoch, sample) trained once with the straight run's
draw, the largest difference of a final weight from the straight run's, and both final metrics.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "support")]
from procs import alive, descendants, group  # noqa: E402

RUN = ["classify-fashion", "data.name=digits", "data.batch_size=16", "trainer.epochs=30", "data.num_workers=2",
       "ema.enabled=true", "ema.decay=0.9", "trainer.accum_steps=2", "task.mixup_alpha=0.2",
       "checkpoint.every=10", "checkpoint.unit=steps", "trainer.log_every=5", "trainer.progress=plain"]
#: Row keys that measure time, not training: they differ between any two runs.
TIMINGS = {"time", "samples_per_s", "data_s", "compute_s", "eta_s", "wall_s"}


def launch(run_dir: Path, fit: list[str], resume: bool, nproc: int = 2) -> subprocess.Popen:
    """``visiontrain FIT... [--nproc N] --run-dir RUN_DIR [--resume auto]``, in its own session."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "visiontrain", *fit, *(["--nproc", str(nproc)] if nproc > 1 else []),
           "--run-dir", str(run_dir), *(["--resume", "auto"] if resume else [])]
    with open(run_dir.parent / f"{run_dir.name}.stderr", "w") as err:  # a pipe nobody reads could fill up
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)


def stderr_of(run_dir: Path) -> str:
    return (run_dir.parent / f"{run_dir.name}.stderr").read_text()[-3000:]


def kill_group_and_check(proc: subprocess.Popen) -> float:
    """SIGKILL the launcher's process group; the seconds until every process of the run was gone."""
    tree = descendants(proc.pid) | {proc.pid}
    os.killpg(proc.pid, signal.SIGKILL)
    start = time.monotonic()
    while alive(tree) and time.monotonic() - start < 5.0:
        time.sleep(0.02)
    took, survivors = time.monotonic() - start, alive(tree) | group(proc.pid)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    if survivors:
        raise SystemExit(f"alive 5 s after the kill: {sorted(survivors)}")
    return took


def rows(run_dir: Path) -> list[dict]:
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.append({k: v for k, v in row.items() if k not in TIMINGS})
    return out


def same_weights(a: Path, b: Path) -> bool:
    left, right = load_file(a), load_file(b)
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


def last_logged_step(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return max((r["step"] for r in rows(run_dir)), default=0) if metrics.is_file() else 0


def wait_then_kill(proc: subprocess.Popen, logged: Callable[[], int], target: int | None,
                   rng: random.Random) -> dict | None:
    """Kill once the run has logged step ``target`` (None: during start-up, 1-10 s after the launch),
    plus up to 1.5 s, so that the moment falls anywhere in a step, an evaluation or a checkpoint
    write. None: the run finished first."""
    start = time.monotonic()
    while target is not None and logged() < target and proc.poll() is None:
        time.sleep(0.05)
    try:
        proc.wait(rng.uniform(1.0, 10.0) if target is None else rng.uniform(0.0, 1.5))
        return None
    except subprocess.TimeoutExpired:
        pass
    step = logged()
    took = kill_group_and_check(proc)
    return {"after_s": round(time.monotonic() - start, 1), "target_step": target, "logged_step": step,
            "all_gone_s": round(took, 3)}


def chain(run_dir: Path, start: Callable[[int], subprocess.Popen], targets: list[int | None],
          rng: random.Random, logged: Callable[[], int] | None = None) -> list[dict]:
    """Launch k (``start(k)``, with --resume auto) and kill it at target k, for each target in turn;
    then let the run finish. ``logged``: the step the run has reached (default: its last logged
    step)."""
    done: list[dict] = []
    for k, target in enumerate(targets):
        proc = start(k)
        kill = wait_then_kill(proc, logged or (lambda: last_logged_step(run_dir)), target, rng)
        if kill is None:
            if proc.returncode != 0:
                raise SystemExit(f"a resumed run failed (exit {proc.returncode}): {stderr_of(run_dir)}")
            return done  # it finished before this kill
        done.append({"kill": len(done) + 1, **kill})
        print(json.dumps(done[-1]), flush=True)
    if start(len(targets)).wait() != 0:
        raise SystemExit(f"the last resume failed: {stderr_of(run_dir)}")
    return done


def kill_targets(total_steps: int, kills: int, rng: random.Random) -> list[int | None]:
    """Where each kill falls: one in four during start-up, the others at steps spread over the run."""
    steps = iter(sorted(rng.sample(range(1, total_steps - 5), kills)))
    return [None if rng.random() < 0.25 else next(steps) for _ in range(kills)]


def same_run(tmp: Path, strategy: str, kills: int, rng: random.Random) -> dict:
    """The classify-fashion chain on 2 processes: rows, weights and EMA bit-identical."""
    killed, straight = tmp / "killed", tmp / "straight"
    fit = ["fit", *RUN, f"distributed.strategy={strategy}"]
    if launch(straight, fit, resume=False).wait() != 0:
        raise SystemExit(f"the straight run failed: {stderr_of(straight)}")
    done = chain(killed, lambda k: launch(killed, fit, resume=True), kill_targets(last_logged_step(straight), kills,
                                                                                  rng), rng)
    a, b = rows(killed), rows(straight)
    summary = {"strategy": strategy, "kills": len(done), "rows": len(b), "rows_equal": a == b,
               "weights_equal": same_weights(killed / "model.safetensors", straight / "model.safetensors"),
               "ema_equal": same_weights(killed / "model_ema.safetensors", straight / "model_ema.safetensors"),
               "max_all_gone_s": max((k["all_gone_s"] for k in done), default=None)}
    if not summary["rows_equal"]:
        diff = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) if len(a) == len(b) else None
        summary["first_row_differing"] = diff if diff is None else {"killed": a[diff], "straight": b[diff]}
    summary["ok"] = summary["rows_equal"] and summary["weights_equal"] and summary["ema_equal"]
    return summary


def other_world_sizes(tmp: Path, sizes: list[int], kills: int, rng: random.Random) -> dict:
    """The ledger task's chain, launch k on ``sizes[k % len(sizes)]`` processes."""
    from ledger_task import read_ledger

    def ledger_fit(name: str) -> list[str]:
        recipe = {"seed": 0, "task": {"name": "ledger", "samples": 240, "ledger": str(tmp / f"{name}-ledger"),
                                      "step_sleep": 0.05},
                  "data": {"batch_size": 6}, "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
                  "trainer": {"epochs": 6, "accum_steps": 2, "log_every": 5, "precision": "fp32",
                              "progress": "plain", "plots": False},
                  "eval": {"every": 2}, "checkpoint": {"every": 10, "unit": "steps"}}
        (tmp / f"{name}.yaml").write_text(json.dumps(recipe))  # JSON is YAML
        return ["--import", str(TESTS / "support" / "ledger_task.py"), "fit", str(tmp / f"{name}.yaml")]

    killed, straight = tmp / "killed", tmp / "straight"
    if launch(straight, ledger_fit("straight"), resume=False, nproc=sizes[0]).wait() != 0:
        raise SystemExit(f"the straight run failed: {stderr_of(straight)}")
    fit, launched = ledger_fit("killed"), [0.0]

    def start(k: int) -> subprocess.Popen:
        launched[0] = time.time()
        return launch(killed, fit, resume=k > 0, nproc=sizes[k % len(sizes)])

    def steps_this_launch() -> int:  # a kill lands a number of steps after the launch's resume point
        rows = [json.loads(line) for f in (tmp / "killed-ledger").glob("*.jsonl") for line in
                f.read_text().splitlines() if line.endswith("}")] if (tmp / "killed-ledger").is_dir() else []
        return len({r["step"] for r in rows if r["time"] >= launched[0]})

    # the first launch is killed after its first checkpoint (step 10): a run killed before any starts
    # afresh, on its new number of processes with the configured per-process batch
    targets = [rng.randint(11, 25)] + [None if rng.random() < 0.25 else rng.randint(3, 25) for _ in range(kills - 1)]
    done = chain(killed, start, targets, rng, logged=steps_this_launch)

    def trained(name: str) -> list[tuple[int, int, float]]:
        return sorted((r["epoch"], i, d) for r in read_ledger(tmp / f"{name}-ledger") for i, d in r["samples"])

    want, got = trained("straight"), trained("killed")
    a, b = (load_file(d / "model.safetensors") for d in (killed, straight))
    finals = [json.loads((d / "summary.json").read_text())["final"]["mse"] for d in (killed, straight)]
    kept = read_ledger(tmp / "killed-ledger")
    summary = {"world_sizes": sizes, "kills": len(done), "launches_on": [sizes[k % len(sizes)] for k in
                                                                         range(len(done) + 1)],
               "steps_trained_on": {n: len({r["step"] for r in kept if r["world"] == n}) for n in sorted(set(sizes))},
               "samples_trained": len(got), "samples_in_straight_run": len(want),
               "each_once_with_straight_draws": got == want and len(set((e, i) for e, i, _ in got)) == len(got),
               "max_weight_difference": max(float((a[k] - b[k]).abs().max()) for k in a),
               "final_mse": finals[0], "straight_final_mse": finals[1],
               "max_all_gone_s": max((k["all_gone_s"] for k in done), default=None)}
    summary["ok"] = summary["each_once_with_straight_draws"] and summary["max_weight_difference"] < 1e-5
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=["ddp", "fsdp"], default="ddp")
    parser.add_argument("--world-sizes", help="comma-separated numbers of processes, one per launch in turn")
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        if args.world_sizes:
            summary = other_world_sizes(Path(tmp), [int(n) for n in args.world_sizes.split(",")], args.kills, rng)
        else:
            summary = same_run(Path(tmp), args.strategy, args.kills, rng)
        print(json.dumps(summary), flush=True)
        if not summary.pop("ok"):
            raise SystemExit(1)


if __name__ == "__main__":
    main()
