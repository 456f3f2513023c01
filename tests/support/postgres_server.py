"""A throwaway PostgreSQL server for the tests of ``tune --storage postgresql://...``: a cluster made
with ``initdb`` in a temporary directory, started with ``pg_ctl`` on a free port of 127.0.0.1 (its
socket in that directory too), one database, trust authentication; stopped (``pg_ctl stop -m
immediate``, then SIGKILL to whatever of it is left) and removed when the test ends, failed or not.

PostgreSQL refuses to run as root. As root the cluster belongs to the ``postgres`` user Debian's
package makes (else ``nobody``), and every command of it runs as that user (``runuser``); its
directory is made outside pytest's temporary directory, whose parents only root may enter.
"""
from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

from s3_server import free_port

#: Where Debian puts the binaries (``initdb`` and ``pg_ctl`` are not on a plain PATH there).
PG_BIN_DIRS = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
DATABASE, SUPERUSER = "studies", "tuner"
START_S = 60


def pg_bin(name: str) -> str | None:
    """A PostgreSQL program, from PATH or Debian's directory of the newest version installed."""
    found = shutil.which(name)
    if found:
        return found
    return next((str(d / name) for d in PG_BIN_DIRS if (d / name).is_file()), None)


def missing() -> str | None:
    """Why no server can be started here (None: it can)."""
    absent = [n for n in ("initdb", "pg_ctl", "createdb") if pg_bin(n) is None]
    if absent:
        return (f"PostgreSQL is not installed ({', '.join(absent)} not found on PATH or in /usr/lib/postgresql/*/bin; "
                f"bash scripts/setup.sh test installs Debian's postgresql when run as root)")
    if os.geteuid() == 0 and server_user() is None:
        return "running as root, and neither a postgres nor a nobody user to run PostgreSQL as"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser, to run PostgreSQL as another user"
    return None


def server_user() -> pwd.struct_passwd | None:
    """The user the server runs as when the tests run as root."""
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    return None


def _as_server_user(args: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return args
    return ["runuser", "-u", server_user().pw_name, "--", *args]


def _run(args: list[str], cwd: Path, timeout: float = START_S) -> None:
    proc = subprocess.run(_as_server_user(args), cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-2000:]}")


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Yields the URL of a new, empty database (``postgresql://tuner@127.0.0.1:PORT/studies``); the
    server and its files are gone after the ``with``."""
    root = Path(tempfile.mkdtemp(prefix="visiontrain-pg-"))
    data, port = root / "data", free_port()
    if os.geteuid() == 0:
        user = server_user()
        os.chown(root, user.pw_uid, user.pw_gid)
    try:
        _run([pg_bin("initdb"), "-D", str(data), "-U", SUPERUSER, "--auth=trust", "--no-sync", "-E", "UTF8"], root)
        options = f"-c listen_addresses=127.0.0.1 -p {port} -k {root} -c fsync=off -c max_connections=50"
        try:  # a start that timed out may still have left a server running: stopped all the same
            _run([pg_bin("pg_ctl"), "-D", str(data), "-l", str(root / "server.log"), "-o", options, "-w",
                  "-t", str(START_S), "start"], root, timeout=START_S + 10)
            _run([pg_bin("createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", SUPERUSER, DATABASE], root)
            yield f"postgresql://{SUPERUSER}@127.0.0.1:{port}/{DATABASE}"
        finally:
            stop(data, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def stop(data: Path, root: Path) -> None:
    """``pg_ctl stop -m immediate``; the postmaster and its children are then killed if still there
    (a stop that failed must not leave a server behind the test)."""
    pid_file = data / "postmaster.pid"
    postmaster = int(pid_file.read_text().split()[0]) if pid_file.is_file() else None
    with contextlib.suppress(subprocess.SubprocessError, RuntimeError):
        _run([pg_bin("pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"], root, timeout=30)
    if postmaster is None or str(data) not in _cmdline(postmaster):  # stopped (or the pid is another's now)
        return
    children = _children(postmaster)
    for pid in [postmaster, *children]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(_cmdline(p) for p in [postmaster, *children]) and time.monotonic() < deadline:  # a zombie has none
        time.sleep(0.05)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (the server's backends and workers)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                    out.append(int(entry))
    return out
