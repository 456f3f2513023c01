"""fit(): epochs -> steps -> TrainStep; log points, evaluation, checkpoints, exact resume.

Host-device syncs happen only at: log points (metrics + non-finite check), evaluation, checkpoint
writes, and the end of the run. Every one is marked ``# host sync``.
"""
from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from visiontrain.config import Config, config_to_dict, dump_config
from visiontrain.engine import build
from visiontrain.engine.checkpoint import (BestTracker, ReplicatedWeights, atomic_save, capture_rng,
                                           load_checkpoint, prepare_run_dir, restore_rng, write_run_config,
                                           write_run_file)
from visiontrain.engine.distributed import DistInfo, all_reduce_mean, broadcast_object, convert_sync_bn, init_distributed
from visiontrain.engine.ema import ModelEma
from visiontrain.engine.fsdp import full_state_dict, sync_buffers
from visiontrain.engine.hooks import Hook, HookList
from visiontrain.engine.logging import RunLogger, dumps_json
from visiontrain.engine.metrics import EpochMeans, PendingRows, StepRecorder
from visiontrain.engine.param_groups import build_optimizer, build_param_groups, check_coverage, freeze_parameters
from visiontrain.engine.precision import make_scaler
from visiontrain.engine.prefetch import device_batches
from visiontrain.engine.preemption import Preempted, StopFlag
from visiontrain.engine.plots import PlotHook
from visiontrain.engine.profiling import profiler_hooks
from visiontrain.engine.schedules import scale_lr_by_batch
from visiontrain.engine.guards import OutOfMemory, check_rows, check_weights, is_out_of_memory, out_of_memory_message
from visiontrain.engine.step import TrainStep
from visiontrain.engine.weights import load_init_weights, save_safetensors
from visiontrain.tasks.base import Task

CHECKPOINT_FORMAT = 1


