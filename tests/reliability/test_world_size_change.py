"""A run resumed on another number of processes keeps its global batch, its samples and their augmentation.

The ledger task (tests/support/ledger_task.py) writes down every (epoch, sample index, augmentation draw)
each process trains on. A run on 1 process is killed with SIGKILL at a random step, resumed on 2
(DDP on CPU with gloo), killed again, resumed on 3, killed, and finished on 1 again, each time with
``--resume auto`` and the recipe as written: the resume changes the per-process batch and the
accumulation itself to keep the global batch of 12. The samples of the whole chain, the steps a
resume trained again left out, are those of a straight run on one process: each (epoch, sample)
exactly once, with the same draw. The same for a sharded (FSDP) run (on one process it shards
nothing and keeps the sharded checkpoint format), and for a run from shards, whose order is cut for
``data.order_processes=6`` and which changes its workers at each resume too. And for an elastic
torchrun run (``--nnodes 1:2``) that loses an agent and gains one without a restart of the command.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from ledger_task import read_ledger
from procs import descendants, finish, kill_everything, popen
from shard_helpers import digits_shards

LEDGER_TASK = Path(__file__).parents[1] / "support" / "ledger_task.py"
EPOCHS = 6  # of 48 samples


def write_recipe(path: Path, ledger: Path, step_sleep: float, strategy: str, shards: Path | None = None,
                 accum: int = 2) -> Path:
    """6 samples a process x 2 micro-batches a step: a global batch of 12 on one process; from
    ``shards``: 12 samples a process x 1 (their order follows the processes, not the accumulation).
    ``step_sleep``: each micro-batch waits, so that a kill lands mid-run (the straight run: 0)."""
    data = {"batch_size": 6, "num_workers": 0} if shards is None else {
        "name": "shards", "shards": str(shards), "limit_train": 48, "order_processes": 6, "batch_size": 12,
        "num_workers": 0}
    recipe = {"seed": 3, "task": {"name": "ledger", "samples": 48, "ledger": str(ledger), "step_sleep": step_sleep},
              "data": data,
              "optim": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
              "schedules": {"lr": {"shape": "cosine", "warmup": 4}},
              # fp32: the engine's tests compute the same on a CPU with native bf16 and without; no plots
              # (2 s of CPU a run, not the subject)
              "trainer": {"epochs": EPOCHS, "accum_steps": accum if shards is None else 1, "log_every": 1,
                          "precision": "fp32", "progress": "plain", "plots": False},
              "distributed": {"strategy": strategy},
              "eval": {"every": 2}, "checkpoint": {"every": 2, "unit": "steps"}}
    path.write_text(yaml.safe_dump(recipe))
    return path


def fit(recipe: Path, run_dir: Path, nproc: int, *extra: str):
    args = [sys.executable, "-m", "visiontrain", "--import", str(LEDGER_TASK), "fit", str(recipe),
            "--run-dir", str(run_dir), *extra]
    return popen(args + (["--nproc", str(nproc)] if nproc > 1 else []))


def steps_written(ledger: Path) -> int:
    steps = [json.loads(line)["step"] for f in ledger.glob("*.jsonl") for line in f.read_text().splitlines()
             if line.endswith("}")]
    return max(steps, default=0)


def kill_at_step(proc, ledger: Path, step: int) -> None:
    """SIGKILL to the whole run (torchrun, its ranks, their workers) once some process has finished
    ``step``: by then the checkpoint of an earlier step has been written (one every 2 steps)."""
    deadline = time.time() + 240
    while proc.poll() is None and steps_written(ledger) < step and time.time() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, f"the run ended before step {step}: {proc.communicate()[1][-3000:]}"
    kill_everything(proc)


def trained(ledger: Path) -> list[tuple[int, int, float]]:
    return sorted((row["epoch"], index, draw) for row in read_ledger(ledger) for index, draw in row["samples"])


def killed_and_resumed(tmp_path: Path, sizes: tuple[int, ...], strategy: str, shards: Path | None = None,
                       workers: tuple[int, ...] | None = None) -> tuple[list[str], str]:
    """The run straight through on ``sizes[0]`` processes, and killed with SIGKILL at a random step on
    each of the others in turn but the last, which trains to the end, each resumed with
    ``--resume auto``. Returns each resume's line about the global batch, and what to name in a
    failure's message (the kill seed). Checks that every sample was trained once, with the straight
    run's draw, and that the weights end within float rounding of the straight run's."""
    seed = int(os.environ.get("VISIONTRAIN_TEST_KILL_SEED", time.time_ns() % 10_000))
    rng, where = random.Random(seed), f"kill seed {seed}"  # the seed is in every failure's message
    straight_ledger, ledger = tmp_path / "straight-ledger", tmp_path / "ledger"
    straight = fit(write_recipe(tmp_path / "straight.yaml", straight_ledger, 0.0, strategy, shards),
                   tmp_path / "straight", sizes[0])
    recipe, run_dir = write_recipe(tmp_path / "ledger.yaml", ledger, 0.1, strategy, shards), tmp_path / "chain"
    said = []
    for k, nproc in enumerate(sizes):
        start = steps_written(ledger)
        extra = [f"data.num_workers={workers[k]}"] if workers else []  # the subject of the shards' chain
        proc = fit(recipe, run_dir, nproc, *extra, *(["--resume", "auto"] if start else []))
        if k < len(sizes) - 1:
            kill_at_step(proc, ledger, start + 3 + rng.randint(0, 2))
        out, err = finish(proc, 300)
        said += [line.split(" ", 2)[-1] for line in (out + err).splitlines() if "kept" in line]
    assert proc.returncode == 0, f"{where}: {err[-3000:]}"
    _, straight_err = finish(straight, 300)
    assert straight.returncode == 0, straight_err[-3000:]

    want, got = trained(straight_ledger), trained(ledger)
    assert len(want) == EPOCHS * 48 and len({(e, i) for e, i, _ in want}) == EPOCHS * 48
    assert got == want, f"{where}: {len(got)} samples trained, {len(want)} in the straight run"
    steps = {(row["step"], row["world"]) for row in read_ledger(ledger)}
    assert {world for _, world in steps} == set(sizes), f"{where}: {sorted(steps)}"

    # Not bit-identical: the ranks' gradients are summed in another order than one process's
    # accumulation (and 3 processes batch 4 samples where 1 batches 6). Measured with DDP: at most
    # 1.8e-7 apart (three kill seeds, with torch's AVX-512 kernels and with ATEN_CPU_CAPABILITY=avx2).
    a, b = (load_file(str(d / "model.safetensors")) for d in (tmp_path / "straight", run_dir))
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {name}: {m}")
    return said, where


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_killed_and_resumed_on_1_2_3_1_processes_trains_each_sample_once_as_the_straight_run(tmp_path, strategy):
    """FSDP: each resume reads the sharded checkpoint into another number of shards (torch's
    distributed checkpoint reshards on load); on one process FSDP shards nothing and its checkpoints
    keep the sharded format (one shard a tensor), read whole there and resharded on two."""
    said, where = killed_and_resumed(tmp_path, (1, 2, 3, 1), strategy)
    assert said == ["resumed on 2 processes (written on 1): trainer.accum_steps 2 -> 1: global batch 12 kept",
                    "resumed on 3 processes (written on 2): data.batch_size 6 -> 4, trainer.accum_steps 2 -> 1: "
                    "global batch 12 kept",
                    "resumed on 1 process (written on 3): global batch 12 kept (data.batch_size=6 on 1 "
                    "process x trainer.accum_steps=2)"], f"{where}: {said}"


def test_a_run_from_shards_resumed_on_1_3_1_processes_trains_each_sample_once(tmp_path, tmp_path_factory):
    """data.name=shards with data.order_processes=6: each resume reads the order the checkpoint was
    cut for, on other processes and other workers (0, 1, 0), and keeps the global batch of 12. (The
    order's own chain, 1 -> 2 -> 3 -> 1 with 2, 3, 1 and 4 workers, is tests/data/test_shard_order.py:
    a launch here costs a torchrun start, and the suite's time is shared.)"""
    shards, _ = digits_shards(tmp_path_factory)
    said, where = killed_and_resumed(tmp_path, (1, 3, 1), "ddp", shards, workers=(0, 1, 0))
    assert said == ["resumed on 3 processes (written on 1): data.batch_size 12 -> 4: global batch 12 kept",
                    "resumed on 1 process (written on 3): global batch 12 kept (data.batch_size=12 on 1 "
                    "process x trainer.accum_steps=1)"], f"{where}: {said}"


# ---------------------------------------------------------------------------- an elastic torchrun run
def agent(recipe: Path, run_dir: Path, port: int, log: Path, host: bool) -> subprocess.Popen:
    """One elastic agent of the run, as a user starts one on each machine: ``torchrun --nnodes 1:2``
    with the c10d rendezvous, restarting its rank up to 3 times, each rank ``fit ... --resume auto``.

    - ``host``: whether this agent serves the rendezvous' store. On one machine every agent is at the
      endpoint's address, and the first to bind the port would serve it; the c10d rendezvous does not
      survive the loss of that agent, so the one the test keeps is named.
    - TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (docs/distributed.md): with torch 2.13's default, an agent
      that stays rank 0 across rounds never publishes the new round's store address, and a node
      joining after a scale-down waits for it until the rendezvous times out.
    - The last call is 6 s, not 30: the first round waits that long for the second agent (started with
      the first), a scale-down as long for none to come."""
    conf = f"is_host={str(host).lower()},last_call_timeout=6,join_timeout=120"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "ledger",
               "--rdzv-conf", conf, "--max-restarts", "3",
               "--log-dir", str(log.parent / "torchrun-logs"),  # not a new /tmp/torchelastic_* an agent
               "-m", "visiontrain", "--import", str(LEDGER_TASK), "fit", str(recipe), "--run-dir", str(run_dir),
               "--resume", "auto"]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with open(log, "ab") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def ended(procs: list[subprocess.Popen], timeout: float) -> None:
    """Wait for ``procs``; past ``timeout`` SIGKILL them and every process below them."""
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            for pid in [*descendants(proc.pid), proc.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            proc.wait(timeout=60)


def test_an_elastic_torchrun_run_loses_a_node_and_gains_one_training_each_sample_once(tmp_path):
    """Two agents with ``--nnodes 1:2`` train on 2 processes; one agent is SIGKILLed with its rank; the
    other's rank fails on the lost peer, its agent restarts it on 1 process from the last checkpoint
    (the global batch of 24 kept by accumulation); a new agent joins and the run goes on, and ends,
    on 2. Every sample of every epoch is trained once with the straight run's draw, and each change
    of processes is said in one line."""
    ledger, run_dir, port = tmp_path / "ledger", tmp_path / "run", free_port()
    # the straight run: 1 process x 6 samples x 4 micro-batches, the global batch of the elastic run's
    # first round (2 processes x 6 x 2)
    straight = fit(write_recipe(tmp_path / "straight.yaml", tmp_path / "straight-ledger", 0.0, "ddp", accum=4),
                   tmp_path / "straight", 1)
    recipe = write_recipe(tmp_path / "elastic.yaml", ledger, 0.3, "ddp")
    logs = [tmp_path / f"agent-{name}.log" for name in "abc"]
    first, second = agent(recipe, run_dir, port, logs[0], True), agent(recipe, run_dir, port, logs[1], False)
    procs = [first, second]
    try:
        wait_until(lambda: steps_written(ledger) >= 3, "3 steps on 2 processes", procs)
        for pid in [*descendants(second.pid), second.pid]:  # the machine is gone: its agent and its rank
            os.kill(pid, signal.SIGKILL)
        second.wait(timeout=60)
        wait_until(lambda: 1 in worlds(ledger), "a step on 1 process", [first])
        procs.append(agent(recipe, run_dir, port, logs[2], False))
        ended([first, procs[2]], 300)
    finally:
        ended(procs, 0)
    assert first.returncode == 0 and procs[2].returncode == 0, logs[0].read_text()[-3000:]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (torch" not in logs[0].read_text()  # it is set: no hint
    _, straight_err = finish(straight, 300)
    assert straight.returncode == 0, straight_err[-3000:]

    want, got = trained(tmp_path / "straight-ledger"), trained(ledger)
    assert len(want) == EPOCHS * 48 and got == want, f"{len(got)} samples trained, {len(want)} in the straight run"
    rounds = [world for world, _ in sorted({(r["world"], r["launch"]) for r in read_ledger(ledger)},
                                           key=lambda wl: first_time(ledger, wl[1]))]
    assert rounds == [2, 1, 2], rounds
    said = [line.split(" ", 2)[-1] for line in (logs[0].read_text() + logs[2].read_text()).splitlines()
            if "kept" in line]
    assert said == ["resumed on 1 process (written on 2): trainer.accum_steps 2 -> 4: global batch 24 kept",
                    "resumed on 2 processes (written on 1): global batch 24 kept (data.batch_size=6 on 2 processes x "
                    "trainer.accum_steps=2)"], said
    a, b = (load_file(str(d / "model.safetensors")) for d in (tmp_path / "straight", run_dir))
    for name in a:  # the tolerance of the chains above, for the same reason
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6)


def wait_until(condition, what: str, procs: list[subprocess.Popen], timeout: float = 180.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if any(p.poll() is not None for p in procs):
            pytest.fail(f"an agent ended before {what}")
        if time.monotonic() > end:
            pytest.fail(f"no {what} after {timeout:.0f} s")
        time.sleep(0.05)


def worlds(ledger: Path) -> set[int]:
    return {json.loads(line)["world"] for f in ledger.glob("*.jsonl") for line in f.read_text().splitlines()
            if line.endswith("}")}


def first_time(ledger: Path, launch: str) -> float:
    return min(r["time"] for r in read_ledger(ledger) if r["launch"] == launch)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
