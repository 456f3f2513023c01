"""Waiting on a CLI subprocess in a test without losing a hang's evidence.

Processes are started with ``PYTHONFAULTHANDLER=1`` in their own process group; when one outlives
its timeout, SIGABRT goes to the whole group (torchrun, every rank, DataLoader workers), whose
fault handlers print every thread's Python stack to stderr, and the test fails with that output.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

FAULTHANDLER_ENV = {"PYTHONFAULTHANDLER": "1"}


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """``proc.communicate(timeout)``; on a timeout, the group's stacks and a test failure."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGABRT)
        except ProcessLookupError:
            pass
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, proc.args))} still running after {timeout:.0f} s; stacks at the "
                    f"abort:\n--- stdout (tail)\n{(out or '')[-3000:]}\n--- stderr (tail)\n{(err or '')[-12000:]}")


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m visiontrain ARGS`` on one thread in its own process group, output captured;
    ``env`` adds to (or replaces) this process's environment."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **FAULTHANDLER_ENV, **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "visiontrain", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd, env=env, start_new_session=True)
    out, err = finish(proc, timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
