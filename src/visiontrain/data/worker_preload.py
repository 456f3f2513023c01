"""Imported by the forkserver that DataLoader workers fork from (``data.worker_start=forkserver``),
and first thing by a spawned worker (``data.worker_start=spawn``), whose process class is here.

Everything a worker needs to unpickle its dataset and collate function is imported here once, in
the server, so each forked worker starts with it: torchvision (after the CPU-torch compatibility
step that must precede it), the datasets, readers and transforms. Models are left out: a worker
never builds one.

The server also ignores the stop signals, as the workers do: a scheduler signals the whole job,
and stopping is the training process's decision (it finishes the step, writes last.pt and exits).
The server ends with the training process however that one ends, SIGKILL included
(``visiontrain.core.process_tree``), and its workers with it.
"""
import multiprocessing.context
import os
import sys
from multiprocessing import forkserver


def _in_forkserver() -> bool:
    """Whether this import runs inside multiprocessing's forkserver start-up (its preloading)."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


from visiontrain.core.process_tree import (WORKER_PARENT_ENV, end_with_parent, expected_pid,  # noqa: E402
                                           skip_final_collection)

# The forkserver, or a spawned worker (multiprocessing marks a spawned child ``_inheriting`` while it
# unpickles its process object, which imports this module): end with the parent from now on, before
# the imports below, which take seconds. (The training process imports this module too.)
if _in_forkserver() or getattr(multiprocessing.current_process(), "_inheriting", False):
    end_with_parent(expected_pid(WORKER_PARENT_ENV))
    if _in_forkserver():
        os.environ[WORKER_PARENT_ENV] = str(os.getpid())  # the parent its forked workers check
        skip_final_collection()  # it exits when the training process does (its workers use os._exit)

from visiontrain.core._tv_compat import ensure_torchvision  # noqa: E402

ensure_torchvision()

import torch  # noqa: E402,F401
import torchvision.transforms.v2  # noqa: E402,F401

import visiontrain.data.datasets  # noqa: E402,F401
import visiontrain.data.detection  # noqa: E402,F401
import visiontrain.data.samplers  # noqa: E402,F401
from visiontrain.core.stop_signals import ignore_stop_signals  # noqa: E402

if _in_forkserver():
    ignore_stop_signals()


class SpawnedWorker(multiprocessing.context.SpawnProcess):
    """A spawned DataLoader worker that ends as a forked one does: ``os._exit`` once its work and
    multiprocessing's own clean-up are done. A spawned process otherwise finalises the interpreter,
    which stops daemon threads wherever they stand; the queue's feeder thread, still pickling the last
    prefetched batch into shared memory when the loader is stopped (in torch's C++, THPStorage_shareFd),
    is unwound through that frame and the worker aborts ("terminate called without an active
    exception"): the loader then raises "DataLoader worker ... is killed by signal: Aborted" at the
    end of a run that stopped mid-epoch. Unpickling this class also imports this module, so the
    compatibility step above runs before the dataset's torchvision transforms are unpickled."""

    def _bootstrap(self, parent_sentinel: int | None = None) -> int:  # what popen_fork runs, then os._exit
        code = super()._bootstrap(parent_sentinel)
        os._exit(code)


class SpawnContext(multiprocessing.context.SpawnContext):
    """``multiprocessing.get_context("spawn")`` with :class:`SpawnedWorker` processes."""

    Process = SpawnedWorker
