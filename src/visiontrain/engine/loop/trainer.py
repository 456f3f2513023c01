"""fit(): epochs -> steps -> TrainStep, and after each step the parts that are due.

The build phase (engine.setup.training) makes the run's objects and ``engine.loop.assembly`` its parts and hooks;
this file only runs them. After every optimizer step the loop asks its parts, in order, whether
they are due (the log point, the evaluator, the checkpointer, the stop check, and whatever else the
run has). Each owns its cadence, its state and its host syncs; the step itself reads nothing on
the host (every sync is marked ``# host sync`` where it happens). The data comes from one
``TrainSource`` and the checkpoint holds the states registered in ``states``: the loop knows
neither what the data is made of nor what a checkpoint holds.
"""
from __future__ import annotations

import json
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

from visiontrain.core.config import Config, dump_config
from visiontrain.engine.loop import assembly
from visiontrain.engine.protocols.hooks import Hook
from visiontrain.engine.protocols.part import Progress
from visiontrain.engine.protocols.task import Task
from visiontrain.engine.records.run_log import RunLogger
from visiontrain.engine.setup.placement import seed_everything
from visiontrain.engine.setup.training import build_training
from visiontrain.engine.state.checkpoint import write_run_config
from visiontrain.engine.state.run_dir import hold_run_dir, resume_source
from visiontrain.engine.step.accumulation import accum_steps_at
from visiontrain.engine.step.guards import OutOfMemory, is_out_of_memory, out_of_memory_message
from visiontrain.engine.step.metrics import StepRecorder
from visiontrain.engine.step.pipeline import StepOptions, TrainStep
from visiontrain.engine.step.prefetch import device_batches, prefetches
from visiontrain.rundir.checkpoint_format import States
from visiontrain.rundir.run_files import SUMMARY_FILE

#: How the loop takes the micro-batches of one step from the batch iterator (host-side loading,
#: no device reads). ``benchmark`` passes its own to time the wait or replay a batch.
Fetch = Callable[[Iterator[Any], int], list[Any]]


def next_micro_batches(batches: Iterator[Any], accum: int) -> list[Any]:
    return [next(batches) for _ in range(accum)]