class Trainer:
    def __init__(self, cfg: Config, task: Task, run_dir: str | Path | None, *,
                 resume: str | None = None, init: str | None = None, hooks: list[Hook] = ()) -> None:
        self.cfg, self.task, t = cfg, task, cfg.trainer
        if t.threads:
            torch.set_num_threads(t.threads)
        self.dist: DistInfo = init_distributed("cuda" if t.device.startswith("cuda") or
                                               (t.device == "auto" and torch.cuda.is_available()) else "cpu")
        self.device = build.pick_device(t.device, self.dist)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.ckpt_dir = self.run_dir / "checkpoints" if self.run_dir else None
        writes = self.dist.is_main and self.run_dir is not None
        stale = prepare_run_dir(self.run_dir) if writes else []
        build.seed_everything(cfg.seed)

        data = task.build_data()
        self.sampler, self.train_loader, self.val_loader = build.loaders(data, cfg, self.dist, self.device)
        self.data_info = data.info  # saved in checkpoints: predict rebuilds the model from it
        model = task.build_model(data.info)
        # a fresh run starts from the task's pretrained parts, then --init; a resumed one from its checkpoint
        self.init_reports = [] if resume else [r for r in (task.init_weights(model),) if r]
        if init:
            self.init_reports.append(load_init_weights(model, init))
        frozen = freeze_parameters(model, cfg.optim.freeze, cfg.optim.frozen_bn)
        if t.sync_bn:  # before the EMA copy, so a teacher/EMA gets the same layers
            model = convert_sync_bn(model, self.dist, self.device)
        model.to(self.device)
        fsdp = self.dist.enabled and cfg.distributed.strategy == "fsdp"
        if t.channels_last and not fsdp:  # FSDP shards contiguous parameters only; the images stay NHWC
            model.to(memory_format=torch.channels_last)
        self.ema = ModelEma(model, cfg.ema.decay, warmup=cfg.ema.warmup, every=cfg.ema.every) \
            if cfg.ema.enabled else None
        self.raw_model = model
        # FSDP shards model, EMA and optimizer state (and checkpoints them sharded); else DDP or as is
        self.model, self.sharded, units = build.distribute(model, self.ema, cfg, task, self.dist, self.device,
                                                           self.ckpt_dir)
        self.weights = self.sharded or ReplicatedWeights()
        o = cfg.optim  # parameter groups after sharding: FSDP replaces the parameters by DTensors
        groups = task.param_groups(model) or build_param_groups(
            model, o.weight_decay, no_decay_bias_norm=o.no_decay_bias_norm, lr_mult=o.lr_mult)
        check_coverage(model, groups)
        global_batch = cfg.data.batch_size * self.dist.world_size * t.accum_steps
        self.base_lr = scale_lr_by_batch(o.lr, global_batch, o.base_batch)
        self.optimizer = build_optimizer(groups, o.name, lr=self.base_lr, momentum=o.momentum, beta2=o.beta2,
                                         eps=o.eps, nesterov=o.nesterov, impl=o.impl)
        if t.compile:
            self.model = torch.compile(self.model)
        self.scaler = make_scaler(t.precision, self.device)

        self.clock = build.make_clock(cfg, self.sampler.batches_per_epoch)
        self.loss_weights = dict(task.loss_weights)
        self.scalars = build.ScheduledScalars(
            cfg.schedules, {"lr": self.base_lr, "weight_decay": o.weight_decay, "momentum": o.momentum,
                            "ema_decay": cfg.ema.decay, "bn_momentum": 0.1},
            self.clock, self.optimizer, model, task, self.ema)
        self.recorder = StepRecorder(t.log_every, self.device)
        self.pending = PendingRows()  # rows read from the device, not yet logged
        self.skipped = self.overflow_skipped = 0
        self.samples_seen = 0  # in this process (for throughput), counted at log points
        self.epoch_means = EpochMeans()
        self.log = RunLogger(self.run_dir, total_steps=self.clock.total_steps, progress=t.progress, enabled=writes)
        plots = [PlotHook(self.run_dir)] if writes and t.plots else []
        self.hooks = HookList([*task.hooks(), *hooks, *self.log.hooks(), *plots,
                               *profiler_hooks(t.profile, t.profile_start, t.profile_steps, self.run_dir, writes)], self)
        self.step_fn = TrainStep(self.model, task.losses, self.optimizer, device=self.device,
                                 precision=t.precision, scaler=self.scaler, clip_grad=t.clip_grad,
                                 clip_mode=t.clip_mode, channels_last=t.channels_last,
                                 after_backward=self.hooks.callbacks("after_backward"), recorder=self.recorder,
                                 mask_nonfinite=t.nonfinite == "skip", on_device=task.device_transform(),
                                 fixed_weights=not any(k.startswith("loss.") for k in self.scalars.schedules))
        metric = cfg.eval.metric or task.metric
        self.metric, self.mode = metric, cfg.eval.mode or task.mode
        self.best = BestTracker(self.ckpt_dir, self.mode, cfg.checkpoint.keep_best) if writes else None
        for report in self.init_reports:
            self.log.print(report)
        if stale:
            self.log.print(f"removed {len(stale)} temporary files an interrupted write left: {', '.join(stale)}")
        if units is not None:
            self.log.print(f"fsdp: {len(units)} units sharded over {self.dist.world_size} ranks, and the root")
        if frozen:
            self.log.print(f"frozen {len(frozen)} parameter tensors")
        self.step, self.epoch, self.step_in_epoch = 0, 0, 0
        self.phase, self._weights_ok_at = "training", 0  # for messages: what ran out of memory, when weights were last finite
        self.stop = StopFlag()  # SIGTERM / SIGUSR1 while fit() runs: checkpoint, then Preempted
        self.last_eval: dict[str, float] = {}
        self.last_eval_step = -1
        self.wall_before, self._t_start = 0.0, time.perf_counter()  # training time of earlier segments
        # Set-up may draw from the global RNGs a varying amount (first-time imports do), so the
        # training streams start from a fresh seed: a run is a function of cfg.seed alone.
        build.seed_everything(cfg.seed + 1)
        if resume:
            self.load_state(load_checkpoint(resume, resolve_sharded=False), resume)
        if writes:  # after the resume checks: a refused resume leaves the run's config.yaml as it was
            write_run_config(self.run_dir, dump_config(cfg), resumed_at=self.step if resume else None)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, Any]:
        self.stop.install()
        try:
            return self._fit()
        except Exception as err:
            if not is_out_of_memory(err):
                raise
            last = self.ckpt_dir / "last.pt" if self.ckpt_dir is not None else None
            raise OutOfMemory(out_of_memory_message(err, phase=self.phase, cfg=self.cfg, device=self.device,
                                                    step=self.step, last_checkpoint=str(last) if last and
                                                    last.is_file() else None)) from err
        finally:
            self.stop.restore()
            build.stop_workers(self.train_loader)  # persistent workers end now, not at garbage collection

    def _fit(self) -> dict[str, Any]:
        t, total = self.cfg.trainer, self.clock.total_steps
        self.hooks("before_train")
        self._t_start = self._t_window = time.perf_counter()
        self._start_step, self._t_data = self.step, 0.0
        e, c = self.cfg.eval, self.cfg.checkpoint
        eval_every = e.every if e.unit == "steps" else 0
        ckpt_every = c.every if c.unit == "steps" else 0
        before_step, after_step = self.hooks.callbacks("before_step"), self.hooks.callbacks("after_step")
        scheduled, ema, log_every, clock = self.scalars.schedules, self.ema, t.log_every, time.perf_counter
        if e.at_start and self.step == 0:
            self.evaluate()  # the metric at initialisation, measured the same way as later ones
        while self.epoch < t.epochs and self.step < total:
            self.model.train()
            accum = t.accum_steps if self.epoch >= t.accum_after_epoch else 1
            self.sampler.set_epoch(self.epoch, start_batch=self.step_in_epoch * accum)
            batches = device_batches(iter(self.train_loader), self.device, channels_last=t.channels_last,
                                     prefetch=self.cfg.data.prefetch_to_device)
            self.hooks("before_epoch")
            steps_this_epoch = self.clock.steps_in_epoch(self.epoch)
            while self.step_in_epoch < steps_this_epoch and self.step < total:
                if scheduled:
                    self.scalars.apply(self.step, self.loss_weights)
                for fn in before_step:
                    fn()
                t0 = clock()
                micro = self._next_batches(batches, accum)
                self._t_data += clock() - t0
                self.step_fn(micro, self.loss_weights)
                if ema is not None:
                    ema.update(self.model, self.step)
                self.step += 1
                self.step_in_epoch += 1
                for fn in after_step:
                    fn()
                at_log_point = self.step % log_every == 0 or self.step == total
                if at_log_point:
                    self._log_point()
                if eval_every and self.step % eval_every == 0 and self.step < total:
                    self.evaluate()
                if ckpt_every and self.step % ckpt_every == 0 and self.step < total:
                    self.save_last()
                if (self.stop.requested or at_log_point) and self.step_in_epoch < steps_this_epoch \
                        and self._stop_now(at_log_point):
                    self._preempt()
            if self.step_in_epoch >= steps_this_epoch:
                self._end_epoch()
                if self.step < total and self._stop_now(True):  # at the epoch boundary, after its checkpoint
                    self._preempt()
            else:
                break  # max_steps reached mid-epoch
        return self._finish(time.perf_counter() - self._t_start)

    def _stop_now(self, at_log_point: bool) -> bool:
        """A single process stops after any step; ranks agree only at log points (one all-reduce).
        The loop asks only when this process was signalled or at a log point."""
        if self.dist.enabled:
            return at_log_point and self.stop.any_rank(self.device)  # host sync (log point)
        return self.stop.requested

    def _preempt(self) -> None:
        self.save_last()  # every rank: it reads the metric rows (a collective); rank 0 writes
        where = f"{self.ckpt_dir / 'last.pt'} written; continue with --resume auto" if self.ckpt_dir \
            else "no run dir, nothing written"
        self.log.close()  # the CLI prints the one line that says where the run stopped
        raise Preempted(f"stopped by {self.stop.name} at step {self.step} (epoch {self.epoch}); {where}",
                        self.stop.signum)

    def _next_batches(self, batches: Any, accum: int) -> list[Any]:
        """The micro-batches of one step (host-side loading: CPU tensors, no device reads)."""
        return [next(batches) for _ in range(accum)]

    def _end_epoch(self) -> None:
        self.hooks("after_epoch")
        if self.recorder.n or self.pending:  # the epoch's last steps since the last log point
            self._log_point()
        summary = self.epoch_means.pop()
        if summary:
            self.log.table(f"epoch {self.epoch} train", summary)
        done = self.epoch + 1  # epochs completed
        last = done >= self.cfg.trainer.epochs or self.step >= self.clock.total_steps
        e, c = self.cfg.eval, self.cfg.checkpoint
        if e.unit == "epochs" and (last or (e.every > 0 and done % e.every == 0)):
            self.evaluate()
        self.epoch, self.step_in_epoch = done, 0  # a checkpoint from here resumes at the next epoch
        if not last and c.unit == "epochs" and c.every > 0 and done % c.every == 0:
            self.save_last()

    def _log_point(self) -> None:
        """The only per-window host sync: metrics and the non-finite flags, read together."""
        now = time.perf_counter()
        window_s, data_s, elapsed = now - self._t_window, self._t_data, now - self._t_start
        steps_done = self.step - self._start_step
        self._t_window, self._t_data = now, 0.0
        self.check_finite()  # host sync: moves the recorded rows to self.pending
        n, values = self.pending.pop_means()
        if not n:
            return
        self.epoch_means.add(values, n)
        steps_left = self.clock.total_steps - self.step
        accum = self.cfg.trainer.accum_steps if self.epoch >= self.cfg.trainer.accum_after_epoch else 1
        samples = n * self.cfg.data.batch_size * self.dist.world_size * accum
        self.samples_seen += samples
        values.update(self.scalars.logged(self.optimizer))
        values["skipped_steps"], values["fp16_overflow_skips"] = self.skipped, self.overflow_skipped
        values["samples_per_s"] = samples / max(window_s, 1e-9)
        values["data_s"], values["compute_s"] = data_s, window_s - data_s
        values["eta_s"] = elapsed / max(steps_done, 1) * steps_left
        if self.device.type == "cuda":
            values["gpu_peak_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        self.log.log("train", self.step, self.epoch, values)

    def check_finite(self) -> None:
        """Read the recorded steps and act on the non-finite policy. Runs before every log point,
        evaluation and checkpoint, so `raise` fires at most log_every steps after the bad step."""
        read = self.recorder.read(reduce=partial(all_reduce_mean, info=self.dist))  # host sync
        skipped, overflow = check_rows(read, self.step - len(read.rows) + 1, policy=self.cfg.trainer.nonfinite,
                                       fp16=self.scaler is not None, epoch_of=self.clock.epoch_of)
        self.skipped, self.overflow_skipped = self.skipped + skipped, self.overflow_skipped + overflow
        self.pending.add(read)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict[str, float]:
        self.check_finite()  # host sync: never evaluate or save after a bad step under `raise`
        if self.sharded is not None:
            sync_buffers([self.raw_model] + ([self.ema.module] if self.ema is not None else []))
        which = self.cfg.eval.models
        metrics = self._eval_model(self.raw_model, "") if which != "ema" or self.ema is None else {}
        if self.ema is not None and which != "model":
            metrics.update(self._eval_model(self.ema.module, "ema/"))
        self.last_eval, self.last_eval_step = metrics, self.step
        self.log.log("eval", self.step, self.epoch, metrics)
        self.hooks("after_eval", metrics)
        if self.best is not None and self.metric:
            if self.metric not in metrics and f"ema/{self.metric}" not in metrics:
                raise KeyError(f"eval.metric={self.metric!r} is not among the task's metrics "
                               f"{sorted(k for k in metrics if not k.startswith('ema/'))}")
        if self.best is not None or self.sharded is not None:
            keys = {"model": self.metric, "ema": f"ema/{self.metric}"}
            wants = [w for w, k in keys.items() if self.best and k in metrics and self.best.wants(w, metrics[k])]
            if self.sharded is not None:
                wants = broadcast_object(wants, self.dist)  # host sync: every rank writes its shards
            state = self.state_dict() if wants else None
            for which in wants if self.best is not None else ():
                self.best.update(which, metrics[keys[which]], state, self.step)
            if wants and self.sharded is not None and self.dist.is_main:
                self.sharded.prune()
        return metrics

    def _eval_model(self, model: nn.Module, prefix: str) -> dict[str, float]:
        was_training, self.phase = model.training, "evaluation"
        model.eval()
        with torch.no_grad():
            metrics = self.task.evaluate(model, self.val_loader, self.device)
        model.train(was_training)
        self.phase = "training"
        return {prefix + k: v for k, v in metrics.items()}

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The whole training state. Under FSDP every rank calls it: each writes its shards of the
        model, EMA and optimizer (engine.fsdp), and the dict names their directory instead."""
        check_weights([self.raw_model] + ([self.ema.module] if self.ema is not None else []), self.step,
                      self._weights_ok_at, reduce=self.sharded is not None)  # host sync (checkpoint)
        self._weights_ok_at = self.step
        return {
            "format": CHECKPOINT_FORMAT,
            **self.weights.save(self.step, self.raw_model, self.optimizer, self.ema),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "progress": {"step": self.step, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                         "batch_size": self.cfg.data.batch_size, "world_size": self.dist.world_size,
                         "strategy": "fsdp" if self.sharded is not None else "replicated",
                         "wall_s": self.wall_before + time.perf_counter() - self._t_start},
            "sampler_seed": self.sampler.seed,
            "rng": capture_rng(),
            "best": self.best.state_dict() if self.best is not None else None,
            "metrics": {"pending": self.pending.state_dict(),
                        "epoch": self.epoch_means.state_dict(),
                        "skipped": self.skipped, "overflow_skipped": self.overflow_skipped},
            "task": self.task.state_dict(),
            "data_info": self.data_info,
            "config": config_to_dict(self.cfg),
        }

    def save_last(self) -> None:
        self.check_finite()  # host sync: a checkpoint never holds weights after a bad step
        if self.ckpt_dir is None or not (self.dist.is_main or self.sharded is not None):
            return
        state = self.state_dict()
        if not self.dist.is_main:
            return
        atomic_save(state, self.ckpt_dir / "last.pt")
        every = self.cfg.checkpoint.keep_every
        if every and self.step % every == 0:
            atomic_save(state, self.ckpt_dir / f"step-{self.step}.pt")
        if self.sharded is not None:
            self.sharded.prune()

    def load_state(self, state: dict[str, Any], source: str) -> None:
        from visiontrain.engine.run_dir import config_changes
        from visiontrain.engine.weights import check_resume_compatible

        check_resume_compatible(state, self, source)
        for line in config_changes(state["config"], config_to_dict(self.cfg)):
            self.log.print(line)
        self.weights.load(Path(source), state, self.raw_model, self.optimizer, self.ema)
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        p = state["progress"]
        self.step, self.epoch, self.step_in_epoch = int(p["step"]), int(p["epoch"]), int(p["step_in_epoch"])
        self.wall_before = float(p.get("wall_s", 0.0))
        self.sampler.seed = int(state["sampler_seed"])
        if self.best is not None and state["best"] is not None:
            self.best.load_state_dict(state["best"])
        self.pending.load_state_dict(state["metrics"]["pending"])
        self.skipped = int(state["metrics"]["skipped"])
        self.overflow_skipped = int(state["metrics"]["overflow_skipped"])
        self.epoch_means.load_state_dict(state["metrics"]["epoch"])
        self.task.load_state_dict(state["task"])
        restore_rng(state["rng"])
        self.log.rewind(self.step)
        self.log.print(f"resumed from {source} at step {self.step} (epoch {self.epoch}, "
                       f"step {self.step_in_epoch} of the epoch)")

    def _finish(self, wall_s: float) -> dict[str, Any]:
        if self.last_eval_step != self.step:
            self.evaluate()
        self.save_last()
        summary: dict[str, Any] = {}
        for name, module in (("model", self.raw_model), ("model_ema", self.ema and self.ema.module)):
            if module is not None and self.run_dir is not None and (self.dist.is_main or self.sharded):
                weights = full_state_dict(module) if self.sharded else module.state_dict()  # FSDP: a gather
                if self.dist.is_main:
                    save_safetensors(weights, self.run_dir / f"{name}.safetensors")
        if self.dist.is_main and self.run_dir is not None:
            summary = {
                "steps": self.step, "epochs": self.epoch, "wall_s": round(self.wall_before + wall_s, 3),
                "samples_per_s": self.samples_seen / max(wall_s, 1e-9),
                "final": dict(self.last_eval),
                "best": dict(self.best.best) if self.best else {}, "metric": self.metric, "mode": self.mode,
                "skipped_steps": self.skipped, "fp16_overflow_skips": self.overflow_skipped,
            }
            write_run_file(self.run_dir, "summary.json", dumps_json(summary, indent=2))
            self.log.table("final", {**summary["final"], "wall_s": summary["wall_s"]})
        self.hooks("after_train")
        self.log.close()
        return summary
