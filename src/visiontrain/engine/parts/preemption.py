"""Preemption: SIGTERM / SIGUSR1 (what SLURM and most schedulers send before a kill) and Ctrl-C
(SIGINT) -> stop cleanly.

The signal handler only sets a host-side flag. A single process acts on it after the current
step; under torchrun the ranks agree at the next log point with one extra all-reduce there (a log
point is already a sync point), so no step pays a collective for it. Where the log points are is
the log point's own rule (``LogPoint.due``): the stop check asks it, so the ranks cannot disagree
on where to all-reduce. The stop check then writes ``checkpoints/last.pt`` and raises
:class:`Preempted` (in ``stop_signals``, below every room, so that the CLI and the trackers know
it); the CLI exits with ``EXIT_PREEMPTED`` (4), or ``EXIT_INTERRUPTED`` (130, the shell's 128 +
SIGINT) after a Ctrl-C, and ``--resume auto`` continues exactly. A second Ctrl-C stops at once
(KeyboardInterrupt), without a checkpoint of its own: every checkpoint already written is complete
(atomic writes).

DataLoader workers ignore these signals (``process_tree.start_worker``, their ``worker_init_fn``): a
scheduler signals every process of the job, and a worker killed by it would take the run down
before the checkpoint is written. The main process shuts the workers down itself.
"""
from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util  # noqa: F401  (registers its exit handler before ours: ours runs first)
import signal
import threading
from typing import Any, Callable

import torch

from visiontrain.core.stop_signals import STOP_SIGNALS, Preempted
from visiontrain.engine.protocols.part import Part
from visiontrain.rundir.run_files import LAST_CHECKPOINT


@atexit.register
def _kill_daemon_children() -> None:
    """At exit, multiprocessing terminates daemonic children (DataLoader workers) with SIGTERM and
    joins them; workers that ignore SIGTERM would block that join forever. Kill them first: what
    terminate() means for a daemon, with a signal they cannot ignore."""
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


class StopFlag:
    """Installs handlers for the stop signals while a run trains; ``requested`` is a plain bool."""

    def __init__(self) -> None:
        self.requested = False
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt  # a second Ctrl-C: the user wants out now, not after the step
        self.requested, self.signum = True, signum

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread (e.g. a run inside a test thread)
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def any_rank(self, device: torch.device) -> bool:
        """Whether any rank got a stop signal: an all-reduce, so every rank calls it at a log point."""
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())  # host sync (log point)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "a stop signal"


class StopCheck(Part):
    """The loop's part that acts on a stop signal: after the step it arrived in (one process), or
    at the next log point, where the ranks agree with one all-reduce (a log point already syncs).
    It writes ``last.pt`` through ``save`` and raises :class:`Preempted`. At an epoch's end it runs
    after that epoch's checkpoint; within an epoch not at its last step (the epoch's end comes next).
    As a hook it installs the signal handlers for ``fit``'s duration."""

    name, keeps = "stop", True

    def __init__(self, flag: StopFlag, progress: Any, run: Any, *, log_point: Callable[[int, bool], bool],
                 save: Callable[[], None], close: Callable[[], None]) -> None:
        """``run``: the built run (``engine.setup.training.TrainingRun``): whether it is distributed,
        its device, and where its checkpoints go, which the stop line names."""
        self.flag, self.progress, self.log_point, self.distributed = flag, progress, log_point, run.dist.enabled
        self.device, self.save, self.close = run.device, save, close
        self.where = "no run dir, nothing written" if run.ckpt_dir is None \
            else f"{run.ckpt_dir / LAST_CHECKPOINT} written; continue with --resume auto"

    @classmethod
    def for_run(cls, trainer: Any) -> "StopCheck":
        parts = trainer.parts
        return cls(StopFlag(), trainer.progress, trainer.run, log_point=parts["log_point"].due,
                   save=parts["checkpointer"].save_last, close=trainer.log.close)

    def before_train(self) -> None:
        self.flag.install()  # SIGTERM / SIGUSR1 while fit() runs: checkpoint, then Preempted

    def after_train(self) -> None:
        self.flag.restore()

    def on_exception(self, err: BaseException) -> None:
        self.flag.restore()

    def due(self, step: int, epoch_end: bool) -> bool:
        """Host-only: under torchrun every log point (where ``run`` agrees), else a signal that arrived.
        Never at an epoch's last step before its end, nor at the end of the run's last epoch."""
        p = self.progress
        if not (p.step < p.total if epoch_end else not p.epoch_steps_done()):
            return False
        return self.log_point(step, epoch_end) if self.distributed else self.flag.requested

    def run(self, epoch_end: bool = False) -> None:
        if self.distributed and not self.flag.any_rank(self.device):  # host sync (log point): the ranks agree
            return
        self.save()  # every rank: it reads the metric rows (a collective); rank 0 writes
        p = self.progress
        self.close()  # the CLI prints the one line that says where the run stopped
        raise Preempted(f"stopped by {self.flag.name} at step {p.step} (epoch {p.epoch}); {self.where}",
                        self.flag.signum)