class Trainer:
    def __init__(self, cfg: Config, task: Task, run_dir: str | Path | None, *, resume: str | None = None,
                 init: str | None = None, hooks: list[Hook] = (), fetch: Fetch = next_micro_batches,
                 step_type: type[TrainStep] = TrainStep, trackers: list[Any] | None = None,
                 launch: Any = None) -> None:
        """``hooks``: added to ``trainer.hooks``'s. ``fetch`` and ``step_type`` are the seams a benchmark
        times or replaces (the batch wait, the step); a run leaves them as they are. ``trackers``:
        rank 0's (engine.records.tracking), ended by the caller when ``fit`` succeeds; None makes
        the registered backends the config asks for, and ``fit`` ends them. ``launch``: what
        provenance.json records of this launch. Hooks and trackers are checked before anything is
        built (``engine.loop.assembly.prepare``)."""
        with hold_run_dir(run_dir) as lock:  # one writer per run dir; released if set-up fails
            self.cfg, self.task, self.fetch, t = cfg, task, fetch, cfg.trainer
            self.resumed_from = resume = resume_source(run_dir, resume)  # a run in run_dir: refused, or continued
            self.prepared = assembly.prepare(cfg, run_dir, hooks=hooks, trackers=trackers, launch=launch)
            self.run = run = build_training(cfg, task, Path(run_dir) if run_dir is not None else None,
                                            resume=resume, init=init)
            self.cfg = cfg = run.cfg  # a resume on another number of processes keeps the global batch:
            t = cfg.trainer           # the batch split that keeps it
            # what hooks read (detectron2's convention: a hook holds the trainer and reads what it needs)
            self.model, self.raw_model, self.ema, self.optimizer = run.model, run.raw_model, run.ema, run.optimizer
            self.dist, self.device, self.clock, self.scalars = run.dist, run.device, run.clock, run.scalars
            self.progress = p = Progress(run.clock, t.epochs)
            self.log = RunLogger(run.run_dir, total_steps=p.total, progress=t.progress, enabled=run.writes,
                                 trackers=self.prepared.trackers)
            self.recorder = StepRecorder(t.log_every, run.device)
            self.states, self.parts = States(), {}  # what a checkpoint holds; every named part and hook
            self.nothing_to_train = False  # fit found the resumed run at its end (``_nothing_to_train``)
            parts, self.hooks = assembly.assemble(self)
            self._measure = [part for part in parts if not part.keeps]  # then the epoch moves on, then:
            self._keep = [part for part in parts if part.keeps]
            self.loss_weights = dict(task.loss_weights)
            options = StepOptions(run.device, run.precision, run.scaler, clip_grad=t.clip_grad, clip_mode=t.clip_mode,
                                  channels_last=t.channels_last, mask_nonfinite=t.nonfinite == "skip",
                                  fixed_weights=not any(k.startswith("loss.") for k in run.scalars.schedules),
                                  placed=prefetches(run.device, cfg.data.prefetch_to_device),
                                  after_backward=self.hooks.callbacks("after_backward"))
            self.step_fn = step_type(run.model, task.losses, run.optimizer, options, recorder=self.recorder,
                                     on_device=task.device_transform(channels_last=t.channels_last))
            for note in run.notes:
                self.log.print(note)
            # Set-up may draw from the global RNGs a varying amount (first-time imports do), so the
            # training streams start from a fresh seed: a run is a function of cfg.seed alone.
            seed_everything(cfg.seed + 1)
            if resume:
                self.parts["checkpointer"].resume(resume)
            if run.writes:  # after the resume checks: a refused resume leaves the run's config.yaml as it was
                write_run_config(run.run_dir, dump_config(cfg), resumed_at=p.step if resume else None)
            self._lock = lock.pop_all()  # held until fit ends (or this trainer is collected unfitted)
        weakref.finalize(self, self._lock.close)

    def __getattr__(self, name: str) -> Any:
        """Every named part and hook as an attribute: ``trainer.evaluator``, ``trainer.early_stop``..."""
        parts = self.__dict__.get("parts") or {}
        if name in parts:
            return parts[name]
        raise AttributeError(f"{type(self).__name__} has no attribute or part {name!r} (parts: {sorted(parts)})")

    step = property(lambda self: self.progress.step, doc="optimizer steps done")
    epoch = property(lambda self: self.progress.epoch, doc="the current epoch (0-based)")
    step_in_epoch = property(lambda self: self.progress.step_in_epoch, doc="optimizer steps done in this epoch")

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, Any]:
        """Train to the end and return the summary (summary.json's content on rank 0 of a run with a run
        dir). A run resumed at its last step trains nothing and rewrites nothing."""
        with self._lock:  # the run dir's lock goes however fit ends
            if self.resumed_from is not None and self.done():
                return self._nothing_to_train()
            try:
                return self._fit()
            except BaseException as err:
                self.hooks("on_exception", err)  # trackers end FAILED or KILLED, signal handlers go back
                if not (isinstance(err, Exception) and is_out_of_memory(err)):
                    raise
                phase = "evaluation" if self.progress.evaluating else "training"
                raise OutOfMemory(out_of_memory_message(err, phase=phase, run=self.run, step=self.step)) from err
            finally:
                self.run.source.close()  # persistent workers end now, not at garbage collection

    def _nothing_to_train(self) -> dict[str, Any]:
        """The checkpoint it resumed is at the run's last step, or early stopping ended it: nothing is
        trained, and nothing in the run dir is rewritten (evaluating again would append a second final
        row). Every rank takes this branch: they loaded the same step."""
        self.nothing_to_train, source, early = True, self.resumed_from, self.parts.get("early_stop")
        if early is not None and early.fired():
            self.log.print(f"{source} stopped at step {self.step}: {early.reason()}; nothing to train (raise "
                           f"eval.patience, or set it to 0, to train further)")
        else:
            self.log.print(f"{source} is at step {self.step}, this run's last: nothing to train (raise "
                           f"trainer.epochs or trainer.max_steps to train further)")
        self.log.close()
        summary = self.run.run_dir / SUMMARY_FILE if self.run.writes else None
        return json.loads(summary.read_text()) if summary is not None and summary.is_file() else {}

    def _fit(self) -> dict[str, Any]:
        p, run, t = self.progress, self.run, self.cfg.trainer
        self.hooks("before_train")
        p.start()
        for part in self._measure + self._keep:
            part.start()
        while not self.done():
            self.model.train()
            accum = accum_steps_at(t, p.epoch)
            batches = device_batches(run.source.batches(p.epoch, start_batch=p.step_in_epoch * accum), self.device,
                                     channels_last=t.channels_last, prefetch=self.cfg.data.prefetch_to_device)
            self.hooks("before_epoch")
            while not p.epoch_steps_done() and not p.finished():
                self._train_step(batches, accum)
                self._after_step(epoch_end=False)
            if not p.epoch_steps_done():
                break  # max_steps reached, or a part ended the run, mid-epoch
            self.hooks("after_epoch")
            self._after_step(epoch_end=True)
        p.trained_s = time.perf_counter() - p.started
        summary: dict[str, Any] = {}
        for part in self._measure + self._keep:  # the last evaluation, checkpoint and files
            summary.update(part.finish() or {})
        self.hooks("after_train")
        self.log.close()
        return summary

    def _train_step(self, batches: Iterator[Any], accum: int) -> None:
        if self.scalars.schedules:
            self.scalars.apply(self.step, self.loss_weights)
        self.hooks("before_step")
        t0 = time.perf_counter()
        micro = self.fetch(batches, accum)
        self.progress.data_s += time.perf_counter() - t0
        self.step_fn(micro, self.loss_weights)
        if self.ema is not None:
            self.ema.update(self.model, self.step)
        self.progress.advance()
        self.hooks("after_step")

    def _after_step(self, epoch_end: bool) -> None:
        """The parts due now, in order. At an epoch's end the epoch count moves on after the parts
        that measure it (which report the finished epoch) and before those that keep the run."""
        for part in self._measure:
            if part.due(self.step, epoch_end):
                part.run(epoch_end)
        if epoch_end:
            self.progress.next_epoch()
        for part in self._keep:
            if part.due(self.step, epoch_end):
                part.run(epoch_end)

    def done(self) -> bool:
        """Every step trained, or a part ended the run (patience ran out, also in the checkpoint a
        resume loaded)."""
        return self.progress.finished()
