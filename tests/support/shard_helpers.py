"""Shared by the shard tests (test_shard_command.py, test_shard_training.py): `visiontrain` in this
process or started in the background, and the digits' shards both modules read, written once a test
session.

A command whose subject is what it writes or prints (a write of shards, a refusal, `validate`) runs
``cli.main`` in this process: a process's start-up (importing torch) would cost more than the command.
What must be a process of its own stays one: a write or a run killed with SIGKILL, a recipe's run with
its DataLoader workers, a run with two ranks.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from procs import cli_here, popen

DIGITS_SHARDS = ("shard", "classify-fashion", "data.name=digits", "--shard-size", "64KB")


def start_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m visiontrain ARGS`` started on one thread in its own process group, output piped
    (``procs.finish`` waits for it); ``env`` replaces this process's environment."""
    return popen([sys.executable, "-m", "visiontrain", *args], env=env)


def stop(*procs: subprocess.Popen) -> None:
    """SIGKILL to the process group of each of ``procs`` still running (a test that failed before it
    waited for them leaves none behind); nothing for those that ended."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def digits_shards(tmp_path_factory) -> tuple[Path, dict]:
    """classify-fashion's digits (1,437 + 360 images) as 64 KB shards (76 + 19 of them), written by
    `visiontrain shard` in this process once a session; ``(directory, the command's JSON line)``.
    Readers only: a test that changes a file works on a copy."""
    out = tmp_path_factory.getbasetemp() / "digits-shards-64KB"
    printed = out.with_name(out.name + ".json")
    if not printed.exists():
        done = cli_here(*DIGITS_SHARDS, "--out", str(out))
        assert done.returncode == 0, f"visiontrain {' '.join(DIGITS_SHARDS)}: {done.stderr[-2000:]}"
        printed.write_text(done.stdout.strip().splitlines()[-1])
    return out, json.loads(printed.read_text())
