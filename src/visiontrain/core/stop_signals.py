"""The signals that stop a run, and the DataLoader workers' deafness to them.

Below every room on purpose: the data room starts the workers (``data.worker_preload`` hands the
function to a forkserver) and the engine acts on the signals (``engine.parts.preemption``); both reach it.
"""
from __future__ import annotations

import signal

from visiontrain.core.exit_codes import EXIT_INTERRUPTED, EXIT_PREEMPTED

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def ignore_stop_signals(_worker_id: int = 0) -> None:
    """DataLoader ``worker_init_fn``: leave stopping to the main process. A scheduler signals every
    process of the job, and a worker killed by it would take the run down before the checkpoint is
    written. (A worker still exits when its loader shuts it down, and with its parent, however that
    one dies: ``visiontrain.core.process_tree.start_worker``, which calls this.)"""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class Preempted(Exception):
    """Raised after last.pt was written because a stop signal arrived (``engine.parts.preemption``);
    the CLI exits with its ``exit_code``, and a tracker marks the run killed."""

    def __init__(self, message: str, signum: int | None = None) -> None:
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return EXIT_INTERRUPTED if self.signum == signal.SIGINT else EXIT_PREEMPTED
