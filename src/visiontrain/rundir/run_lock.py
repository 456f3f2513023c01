"""One writer per run dir: the training process of rank 0 holds RUN_DIR/.lock for the whole run.

Two trainings writing one run dir (a requeued job started while the old one still runs, the same
command typed in two terminals) would interleave their metrics rows and overwrite each other's
checkpoints. The lock is an ``flock`` on the file, so the kernel releases it when its holder dies,
however it dies: a lock is never stale while it is held, and a file left by a holder that was
killed is taken over, with a line saying whose it was. The file says who holds it (host, pid, start
time) for the refusal to name. A run that ends normally removes it.

On a network file system ``flock`` is only as good as the file system's locking: NFS (v4, or v3
with its lock manager) locks across machines; file systems mounted without lock support refuse it
(a warning says so and the run goes on without the guarantee), and a few keep locks local to one
machine (then only trainings on the same machine are kept apart).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Iterator

from visiontrain.core.config import ConfigError
from visiontrain.rundir.run_files import CHECKPOINTS_DIR, LOCK_FILE

#: Errors of a file system that cannot lock (no lock manager, a FUSE mount without locking).
NO_LOCKING = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


class RunDirBusy(ConfigError):
    """Another live training holds the run dir's lock."""


def _holder_text(raw: str) -> str:
    """'pid P on host H, started T' from the lock file's contents (whatever a holder wrote)."""
    try:
        who = json.loads(raw)
        return f"pid {who['pid']} on host {who['host']}, started {who['started']}"
    except (ValueError, KeyError, TypeError):
        return "a holder that left no name in it" if not raw.strip() else f"a holder that wrote {raw.strip()[:80]!r}"


class RunLock:
    """The lock of one run dir, held from ``acquire`` to ``release``. ``notes`` are the lines to print
    (a lock taken over from a dead holder, or a file system that cannot lock)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.path = run_dir, run_dir / LOCK_FILE
        self.fd: int | None = None
        self.created: list[Path] = []  # directories the lock made, removed again if left empty
        self.notes: list[str] = []

    def acquire(self) -> "RunLock":
        """Take the lock, or raise RunDirBusy naming its holder. A run dir that cannot be written is
        left unlocked: the run's own check of it (``prepare_run_dir``) says why, before any training."""
        try:
            self._create_run_dir()
            fd = self._lock_file()
        except OSError:
            return self
        if fd is None:  # the file system cannot lock
            return self
        previous = os.pread(fd, 4096, 0).decode("utf-8", errors="replace")
        if previous.strip():
            self.notes.append(f"took over {self.path}, left by {_holder_text(previous)}, which is no longer running")
        who = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(who).encode(), 0)
        self.fd = fd
        return self

    def _create_run_dir(self) -> None:
        missing = self.run_dir.absolute()
        while not missing.exists():
            self.created.append(missing)
            missing = missing.parent
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def _lock_file(self) -> int | None:
        """An open, locked descriptor of the lock file (None where locks are not supported)."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in (errno.EWOULDBLOCK, errno.EACCES):
                    raise RunDirBusy(busy_message(self.path)) from None
                if err.errno not in NO_LOCKING:
                    raise
                self.notes.append(f"warning: {self.path} cannot be locked on this file system "
                                  f"({os.strerror(err.errno)}): nothing stops a second training in this run dir")
                return None
            if _same_file(fd, self.path):
                return fd
            os.close(fd)  # the holder that just released it removed the file: lock the new one

    def release(self) -> None:
        """Remove the file, then unlock: the next training finds no holder to take over from. The
        directories the lock created go too if nothing else was written in them (a refused start)."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                if _same_file(self.fd, self.path):
                    self.path.unlink()
            os.close(self.fd)
            self.fd = None
        for directory in [*(d / CHECKPOINTS_DIR for d in self.created[:1]), *self.created]:  # deepest first
            with contextlib.suppress(OSError):
                directory.rmdir()


def _same_file(fd: int, path: Path) -> bool:
    with contextlib.suppress(FileNotFoundError):
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    return False


def busy_message(path: Path) -> str:
    try:
        holder = _holder_text(path.read_text(errors="replace"))
    except OSError:
        holder = "another process"
    return (f"run dir {path.parent} is in use by another training ({holder}; lock {path}): two trainings must "
            f"not write one run dir; wait for it to end or stop it, or choose another --run-dir (nothing was "
            f"changed)")


def check_free(run_dir: Path) -> None:
    """Raise RunDirBusy if a live training holds the run dir, without taking its lock or changing
    anything (``fit --nproc`` asks before it starts torchrun; its rank 0 then takes the lock)."""
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EACCES):
            raise RunDirBusy(busy_message(run_dir / LOCK_FILE)) from None
    finally:
        os.close(fd)


#: The locks this process holds, by run dir: ``held`` inside ``held`` of one run dir (the CLI's
#: around the whole command, the Trainer's around its own life) is the one lock, not a second
#: ``flock``, which the first would refuse.
_HELD: dict[str, RunLock] = {}


@contextlib.contextmanager
def held(run_dir: Path, enabled: bool = True) -> Iterator[RunLock]:
    """The run dir's lock around a training (rank 0 only: ``enabled``; elsewhere a lock that holds
    nothing). Re-entrant within a process: an inner ``held`` of a run dir this process already
    holds yields that lock (with no notes) and leaves it held."""
    key = os.path.abspath(run_dir)
    if enabled and key in _HELD:
        yield RunLock(run_dir)
        return
    lock = RunLock(run_dir).acquire() if enabled else RunLock(run_dir)
    if lock.fd is not None:
        _HELD[key] = lock
    try:
        yield lock
    finally:
        if _HELD.get(key) is lock:
            del _HELD[key]
        lock.release()
