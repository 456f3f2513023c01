"""Waiting on a CLI subprocess in a test without losing a hang's evidence; the processes a run left.

Processes are started with ``PYTHONFAULTHANDLER=1`` in their own process group; when one outlives
its timeout, SIGABRT goes to the whole group (torchrun, every rank, DataLoader workers), whose
fault handlers print every thread's Python stack to stderr, and the test fails with that output.
"""
from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
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


def cli_here(*args: str, capture: pytest.CaptureFixture | None = None) -> subprocess.CompletedProcess:
    """``visiontrain ARGS`` in this process (``cli.main``, the CLI from its entry point on), its stdout
    and stderr captured: for a command that trains nothing and loads in-process (validate, predict,
    export of a run with ``data.num_workers=0``), where a process of its own would spend 5-8 s
    importing torch and the engine before the few hundred milliseconds the test is about.
    ``capture``: the test's ``capfd`` (a C++ library's lines on file descriptor 2 too) or ``capsys``;
    without one (a module fixture has none), Python's own streams are redirected."""
    from visiontrain import cli

    if capture is not None:
        capture.readouterr()
        code = cli.main(list(args))
        out, err = capture.readouterr()
        return subprocess.CompletedProcess(["visiontrain", *args], code, out, err)
    out_io, err_io = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out_io), contextlib.redirect_stderr(err_io):
        code = cli.main(list(args))
    return subprocess.CompletedProcess(["visiontrain", *args], code, out_io.getvalue(), err_io.getvalue())


def in_process(capture: pytest.CaptureFixture, *args: str) -> tuple[int, str, str]:
    """``cli_here`` with the test's capture fixture: (exit code, stdout, stderr)."""
    done = cli_here(*args, capture=capture)
    return done.returncode, done.stdout, done.stderr


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 600,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m visiontrain ARGS`` on one thread in its own process group, output captured;
    ``env`` adds to (or replaces) this process's environment."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **FAULTHANDLER_ENV, **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "visiontrain", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd, env=env, start_new_session=True)
    out, err = finish(proc, timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state letter, process group) of a process; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), fields[0], int(fields[2])


def group(pgid: int) -> set[int]:
    """The live members of a process group (started after the tree was taken, they would escape it)."""
    return alive({int(e) for e in os.listdir("/proc") if e.isdigit() and (_stat(int(e)) or (0, "", 0))[2] == pgid})


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            children.setdefault(stat[0], []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    """Those still running (a zombie has ended: it waits only to be reaped)."""
    return {p for p in pids if (stat := _stat(p)) is not None and stat[1] != "Z"}


def wait_for(condition, what: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}")
        if time.monotonic() > end:
            pytest.fail(f"no {what} after {timeout:.0f} s")
        time.sleep(0.2)
