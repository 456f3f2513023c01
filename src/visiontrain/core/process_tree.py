"""Every process of a run ends with the process that started it, however that one died.

A run is a tree of processes: torchrun's agent (``fit --nproc N``) starts the ranks, each training
process starts a forkserver (``data.worker_start=forkserver``) and the forkserver, or the training
process itself (``fork``, ``spawn``), starts the DataLoader workers. When a parent ends normally it
shuts its children down. When it is killed with SIGKILL (the OOM killer, ``kill -9``), nothing runs
in it, and its children are told nothing: torch's elastic agent starts each rank in a session of its
own, the forkserver waits on a pipe its own children keep open, and the workers ignore the stop
signals (``stop_signals``). They would go on training, writing the run dir and holding memory for
hours.

So each of them asks the kernel to kill it when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``):
the forkserver and the ranks as they start, each worker in its ``worker_init_fn``. The deaths run
down the tree, each in milliseconds. The signal goes when the *thread* that started the child
ends; the training process starts its forkserver and workers from its main thread, and torchrun's
agent its ranks from its own. Elsewhere than Linux a thread of the child polls its parent instead.
And when a process of the tree ends normally, it ends without the interpreter's last full garbage
collections (``skip_final_collection``), which would take seconds.
Below every room, like ``stop_signals``: the data room (workers, forkserver) and the CLI (ranks)
reach it.
"""
from __future__ import annotations

import atexit
import ctypes
import gc
import os
import signal
import sys
import threading
import time

from visiontrain.core.stop_signals import ignore_stop_signals

#: prctl option: the signal this process gets when its parent (thread) dies (linux/prctl.h).
PR_SET_PDEATHSIG = 1
#: How often a child polls its parent where the kernel cannot be asked (not Linux).
POLL_SECONDS = 0.5
#: Set by ``fit --nproc N`` before it becomes torchrun's agent (same pid): the parent its ranks expect.
LAUNCHER_PID_ENV = "VISIONTRAIN_LAUNCHER_PID"
#: The process that starts DataLoader workers: the training process sets it to its pid before it
#: starts a forkserver or a worker, and the forkserver to its own for the workers it forks. Each
#: checks that this parent is still alive when it asks to end with it.
WORKER_PARENT_ENV = "VISIONTRAIN_WORKER_PARENT_PID"

_final_collection_skipped = False


def end_with_parent(expected_parent: int | None = None) -> None:
    """Die by SIGKILL when the parent process dies. ``expected_parent``: the parent this process was
    started by, when known; if it is already gone (it died between starting this process and this
    call), this process ends at once, as it would have a moment later."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            _poll_parent_in_thread()
    else:
        _poll_parent_in_thread()
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), signal.SIGKILL)


def _poll_parent_in_thread() -> None:
    """The fallback: a daemon thread that kills this process once its parent pid changes (the
    orphan is adopted by init or a subreaper)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_SECONDS)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="visiontrain-parent-watch", daemon=True).start()


def skip_final_collection() -> None:
    """In a process visiontrain owns (a command's, a rank, the forkserver): at exit, leave out the
    interpreter's last full garbage collections. They walk every object still alive, over a million
    once torch and dynamo are imported: 1.5-2.0 s from a ``fit`` returning to its process ending,
    0.24-0.36 s without them (digits, 2-core AMD EPYC); torchrun's agent waits that long for each
    rank, and a user for every command. ``gc.freeze`` at exit moves those objects out of the
    collector's reach; they are still freed as the modules are torn down. What is skipped are the
    finalizers of reference cycles still alive at exit, which Python does not promise to run, and
    every file a run writes is closed (and fsync'ed) before. Not for a process that only imports
    visiontrain: its owner's cycles are its own."""
    global _final_collection_skipped
    if not _final_collection_skipped:
        _final_collection_skipped = True
        atexit.register(gc.freeze)  # atexit runs last-registered first: those registered later still run before


def start_worker(_worker_id: int = 0) -> None:
    """DataLoader ``worker_init_fn``: leave stopping to the training process (``ignore_stop_signals``)
    and end with the parent (the forkserver, or the training process for ``fork`` and ``spawn``)."""
    ignore_stop_signals()
    end_with_parent(expected_pid(WORKER_PARENT_ENV))


def expected_pid(env_name: str) -> int | None:
    """The pid a parent left in ``env_name`` for its children to check, if any."""
    value = os.environ.get(env_name, "")
    return int(value) if value.isdigit() else None
