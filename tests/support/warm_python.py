"""A Python with the heavy libraries already imported, forking one child per CLI command of the tests.

A ``visiontrain`` command costs this machine kind 5-6 s of CPU importing torch, dynamo, matplotlib,
sympy and tensorboard before it reads its first argument; the suite runs about two hundred of them. The server
below imports those libraries once (third-party only: every visiontrain module is imported by the
child, so a registry filled by import order fails here as it fails for a user), then forks a child
for each command: the child takes the caller's stdin/stdout/stderr, working directory, environment
and session, sets ``sys.argv`` and ``sys.path[0]``, and runs the console script, ``-m MODULE`` or a
script file with ``runpy`` as the interpreter would, ending as the interpreter ends (non-daemon
threads joined, ``atexit`` handlers run, an uncaught exception's traceback and exit code 1, SIGINT
re-raised). Its pid is a real process's: a test signals it, kills it with -9, or reads its process
tree as it would a fresh one's; its DataLoader workers, forkserver and torchrun ranks start fresh.

What it cannot give a command is a fresh interpreter: the hash seed is the server's, and the
libraries were imported under the server's environment. So a caller whose environment differs from
the server's in anything but the per-call keys below gets a fresh interpreter instead
(``tests/support/procs.py``), as does every command when ``VISIONTRAIN_TEST_FRESH_PYTHON=1``. Tests of
the process itself (its parent's death, resource limits, namespaces: tests/reliability) start fresh
interpreters on purpose.

Protocol, one Unix stream connection per command: the caller sends one JSON line (argv, cwd, env,
new_session) with its three standard file descriptors attached (SCM_RIGHTS); the server answers one
JSON line with the child's pid, then one with its wait status when it ends.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Any

#: Environment keys a command may set differently from the server's: none is read at import time by
#: the preloaded libraries (visiontrain's own are read by its modules, which the child imports).
PER_CALL_PREFIXES = ("VISIONTRAIN_", "PYTEST_", "AWS_", "_MLFLOW_")  # mlflow's import sets a session id
PER_CALL_KEYS = ("PATH", "PWD", "OLDPWD", "SHLVL", "_")
SOCKET_ENV = "VISIONTRAIN_TEST_WARM_SOCKET"
_ENV_BEFORE_PRELOAD: dict[str, str] = {}
_ENV_SET_BY_PRELOAD: dict[str, str] = {}
PRELOAD = ("torch", "torch._dynamo", "matplotlib.figure", "sympy", "numpy", "PIL.Image", "torch.utils.tensorboard")


def same_python(env: dict[str, str], server_env: dict[str, str], set_by_preload: dict[str, str]) -> bool:
    """Whether a command with ``env`` runs in the server's child exactly as in a fresh interpreter.
    A key the preloaded imports set (dynamo's TORCHINDUCTOR_CACHE_DIR) may come with the caller's
    environment too, when the caller imported dynamo itself: with the same value, it is no difference."""
    def fixed(e: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in e.items() if not k.startswith(PER_CALL_PREFIXES) and k not in PER_CALL_KEYS
                and set_by_preload.get(k) != v}
    return fixed(env) == fixed(server_env)


def _exit_code(exc: SystemExit) -> int:
    """The status the interpreter exits with for ``SystemExit(code)``."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the command, run it, exit as the interpreter would. Never returns."""
    import atexit
    import runpy

    code = 1
    try:
        if request["new_session"]:
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGPIPE else signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update({**_ENV_SET_BY_PRELOAD, **request["env"]})
        sys.argv = list(request["argv"])
        # sys.path[0] as the interpreter sets it (the server's own is this file's directory)
        sys.path[0] = os.getcwd() if request["module"] else os.path.dirname(os.path.realpath(sys.argv[0]))
        if request["module"]:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(request["argv"][0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        threading._shutdown()  # what the interpreter does at exit: wait for non-daemon threads
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        if code == -signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def _accept(listener: socket.socket, children: dict[int, socket.socket | None]) -> None:
    """Fork the child a caller asked for."""
    conn, _ = listener.accept()
    line, fds, _flags, _addr = socket.recv_fds(conn, 1 << 20, 3)
    while not line.endswith(b"\n"):
        more = conn.recv(1 << 20)
        if not more:
            break
        line += more
    request = json.loads(line)
    if not same_python(request["env"], _ENV_BEFORE_PRELOAD, _ENV_SET_BY_PRELOAD):
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": None}).encode() + b"\n")
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in children.values():
            if other is not None:
                other.close()
        conn.close()
        _run_child(request, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    children[pid] = conn


def _reap(children: dict[int, socket.socket | None]) -> None:
    """Send each ended child's wait status to its caller."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(json.dumps({"status": status}).encode() + b"\n")
            except OSError:
                pass
            conn.close()


def _kill(pid: int) -> None:
    """SIGKILL a child, with its process group when it leads one (``new_session``)."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def serve(path: str) -> None:
    """Import PRELOAD, then fork a child per connection until stdin closes (the caller ended). A child
    whose caller hung up (a test process or shim killed) is killed: nothing outlives its caller."""
    import importlib

    _ENV_BEFORE_PRELOAD.update(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    # what the imports put in the environment (dynamo: TORCHINDUCTOR_CACHE_DIR), as they would have
    # in a fresh interpreter
    _ENV_SET_BY_PRELOAD.update({k: v for k, v in os.environ.items() if _ENV_BEFORE_PRELOAD.get(k) != v})
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    children: dict[int, socket.socket | None] = {}
    print("ready", flush=True)
    while True:
        callers = {conn: pid for pid, conn in children.items() if conn is not None}
        ready, _, _ = select.select([listener, sys.stdin, *callers], [], [], 0.05)
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            break
        if listener in ready:
            _accept(listener, children)
        for conn in set(ready) & set(callers):
            if not conn.recv(1):
                conn.close()
                children[callers[conn]] = None
                _kill(callers[conn])
        _reap(children)
    for pid in children:
        _kill(pid)


class NotWarm(Exception):
    """The server refused a command: its environment differs from the server's (see ``same_python``)."""


class Server:
    """The caller's side: one server per test process, started at the first command, ended with the
    process (the server reads its stdin, a pipe from here, and ends with its children at its EOF)."""

    def __init__(self, env: dict[str, str]) -> None:
        import subprocess
        import tempfile

        self.env = dict(env)
        self._dir = tempfile.mkdtemp(prefix="vt-warm-")
        self.path = os.path.join(self._dir, "socket")
        self._proc = subprocess.Popen([sys.executable, __file__, self.path], env=self.env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        if self._proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"tests/support/warm_python.py did not start (exit {self._proc.wait()})")
        self.pid = self._proc.pid

    def start(self, argv: list[str], *, module: str | None, cwd: str, env: dict[str, str],
              new_session: bool, fds: list[int]) -> tuple[socket.socket, Any, int]:
        """Fork the command's child: its connection, a reader of it (the wait status comes as a line)
        and its pid."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.path)
        request = {"argv": argv, "module": module, "cwd": cwd, "env": env, "new_session": new_session}
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], fds)
        reader = conn.makefile("rb")
        pid = json.loads(reader.readline())["pid"]
        if pid is None:
            conn.close()
            raise NotWarm(argv)
        return conn, reader, pid

    def close(self) -> None:
        import shutil

        if self._proc.poll() is None:
            self._proc.stdin.close()
            self._proc.wait(timeout=60)
        shutil.rmtree(self._dir, ignore_errors=True)


class WarmProcess:
    """What the tests use of ``subprocess.Popen`` (pid, args, returncode, stdout/stderr as text pipes,
    poll, wait, communicate, send_signal, kill, terminate), for a child of the server: not this
    process's child, so its status comes from the server instead of ``waitpid``."""

    def __init__(self, server: Server, args: list[str], argv: list[str], *, module: str | None,
                 cwd: str | None, env: dict[str, str], new_session: bool, capture: bool) -> None:
        """``args``: the command as shown; ``argv``: the child's ``sys.argv`` (a script's path first)."""
        import subprocess

        self.args, self.returncode = args, None
        ends, mine = [os.open(os.devnull, os.O_RDONLY)], []
        for target in (1, 2):
            if capture:
                r, w = os.pipe()
                ends.append(w)
                mine.append(os.fdopen(r, "r", errors="replace"))
            else:
                ends.append(os.dup(target))
        self.stdout, self.stderr = mine if capture else (None, None)
        try:
            self._conn, self._reader, self.pid = server.start(argv, module=module, cwd=cwd or os.getcwd(), env=env,
                                                              new_session=new_session, fds=ends)
        except BaseException:
            for pipe in mine:
                pipe.close()
            raise
        finally:
            for fd in ends:
                os.close(fd)
        self._out: dict[str, list[str]] = {}
        self._readers: list[threading.Thread] = []
        self._expired = subprocess.TimeoutExpired

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def _read_status(self) -> None:
        line = self._reader.readline()
        status = json.loads(line)["status"] if line else 0x09  # the server gone: as if killed
        self.returncode = os.waitstatus_to_exitcode(status)
        self._conn.close()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise self._expired(self.args, timeout)
            self._read_status()
        return self.returncode

    def communicate(self, input: None = None, timeout: float | None = None) -> tuple[str | None, str | None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._readers:
            for name, pipe in (("out", self.stdout), ("err", self.stderr)):
                if pipe is not None:
                    self._out[name] = []
                    t = threading.Thread(target=lambda p=pipe, n=name: self._out[n].append(p.read()), daemon=True)
                    t.start()
                    self._readers.append(t)
        for t in self._readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise self._expired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return tuple("".join(self._out[n]) if n in self._out else None for n in ("out", "err"))

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self) -> WarmProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        for pipe in (self.stdout, self.stderr):
            if pipe is not None:
                pipe.close()
        self.wait()


def shim(script: str) -> None:
    """``visiontrain ARGS`` typed in a shell (the docs' command blocks): the server runs the console
    ``script`` as its child on this process's stdin/stdout/stderr, and this process stands in for it,
    passing on the signals it gets and ending with its status. Without a server, or when the server
    refuses this environment, the script runs here as usual."""
    path = os.environ.get(SOCKET_ENV)
    if path:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(path)
        request = {"argv": [script, *sys.argv[1:]], "module": None, "cwd": os.getcwd(), "env": dict(os.environ),
                   "new_session": False}
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        reader = conn.makefile("rb")
        pid = json.loads(reader.readline())["pid"]
        if pid is not None:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGABRT,
                        signal.SIGUSR1, signal.SIGUSR2):
                signal.signal(sig, lambda got, _frame: os.kill(pid, got))
            line = reader.readline()
            code = os.waitstatus_to_exitcode(json.loads(line)["status"]) if line else -signal.SIGKILL
            if code < 0:
                signal.signal(-code, signal.SIG_DFL)
                os.kill(os.getpid(), -code)
            sys.exit(code)
        conn.close()
    os.execv(sys.executable, [sys.executable, script, *sys.argv[1:]])


if __name__ == "__main__":
    serve(sys.argv[1])
