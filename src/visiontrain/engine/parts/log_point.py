"""The log point: the loop's one per-window host sync.

Every ``trainer.log_every`` steps (and at the run's last step) the recorded rows of the window are
read from the device in one transfer, checked against the non-finite policy, and logged as means
with the lr, throughput, data-wait share and ETA. At an epoch's end the rows since the last log
point are read too, and the epoch's means printed as a table. The evaluator and the checkpointer
call :meth:`LogPoint.check_finite` first, so nothing is evaluated or saved after a bad step.

The data-wait share (the window's seconds spent waiting for the loader over its length) is on each
line, and over all the run's logged windows in summary.json (``data_wait_share``). The first window
whose share is above ``INPUT_BOUND`` adds one line (once a launch) saying which setting to raise; a
launch's first window never does, its workers' start-up and first batch inflate it.

``LogPoint.due`` is the one statement of "is this a log point": the stop check asks it too, to
know where the ranks agree on a stop signal.
"""
from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable

import torch

from visiontrain.engine.parallel.distributed import all_reduce_mean
from visiontrain.engine.protocols.cadence import Cadence
from visiontrain.engine.protocols.part import Part, Progress
from visiontrain.engine.records.run_log import INPUT_BOUND, RunLogger, input_bound_hint
from visiontrain.engine.setup.training import TrainingRun
from visiontrain.engine.step.accumulation import samples_per_step
from visiontrain.engine.step.guards import check_rows
from visiontrain.engine.step.metrics import EpochMeans, PendingRows, StepRecorder
from visiontrain.engine.step.trainer_config import TrainerConfig
from visiontrain.rundir.metrics_file import COMPUTE_S, DATA_S, SAMPLES_PER_S, TRAIN


class LogPoint(Part):
    name = "log_point"

    def __init__(self, settings: TrainerConfig, run: TrainingRun, progress: Progress, recorder: StepRecorder,
                 log: RunLogger, *, samples_at: Callable[[int], int], workers: Any = "?") -> None:
        """``samples_at(epoch)``: the samples one optimizer step trains on in that epoch, over every
        process (``samples_per_step``), for the throughput. ``workers``: data.num_workers as the run
        resolved it (named by the input-bound hint)."""
        self.settings, self.progress, self.recorder, self.scalars = settings, progress, recorder, run.scalars
        self.samples_at = samples_at
        self.ckpt_dir = run.ckpt_dir  # named in a non-finite error: what the run can go back to
        self.optimizer, self.log, self.dist, self.device = run.optimizer, log, run.dist, run.device
        self.fp16 = run.scaler is not None
        # every trainer.log_every steps and the last; each epoch's end too
        self.cadence = Cadence(settings.log_every, "steps", at_end=True)
        self.pending = PendingRows()  # rows read from the device, not yet logged
        self.epoch_means = EpochMeans()
        self.skipped = self.overflow_skipped = 0
        self.samples_seen = 0  # in this process (for throughput), counted at log points
        self.workers = workers
        # seconds waiting for data, and in all, of the logged windows: over the run, resumes included
        self.wait_s = self.logged_s = 0.0
        self.start()

    @classmethod
    def for_run(cls, trainer: Any) -> "LogPoint":
        run = trainer.run
        return cls(trainer.cfg.trainer, run, trainer.progress, trainer.recorder, trainer.log,
                   samples_at=lambda epoch: samples_per_step(trainer.cfg, run.dist.world_size, epoch),
                   workers=getattr(trainer.cfg.data, "num_workers", "?"))  # auto: resolved at the run's start

    def start(self) -> None:
        """At the start of fit: the throughput window and the ETA count from here."""
        self.t_window = self.t_start = time.perf_counter()
        self.start_step, self.progress.data_s = self.progress.step, 0.0
        # this launch's windows: its first (workers starting, the first batch) says nothing about the input
        self.windows, self.hinted = 0, False

    def due(self, step: int, epoch_end: bool) -> bool:
        return epoch_end or self.cadence.due(self.progress, epoch_end)

    def run(self, epoch_end: bool = False) -> None:
        if not epoch_end or self.recorder.n or self.pending:  # at an epoch's end: its steps since the last one
            self.write()
        summary = self.epoch_means.pop() if epoch_end else None
        if summary:
            self.log.table(f"epoch {self.progress.epoch} train", summary)

    def check_finite(self) -> None:
        """Read the recorded steps and act on the non-finite policy. Runs before every log point,
        evaluation and checkpoint, so `raise` fires at most log_every steps after the bad step."""
        read = self.recorder.read(reduce=partial(all_reduce_mean, info=self.dist))  # host sync
        first = self.progress.step - len(read.rows) + 1
        skipped, overflow = check_rows(read, first, policy=self.settings.nonfinite, fp16=self.fp16,
                                       epoch_of=self.progress.clock.epoch_of, ckpt_dir=self.ckpt_dir)
        self.skipped, self.overflow_skipped = self.skipped + skipped, self.overflow_skipped + overflow
        self.pending.add(read)

    def write(self) -> None:
        p, now = self.progress, time.perf_counter()
        window_s, data_s, elapsed = now - self.t_window, p.data_s, now - self.t_start
        self.t_window, p.data_s = now, 0.0
        self.check_finite()  # host sync: moves the recorded rows to self.pending
        n, values = self.pending.pop_means()
        if not n:
            return
        self.epoch_means.add(values, n)
        samples = n * self.samples_at(p.epoch)
        self.samples_seen += samples
        values.update(self.scalars.logged(self.optimizer))
        values["skipped_steps"], values["fp16_overflow_skips"] = self.skipped, self.overflow_skipped
        values[SAMPLES_PER_S] = samples / max(window_s, 1e-9)
        values[DATA_S], values[COMPUTE_S] = data_s, window_s - data_s
        values["eta_s"] = elapsed / max(p.step - self.start_step, 1) * (p.total - p.step)
        if self.device.type == "cuda":
            values["gpu_peak_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.log.log(TRAIN, p.step, p.epoch, values)
        self.wait_s, self.logged_s = self.wait_s + data_s, self.logged_s + window_s
        self.windows += 1
        if self.windows > 1 and not self.hinted and data_s > INPUT_BOUND * window_s:
            self.hinted = True
            self.log.print(input_bound_hint(data_s / window_s, self.workers))

    def data_wait_share(self) -> float | None:
        """The share of the logged windows' time spent waiting for data, over the run (None before
        the first)."""
        return round(self.wait_s / self.logged_s, 4) if self.logged_s > 0 else None

    def summary(self) -> dict[str, Any]:
        """This launch's throughput in this process, the steps skipped over the run (a non-finite loss,
        an fp16 overflow) and the run's share of time waiting for data."""
        return {SAMPLES_PER_S: self.samples_seen / max(self.trainer.progress.trained_s, 1e-9),
                "skipped_steps": self.skipped, "fp16_overflow_skips": self.overflow_skipped,
                "data_wait_share": self.data_wait_share()}

    def state_dict(self) -> dict[str, Any]:
        return {"pending": self.pending.state_dict(), "epoch": self.epoch_means.state_dict(),
                "skipped": self.skipped, "overflow_skipped": self.overflow_skipped,
                "wait_s": self.wait_s, "logged_s": self.logged_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending.load_state_dict(state["pending"])
        self.epoch_means.load_state_dict(state["epoch"])
        self.skipped, self.overflow_skipped = int(state["skipped"]), int(state["overflow_skipped"])
        # a checkpoint from before these were kept: the share counts the windows logged since the resume
        self.wait_s, self.logged_s = float(state.get("wait_s", 0.0)), float(state.get("logged_s", 0.0))
