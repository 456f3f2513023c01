"""tests/support/warm_python.py: a command forked from the warm Python ends, prints and exits as it would in a
fresh interpreter, and one it cannot run as such gets a fresh interpreter."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import procs
import warm_python

SUPPORT = Path(__file__).parents[1] / "support"  # warm_python.py

SCRIPT = '''
import json, os, sys, threading, time, atexit
what = sys.argv[1]
atexit.register(lambda: print("atexit ran", flush=True))
if what == "describe":
    print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "pid": os.getpid(),
                      "env": os.environ.get("VISIONTRAIN_PROBE"), "main": __name__, "file": __file__,
                      "torch_loaded": "torch" in sys.modules}))
elif what == "exit-text":
    sys.exit("a message for stderr")
elif what == "raise":
    raise ValueError("boom")
elif what == "thread":  # a non-daemon thread still running at the end of the main module
    threading.Thread(target=lambda: (time.sleep(0.5), print("thread finished", flush=True))).start()
elif what == "interrupt":
    raise KeyboardInterrupt
elif what == "sleep":
    print("sleeping", os.getpid(), flush=True)
    time.sleep(600)
'''


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("warm") / "probe.py"
    path.write_text(SCRIPT)
    return path


def both(script: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, ...]:
    """The same command forked from the warm Python and in a fresh interpreter."""
    # the server's environment: this process's may have gained keys since it started (see the note in
    # warm_python.same_python); what is tested here is a command the server takes
    env = {**procs.warm_server().env, **(env or {})}
    warm = procs.popen([sys.executable, script, *args], cwd=script.parent, env=env)
    assert isinstance(warm, warm_python.WarmProcess), "the warm Python refused a plain command"
    out, err = procs.finish(warm, 60)
    fresh = subprocess.run([sys.executable, str(script), *args], cwd=script.parent, env=env, capture_output=True,
                           text=True, timeout=60)
    return subprocess.CompletedProcess(warm.args, warm.returncode, out, err), fresh


@pytest.mark.skipif(procs.warm_server() is None, reason="VISIONTRAIN_TEST_FRESH_PYTHON=1")
def test_a_warm_command_ends_as_a_fresh_interpreters(script):
    # what importing dynamo and mlflow in this process puts in its environment is no difference
    import mlflow  # noqa: F401
    import torch._dynamo  # noqa: F401

    warm, fresh = both(script, "describe", env={"VISIONTRAIN_PROBE": "set for this call"})
    w, f = (json.loads(p.stdout.splitlines()[0]) for p in (warm, fresh))
    assert w["pid"] != f["pid"] and w["torch_loaded"] and not f["torch_loaded"]
    assert {k: w[k] for k in ("argv", "path0", "cwd", "env", "main", "file")} == \
        {k: f[k] for k in ("argv", "path0", "cwd", "env", "main", "file")}
    assert warm.stdout.splitlines()[1:] == ["atexit ran"] and warm.returncode == fresh.returncode == 0

    for what in ("exit-text", "raise", "thread", "interrupt"):
        warm, fresh = both(script, what)
        assert (warm.returncode, warm.stdout) == (fresh.returncode, fresh.stdout), what
        assert warm.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:], what
    assert warm.returncode == -signal.SIGINT


@pytest.mark.skipif(procs.warm_server() is None, reason="VISIONTRAIN_TEST_FRESH_PYTHON=1")
def test_a_killed_caller_takes_its_command_with_it_and_another_environment_gets_a_fresh_python(script):
    shell = procs.shell_env(script.parent / "bin")
    shim = {**procs.warm_server().env, "PATH": shell["PATH"], warm_python.SOCKET_ENV: shell[warm_python.SOCKET_ENV]}
    shell = subprocess.Popen(["bash", "-c", f"visiontrain --version; exec {sys.executable} -S -c "
                              f"\"import sys; sys.path.insert(0, {str(SUPPORT)!r}); import warm_python;"
                              f" sys.argv[1:] = ['sleep']; warm_python.shim({str(script)!r})\""],
                             env=shim, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert shell.stdout.readline().startswith("visiontrain ")  # the console script through the shim
        word, pid = shell.stdout.readline().split()
        assert word == "sleeping" and int(pid) in procs.descendants(procs.warm_server().pid)
    except BaseException:  # a fresh probe (the server refused) is in the shell's group: nothing outlives the test
        os.killpg(shell.pid, signal.SIGKILL)
        raise
    os.killpg(shell.pid, signal.SIGKILL)  # the shim standing in for the command dies without a word
    shell.wait(10)
    # the server notices the hung-up caller within its 0.05 s select; the wait only bounds a busy machine
    # (10 s was once too short on 2 cores at the end of the suite)
    deadline = time.monotonic() + 60
    while procs.alive({int(pid)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not procs.alive({int(pid)})

    other = procs.popen([sys.executable, script, "describe"], env={**os.environ, **procs.COMMAND_ENV,
                                                                   "OMP_NUM_THREADS": "3"})
    assert isinstance(other, subprocess.Popen)  # libgomp reads OMP_NUM_THREADS when torch loads it
    out, _ = procs.finish(other, 60)
    assert not json.loads(out.splitlines()[0])["torch_loaded"]



def test_what_the_callers_own_imports_put_in_its_environment_is_no_difference():
    """The suite's process may import dynamo (or mlflow) after its server started: its commands'
    environments then hold what those imports set, and must still be taken."""
    base, preload = {"PATH": "/bin", "HOME": "/root"}, {"TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_x"}
    later = {**base, **preload, "_MLFLOW_TELEMETRY_SESSION_ID": "abc", "VISIONTRAIN_X": "1", "PATH": "/usr/bin"}
    assert warm_python.same_python(later, base, preload)
    assert not warm_python.same_python({**later, "TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}, base, preload)
    assert not warm_python.same_python({**later, "OMP_NUM_THREADS": "3"}, base, preload)
