"""kill -9 at 12 seeded moments (each kind twice): inside training steps, evaluations, checkpoint writes (part-way
through the bytes, just before and just after the rename) and metrics lines. After every kill the
newest checkpoint on disk loads; `--resume auto` then finishes with weights bit-identical to an
uninterrupted run, and metrics.jsonl holds each logged step once, as that run's does."""
from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file

import procs
from toy_task import toy_config
from visiontrain.core import config as C
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.engine.state.checkpoint import load_checkpoint

WORKER = Path(__file__).parent / "kill_worker.py"
# 256 samples / 16 = 16 steps per epoch, 48 in all: a checkpoint every 5 steps, an evaluation every 8
# (best.pt on each record), a log line every 4; noise, dropout and an EMA make resume exactness bite.
CONFIG = dict(task__noise=True, task__dropout=0.1, data__batch_size=16, trainer__epochs=3, trainer__log_every=4,
              optim__name="adamw", optim__lr=0.01, ema__enabled=True, ema__decay=0.9,
              eval__every=8, eval__unit="steps", checkpoint__every=5, checkpoint__unit="steps")
# how many of each event one process sees at most before the moment (a resumed process has fewer left)
MOMENTS = {"step": 20, "eval": 2, "save-write": 4, "save-before-rename": 4, "save-after-rename": 4, "log": 6}
# each chain kills once at every kind of moment, in a seeded order: every kind is hit in both chains
CHAINS, KILLS_PER_CHAIN = 2, len(MOMENTS)


def launch(recipe: Path, run_dir: Path, spec: dict) -> subprocess.CompletedProcess:
    return procs.run([sys.executable, WORKER, recipe, run_dir, json.dumps(spec)], timeout=300)


def logged(run_dir: Path) -> list[tuple[str, int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["kind"], r["step"], r.get("total", r.get("mse"))) for r in rows]


def chain(recipe: Path, run_dir: Path, seed: int) -> list[str]:
    """Kill, check, resume ... KILLS_PER_CHAIN times, then let it finish. Returns the moments killed."""
    rng, killed = random.Random(seed), []
    phases = rng.sample(sorted(MOMENTS), len(MOMENTS))
    while len(killed) < KILLS_PER_CHAIN:
        phase = phases[len(killed)]
        spec = {"phase": phase, "n": rng.randint(1, MOMENTS[phase]), "fraction": rng.random()}
        proc = launch(recipe, run_dir, spec)
        if proc.returncode == 0:
            break  # the run finished before that moment came
        assert proc.returncode == -signal.SIGKILL, f"{spec}: {proc.stderr[-2000:]}"
        killed.append(f"{phase}#{spec['n']}")
        for pt in (run_dir / "checkpoints").glob("*.pt"):  # whatever is on disk loads, the newest included
            state = load_checkpoint(pt)
            assert fmt.step_of(state) <= 48
    if len(killed) == KILLS_PER_CHAIN:
        proc = launch(recipe, run_dir, {"phase": "none"})
        assert proc.returncode == 0, proc.stderr[-2000:]
    return killed


def test_kill_9_anywhere_then_resume_gives_the_uninterrupted_weights(tmp_path):
    recipe = tmp_path / "toy.yaml"
    recipe.write_text(C.dump_config(toy_config(**CONFIG)))
    with ThreadPoolExecutor(2) as pool:  # two processes at a time on the 2 cores
        chains = pool.map(lambda i: chain(recipe, tmp_path / f"chain{i}", seed=i), range(CHAINS))
        reference = launch(recipe, tmp_path / "whole", {"phase": "none"})
        chains = list(chains)
    assert reference.returncode == 0, reference.stderr[-2000:]
    kills = [k for c in chains for k in c]
    assert len(kills) >= 10, chains  # a late moment may come after the run has ended: at most one a chain
    assert {k.split("#")[0] for k in kills} == set(MOMENTS), kills
    whole = tmp_path / "whole"
    for i in range(CHAINS):
        run = tmp_path / f"chain{i}"
        for name in ("model.safetensors", "model_ema.safetensors"):
            a, b = load_file(str(whole / name)), load_file(str(run / name))
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (name, chains[i])
        assert logged(run) == logged(whole), chains[i]  # each step once, same values, no cut line
        assert not list(run.rglob(".*.tmp"))  # what interrupted writes left was cleaned up
