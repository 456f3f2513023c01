"""Nothing outlives a dead run, and one training writes a run dir.

The training process, or the launcher of `fit --nproc 2`, is killed with SIGKILL while DataLoader
workers run (the OOM killer, `kill -9`): every process it started (forkserver, resource tracker,
workers, ranks, their workers) is gone within 5 s. A second `fit` on a live run dir is refused in
one line naming the holder; after the holder's death its lock is taken over, with a line saying so.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from procs import FAULTHANDLER_ENV, alive, descendants, group, run_cli, wait_for

# classify-fashion on the embedded digits, long enough to be killed while it trains. The subject is
# the lifetime of the run's processes, so the recipe's num_workers=0 is raised to 2 (and the start
# method varied where the test says so): without workers there is nothing to outlive the trainer.
RUN = ["classify-fashion", "data.name=digits", "data.batch_size=32", "trainer.epochs=200", "data.num_workers=2"]
#: The issue's bound: every process of the run ends within this many seconds of the kill.
GRACE_S = 5.0


def start_fit(run_dir: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **FAULTHANDLER_ENV}
    return subprocess.Popen([sys.executable, "-m", "visiontrain", "fit", *RUN, *extra, "trainer.progress=plain",
                             "--run-dir", str(run_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)


def training(run_dir: Path) -> bool:
    metrics = run_dir / "metrics.jsonl"
    return metrics.is_file() and metrics.stat().st_size > 0


def assert_all_end(pids: set[int]) -> float:
    """Wait for every pid to end; the seconds it took (a failure past GRACE_S names the survivors)."""
    start = time.monotonic()
    while alive(pids) and time.monotonic() - start < GRACE_S:
        time.sleep(0.05)
    survivors = alive(pids)
    for pid in survivors:  # nothing of the test outlives it either
        os.kill(pid, signal.SIGKILL)
    assert not survivors, "alive %.0f s after the kill: %s" % (GRACE_S, {
        p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:120] for p in survivors
        if Path(f"/proc/{p}/cmdline").exists()})
    return time.monotonic() - start


@pytest.mark.parametrize("start", ["forkserver", "fork", "spawn"])
def test_the_workers_end_with_a_killed_trainer(start, tmp_path):
    # data.worker_start varies: each start method makes a different tree (forkserver -> workers, or
    # the trainer's own children), and each must end with the trainer
    proc = start_fit(tmp_path / "run", f"data.worker_start={start}")
    try:
        # the trainer's two workers exist (plus the forkserver and resource tracker for forkserver)
        wait_for(lambda: training(tmp_path / "run") and len(descendants(proc.pid)) >= 2, "worker", proc)
        tree = descendants(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)  # the trainer alone, as the OOM killer does
        proc.wait(10)
        assert_all_end(tree)
        # the resource tracker, the last of them, cleaned up after the dead trainer without a word
        # (it printed "There appear to be 11 leaked semaphore objects to clean up at shutdown")
        assert "leaked" not in proc.stderr.read()
    finally:
        left = group(proc.pid)  # nothing is left in its process group either
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        proc.stderr.close()
    assert not left


def test_the_ranks_end_with_a_killed_launcher(tmp_path):
    proc = start_fit(tmp_path / "run", "--nproc", "2")
    try:
        # torchrun's agent -> 2 ranks -> a forkserver, tracker and 2 workers each
        wait_for(lambda: training(tmp_path / "run") and len(descendants(proc.pid)) >= 8, "rank workers", proc)
        tree = descendants(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's process group; the ranks have sessions of their own
        proc.wait(10)
        assert_all_end(tree)
    finally:
        left = group(proc.pid)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        proc.stderr.close()
    assert not left


def test_one_writer_per_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    first = start_fit(run_dir)
    try:
        wait_for(lambda: training(run_dir), "training", first)
        for extra in ([], ["--nproc", "2"]):  # a second fit, in one process and through torchrun
            second = run_cli("fit", *RUN, "--run-dir", str(run_dir), "--resume", "auto", *extra, timeout=120)
            assert second.returncode == 2, second.stderr[-3000:]
            lines = second.stderr.strip().splitlines()
            assert len(lines) == 1 and f"pid {first.pid} on host" in lines[0], lines
            assert "in use by another training" in lines[0]
        os.kill(first.pid, signal.SIGKILL)
        first.wait(10)
    finally:
        first.kill()
        first.stderr.close()
    # the dead holder's lock is taken over; a short continuation (its length only) then ends the run
    resumed = run_cli("fit", *RUN, "trainer.max_steps=2", "--run-dir", str(run_dir), "--resume", "auto",
                      timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"left by pid {first.pid} on host" in resumed.stderr and "no longer running" in resumed.stderr
    assert not (run_dir / ".lock").exists()  # released at the end of the run
