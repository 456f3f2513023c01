"""fit(): epochs -> steps -> TrainStep, and after each step the parts that are due.

The build phase (engine.run) makes the run's objects; this file only runs them. After every
optimizer step the loop asks its parts, in order, whether they are due: the log point (the one
per-window host sync: metrics and the non-finite check), the evaluator, the checkpointer and the
stop check. Each owns its cadence, its state and its host syncs; the step itself reads nothing on
the host (every sync is marked ``# host sync`` where it happens).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterator

from visiontrain.config import Config, config_to_dict, dump_config
from visiontrain.engine import build
from visiontrain.engine.checkpoint import load_checkpoint, write_run_config
from visiontrain.engine.checkpointer import Checkpointer
from visiontrain.engine.early_stop import EarlyStopping, end_reason
from visiontrain.engine.first_look import first_look
from visiontrain.engine.evaluator import Evaluator
from visiontrain.engine.guards import OutOfMemory, is_out_of_memory, out_of_memory_message
from visiontrain.engine.hooks import Hook, HookList
from visiontrain.engine.log_point import LogPoint
from visiontrain.engine.logging import RunLogger
from visiontrain.engine.metrics import StepRecorder
from visiontrain.engine.parts import Progress
from visiontrain.engine.plots import PlotHook
from visiontrain.engine.preemption import StopCheck, StopFlag
from visiontrain.engine.prefetch import device_batches, prefetches
from visiontrain.engine.profiling import profiler_hooks
from visiontrain.engine.provenance import Launch
from visiontrain.engine.run import build_training
from visiontrain.engine.step import TrainStep
from visiontrain.engine.task import Task
from visiontrain.engine.tracking import FINISHED, Tracker, end_trackers, make_trackers, start_tracking, status_of

#: How the loop takes the micro-batches of one step from the batch iterator (host-side loading,
#: no device reads). ``benchmark`` passes its own to time the wait or replay a batch.
Fetch = Callable[[Iterator[Any], int], list[Any]]


def next_micro_batches(batches: Iterator[Any], accum: int) -> list[Any]:
    return [next(batches) for _ in range(accum)]


class Trainer:
    def __init__(self, cfg: Config, task: Task, run_dir: str | Path | None, *, resume: str | None = None,
                 init: str | None = None, hooks: list[Hook] = (), fetch: Fetch = next_micro_batches,
                 step_type: type[TrainStep] = TrainStep, trackers: list[Tracker] | None = None,
                 launch: Launch | None = None) -> None:
        """``fetch`` and ``step_type`` are the seams a benchmark times or replaces (the batch wait, the
        step); a run leaves them as they are. ``trackers``: rank 0's (engine.tracking), ended by the
        caller when ``fit`` succeeds; None makes them from ``cfg.logging`` (checked before anything is
        built) and ``fit`` ends them. ``launch``: what provenance.json records of this launch."""
        self.cfg, self.task, self.fetch, t = cfg, task, fetch, cfg.trainer
        self.launch, self.resumed_from, self._ends_trackers = launch or Launch(), resume, trackers is None
        self.trackers = trackers = make_trackers(cfg, run_dir, self.launch.recipe) if trackers is None else trackers
        self.run = run = build_training(cfg, task, Path(run_dir) if run_dir is not None else None,
                                        resume=resume is not None, init=init)
        # what hooks read (detectron2's convention: a hook holds the trainer and reads what it needs)
        self.model, self.raw_model, self.ema, self.optimizer = run.model, run.raw_model, run.ema, run.optimizer
        self.dist, self.device, self.clock, self.scalars = run.dist, run.device, run.clock, run.scalars
        self.progress = p = Progress(run.clock, t.epochs)
        self.log = RunLogger(run.run_dir, total_steps=p.total, progress=t.progress, enabled=run.writes,
                             trackers=trackers)
        plots = [PlotHook(run.run_dir)] if run.writes and t.plots else []
        profile = profiler_hooks(t.profile, t.profile_start, t.profile_steps, run.run_dir, run.writes)
        self.hooks = HookList([*task.hooks(), *hooks, *self.log.hooks(), *plots, *profile], self)
        self.loss_weights = dict(task.loss_weights)
        recorder = StepRecorder(t.log_every, run.device)
        self.step_fn = step_type(run.model, task.losses, run.optimizer, device=run.device, precision=t.precision,
                                 scaler=run.scaler, clip_grad=t.clip_grad, clip_mode=t.clip_mode,
                                 channels_last=t.channels_last, after_backward=self.hooks.callbacks("after_backward"),
                                 recorder=recorder, mask_nonfinite=t.nonfinite == "skip",
                                 on_device=task.device_transform(),
                                 fixed_weights=not any(k.startswith("loss.") for k in run.scalars.schedules),
                                 placed=prefetches(run.device, cfg.data.prefetch_to_device))
        self.log_point = LogPoint(cfg, p, recorder, run.scalars, run.optimizer, self.log, run.dist, run.device,
                                  fp16=run.scaler is not None, ckpt_dir=run.ckpt_dir)
        metric, mode = cfg.eval.metric or task.metric, cfg.eval.mode or task.mode
        self.early_stop = EarlyStopping.for_run(cfg.eval, metric, mode, run)
        self.checkpointer = Checkpointer(run, p, self.log_point, self.log, self.early_stop, metric=metric, mode=mode)
        self.evaluator = Evaluator(cfg, run, p, self.log, check_finite=self.log_point.check_finite,
                                   after_eval=self._after_eval, sharded=run.sharded is not None)
        self.stop_flag = StopFlag()  # SIGTERM / SIGUSR1 while fit() runs: checkpoint, then Preempted
        self.stop = StopCheck(self.stop_flag, p, log_every=t.log_every, distributed=run.dist.enabled,
                              device=run.device, save=self.checkpointer.save_last, where=self._where,
                              close=self.log.close)
        for note in run.notes:
            self.log.print(note)
        # Set-up may draw from the global RNGs a varying amount (first-time imports do), so the
        # training streams start from a fresh seed: a run is a function of cfg.seed alone.
        build.seed_everything(cfg.seed + 1)
        if resume:
            self.checkpointer.resume(load_checkpoint(resume, resolve_sharded=False), resume)
        if run.writes:  # after the resume checks: a refused resume leaves the run's config.yaml as it was
            write_run_config(run.run_dir, dump_config(cfg), resumed_at=p.step if resume else None)

    step = property(lambda self: self.progress.step, doc="optimizer steps done")
    epoch = property(lambda self: self.progress.epoch, doc="the current epoch (0-based)")
    step_in_epoch = property(lambda self: self.progress.step_in_epoch, doc="optimizer steps done in this epoch")

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, Any]:
        self.stop_flag.install()
        try:
            if self.run.writes:  # this launch in provenance.json, and the trackers started with it
                start_tracking(self.trackers, self.run.run_dir, self.launch, config_to_dict(self.cfg), step=self.step,
                               resumed_from=self.resumed_from, world_size=self.dist.world_size)
            summary = self._fit()
        except BaseException as err:
            end_trackers(self.trackers, status_of(err))  # FAILED, or KILLED by a stop signal
            if not (isinstance(err, Exception) and is_out_of_memory(err)):
                raise
            last = self.run.ckpt_dir / "last.pt" if self.run.ckpt_dir is not None else None
            phase = "evaluation" if self.evaluator.running else "training"
            raise OutOfMemory(out_of_memory_message(err, phase=phase, cfg=self.cfg, device=self.device, step=self.step,
                                                    last_checkpoint=str(last) if last and last.is_file() else None)
                              ) from err
        finally:
            self.stop_flag.restore()
            build.stop_workers(self.run.train_loader)  # persistent workers end now, not at garbage collection
        if self._ends_trackers:
            end_trackers(self.trackers, FINISHED)
        return summary

    def _fit(self) -> dict[str, Any]:
        p, run, t = self.progress, self.run, self.cfg.trainer
        self.hooks("before_train")
        if p.step == 0:  # a fresh run: its first batch drawn, the model's size logged
            first_look(run, self.task, self.log, plots=t.plots, summary=t.summary)
        p.started = time.perf_counter()
        self.log_point.start()
        if self.evaluator.due_at_start():
            self.evaluator.run()
        while not self.done():
            self.model.train()
            accum = build.accum_steps_at(t, p.epoch)
            run.sampler.set_epoch(p.epoch, start_batch=p.step_in_epoch * accum)
            batches = device_batches(iter(run.train_loader), self.device, channels_last=t.channels_last,
                                     prefetch=self.cfg.data.prefetch_to_device)
            self.hooks("before_epoch")
            while not p.epoch_steps_done() and p.step < p.total and not self.early_stop.fired():
                self._train_step(batches, accum)
                self._after_step(epoch_end=False)
            if not p.epoch_steps_done():
                break  # max_steps reached, or patience ran out, mid-epoch
            self.hooks("after_epoch")
            self._after_step(epoch_end=True)
        return self._finish(time.perf_counter() - p.started)

    def _train_step(self, batches: Iterator[Any], accum: int) -> None:
        if self.scalars.schedules:
            self.scalars.apply(self.step, self.loss_weights)
        self.hooks("before_step")
        t0 = time.perf_counter()
        micro = self.fetch(batches, accum)
        self.log_point.data_s += time.perf_counter() - t0
        self.step_fn(micro, self.loss_weights)
        if self.ema is not None:
            self.ema.update(self.model, self.step)
        self.progress.advance()
        self.hooks("after_step")

    def _after_step(self, epoch_end: bool) -> None:
        """The parts due now, in order. At an epoch's end the epoch count moves on after the log
        point and evaluation (which report the finished epoch) and before the checkpoint."""
        for part in (self.log_point, self.evaluator):
            if part.due(self.step, epoch_end):
                part.run(epoch_end)
        if epoch_end:
            self.progress.next_epoch()
        for part in (self.checkpointer, self.stop):
            if part.due(self.step, epoch_end):
                part.run(epoch_end)

    def done(self) -> bool:
        """Every step trained, or patience ran out (also in the checkpoint a resume loaded)."""
        return self.progress.finished() or self.early_stop.fired()

    def _after_eval(self, metrics: dict[str, Any]) -> None:
        self.hooks("after_eval", metrics)
        self.checkpointer.keep_best(metrics)
        if self.early_stop.update(metrics, self.step):
            self.log.print(f"stopping: {self.early_stop.reason()}")

    def _where(self) -> str:
        ckpt = self.run.ckpt_dir
        return f"{ckpt / 'last.pt'} written; continue with --resume auto" if ckpt else "no run dir, nothing written"

    def _finish(self, wall_s: float) -> dict[str, Any]:
        if self.evaluator.due_at_end():
            self.evaluator.run()
        summary = self.checkpointer.finish(self.evaluator.last, wall_s,
                                             end_reason(self.progress, self.cfg.trainer.max_steps, self.early_stop))
        self.hooks("after_train")
        self.log.close()
        return summary
