"""Starting a CLI process in a test, waiting on it without losing a hang's evidence; the processes a
run left.

Processes are started with ``PYTHONFAULTHANDLER=1`` in their own process group; when one outlives
its timeout, SIGABRT goes to the whole group (torchrun, every rank, DataLoader workers), whose
fault handlers print every thread's Python stack to stderr, and the test fails with that output.
A ``visiontrain`` command is forked from a Python that has torch and the other heavy libraries
imported already (``tests/support/warm_python.py``: 5-6 s of CPU less a command on a 2-core machine);
``VISIONTRAIN_TEST_FRESH_PYTHON=1`` starts every one in a fresh interpreter instead.
"""
from __future__ import annotations

import atexit
import contextlib
import io
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import warm_python

FAULTHANDLER_ENV = {"PYTHONFAULTHANDLER": "1"}
#: What every command of the tests runs under (and the warm server with it): one thread, its stacks
#: on a fatal signal, its output unbuffered (a test reads it line by line as it comes).
COMMAND_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **FAULTHANDLER_ENV}
_server: warm_python.Server | None = None
_server_lock = threading.Lock()  # test_docs starts commands from a few threads


def warm_server() -> warm_python.Server | None:
    """This test process's warm Python, started at its first use; None under
    ``VISIONTRAIN_TEST_FRESH_PYTHON=1``."""
    global _server
    if os.environ.get("VISIONTRAIN_TEST_FRESH_PYTHON") == "1":
        return None
    with _server_lock:
        if _server is None:
            _server = warm_python.Server({**os.environ, **COMMAND_ENV})
            atexit.register(_server.close)
    return _server


def shell_env(bin_dir: Path) -> dict[str, str]:
    """The environment of a shell script whose ``visiontrain`` commands run in the warm Python: a
    ``visiontrain`` in ``bin_dir`` (written here, first on PATH, then the venv's bin) hands each to the
    server and stands in for it (``warm_python.shim``)."""
    venv_bin = Path(sys.executable).parent
    env = {**os.environ, **COMMAND_ENV, "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"}
    server = warm_server()
    if server is None:
        return env
    shim = bin_dir / "visiontrain"
    with _server_lock:
        if not shim.exists():
            bin_dir.mkdir(parents=True, exist_ok=True)
            part = shim.with_suffix(".part")
            code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import warm_python; "
                    f"warm_python.shim({str(venv_bin / 'visiontrain')!r})")
            part.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -S -c {shlex.quote(code)} "$@"\n')
            part.chmod(0o755)
            part.rename(shim)
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", warm_python.SOCKET_ENV: server.path}


def _warm_form(args: list[str]) -> tuple[str | None, list[str]] | None:
    """(module, the child's ``sys.argv``) of a command the warm Python can run: ``python -m MODULE``,
    ``python SCRIPT.py`` or the venv's ``visiontrain`` script; None for any other."""
    if args[0] == str(Path(sys.executable).parent / "visiontrain"):
        return None, args
    if args[0] == sys.executable and len(args) > 2 and args[1] == "-m":
        return args[2], args[2:]
    if args[0] == sys.executable and len(args) > 1 and args[1].endswith(".py"):
        return None, args[1:]
    return None


def popen(args: list, *, cwd: Path | str | None = None, env: dict[str, str] | None = None,
          capture: bool = True) -> subprocess.Popen | warm_python.WarmProcess:
    """Start ``args`` in its own process group, stdout and stderr captured as text (or inherited):
    forked from the warm Python when it is a Python command (``_warm_form``) and ``env`` (default:
    this environment with COMMAND_ENV) is one the server can take, else a fresh process."""
    env = {**os.environ, **COMMAND_ENV} if env is None else env
    args = [str(a) for a in args]
    server, form = warm_server(), _warm_form(args)
    if server is not None and form is not None:
        try:
            return warm_python.WarmProcess(server, args, form[1], module=form[0], cwd=str(cwd) if cwd else None,
                                           env=env, new_session=True, capture=capture)
        except warm_python.NotWarm:
            pass
    pipe = subprocess.PIPE if capture else None
    return subprocess.Popen(args, stdout=pipe, stderr=pipe, text=True, cwd=cwd, env=env, start_new_session=True)


def run(args: list, *, cwd: Path | str | None = None, env: dict[str, str] | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess:
    """``popen`` waited on with ``finish``: the command's exit code and output."""
    proc = popen(args, cwd=cwd, env=env)
    out, err = finish(proc, timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def finish(proc: subprocess.Popen | warm_python.WarmProcess, timeout: float) -> tuple[str, str]:
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
    from visiontrain.app import cli

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
    return run([sys.executable, "-m", "visiontrain", *args], cwd=cwd, env={**os.environ, **COMMAND_ENV, **(env or {})},
               timeout=timeout)


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


def kill_everything(proc: subprocess.Popen | warm_python.WarmProcess) -> None:
    """SIGKILL to the launcher's process group and to every process below it (torchrun's ranks may
    sit in sessions of their own), then wait until each has gone."""
    below = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 60
    while alive(below):
        assert time.monotonic() < deadline, f"processes still alive after SIGKILL: {sorted(alive(below))}"
        time.sleep(0.05)


def wait_for(condition, what: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before {what}: {proc.stderr.read()[-3000:]}")
        if time.monotonic() > end:
            pytest.fail(f"no {what} after {timeout:.0f} s")
        time.sleep(0.2)
