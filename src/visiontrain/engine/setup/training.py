"""The build phase: a run's objects made once from (config, task), before anything runs.

``fit`` takes all of it (:func:`build_training`); ``validate`` takes the evaluation side
(:func:`build_evaluation`: no optimizer, no train loader, no process group's optimizer state);
``benchmark`` is ``fit`` with a seam. The order is fixed (seed, data, model, EMA, wrapping,
optimizer) so that a run is a function of its config: one seed gives one set of initial weights.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from visiontrain.core.config import Config
from visiontrain.engine.optim.param_groups import build_optimizer, check_coverage, group_rules
from visiontrain.engine.optim.scalars import ScheduledScalars
from visiontrain.engine.optim.schedules import StepClock, scale_lr_by_batch
from visiontrain.engine.parallel.distributed import DistInfo, convert_sync_bn, init_distributed
from visiontrain.engine.protocols.task import Task, check_needs
from visiontrain.engine.setup.data_choices import choose_workers, device_type
from visiontrain.engine.setup.loaders import loaders, val_loader
from visiontrain.engine.setup.placement import distribute, pick_device, seed_everything, uses_fsdp
from visiontrain.engine.setup.worker_check import refuse_unguarded_main
from visiontrain.engine.state.checkpoint import prepare_run_dir
from visiontrain.engine.state.sharded import ShardedCheckpoints
from visiontrain.engine.state.weights import load_init_weights
from visiontrain.engine.step.accumulation import make_clock, samples_per_step
from visiontrain.engine.step.ema import ModelEma
from visiontrain.engine.setup.global_batch import keep_global_batch_on_resume
from visiontrain.engine.step.precision import FP32, PrecisionChoice, choose_precision, evaluation_precision
from visiontrain.engine.step.source import TrainSource
from visiontrain.models.freezing import freeze_parameters
from visiontrain.rundir.run_files import CHECKPOINTS_DIR

log = logging.getLogger("visiontrain")


@dataclass
class EvalRun:
    """What evaluating a model needs: the process, the device, the model (and EMA), the val loader."""
    cfg: Config
    task: Task
    dist: DistInfo
    device: torch.device
    data_info: dict[str, Any]                # saved in checkpoints: predict and export rebuild the model from it
    raw_model: nn.Module                     # unwrapped: what checkpoints hold and evaluation calls
    ema_model: nn.Module | None              # the EMA's weights in a copy of the model, evaluated as ema/...
    val_loader: DataLoader
    eval_precision: PrecisionChoice = FP32   # what evaluation computes in (eval.precision)


@dataclass
class TrainingRun(EvalRun):
    """Everything ``fit`` runs with."""
    run_dir: Path | None = None
    ema: ModelEma | None = None              # what updates ema_model after each step
    model: nn.Module | None = None           # what the step calls: DDP/FSDP-wrapped, compiled when asked
    source: TrainSource | None = None        # the training data (engine.step.source): batches of an epoch, its state
    optimizer: torch.optim.Optimizer | None = None
    precision: PrecisionChoice | None = None  # trainer.precision resolved on this device, and why
    scaler: Any = None                       # fp16's GradScaler, else None
    sharded: ShardedCheckpoints | None = None  # FSDP: model, EMA and optimizer checkpoint sharded
    base_lr: float = 0.0
    clock: StepClock | None = None
    scalars: ScheduledScalars | None = None
    notes: list[str] = field(default_factory=list)  # set-up lines for the run's log

    @property
    def ckpt_dir(self) -> Path | None:
        return self.run_dir / CHECKPOINTS_DIR if self.run_dir is not None else None

    @property
    def writes(self) -> bool:
        """Whether this process writes the run dir (rank 0 of a run that has one)."""
        return self.dist.is_main and self.run_dir is not None


def start_process(cfg: Config) -> tuple[DistInfo, torch.device]:
    """Threads, the process group (under torchrun) and this rank's device; first, before anything is
    written, a script whose DataLoader workers would run its training again is refused."""
    t = cfg.trainer
    kind = device_type(t.device)
    workers_line = choose_workers(cfg, kind)  # data.num_workers=auto
    if cfg.data.num_workers > 0:
        refuse_unguarded_main(cfg.data.worker_start, cfg.data.num_workers)
    if t.threads:
        torch.set_num_threads(t.threads)
    dist = init_distributed(kind)
    if workers_line and dist.is_main:
        log.info("%s", workers_line)
    return dist, pick_device(t.device, dist)


def place_model(model: nn.Module, cfg: Config, dist: DistInfo, device: torch.device) -> nn.Module:
    """Sync-BN, the device and channels_last: the same layers and layout for training and evaluation."""
    if cfg.trainer.sync_bn:  # before the EMA copy, so a teacher/EMA gets the same layers
        model = convert_sync_bn(model, dist, device)
    model.to(device)
    # FSDP shards contiguous parameters only; the images stay NHWC
    if cfg.trainer.channels_last and not uses_fsdp(cfg, dist):
        model.to(memory_format=torch.channels_last)
    return model


def build_training(cfg: Config, task: Task, run_dir: Path | None, *, resume: str | None, init: str | None
                   ) -> TrainingRun:
    """A fresh run starts from the task's pretrained parts, then ``--init``; a resumed one (``resume``:
    the checkpoint it continues) will load its checkpoint over whatever this builds, so it skips
    both, and keeps the checkpoint's global batch on this run's number of processes: the run's
    ``cfg`` is then the config with the batch split that keeps it (``engine.setup.global_batch``)."""
    check_needs(type(task), cfg)  # a task built without build_task (from Python) is checked here
    dist, device = start_process(cfg)
    cfg, batch_note = keep_global_batch_on_resume(cfg, resume, dist.world_size)
    precision = choose_precision(cfg.trainer.precision, device, sharded=uses_fsdp(cfg, dist))
    writes = dist.is_main and run_dir is not None
    stale = prepare_run_dir(run_dir) if writes else []
    seed_everything(cfg.seed)
    data = task.build_data()
    source, val_loader = loaders(data, cfg, dist, device)
    model = task.build_model(data.info)
    notes = [] if resume else [r for r in (task.init_weights(model),) if r]
    if init:
        notes.append(load_init_weights(model, init))
    frozen = freeze_parameters(model, cfg.optim.freeze, cfg.optim.frozen_bn)
    model = place_model(model, cfg, dist, device)
    e = cfg.ema  # the copy is made of the placed model: a teacher/EMA gets its sync-BN layers and layout
    ema = ModelEma(model, e.decay, warmup=e.warmup, every=e.every) if e.enabled else None
    ckpt_dir = run_dir / CHECKPOINTS_DIR if run_dir is not None else None
    # FSDP shards model, EMA and optimizer state (and checkpoints them sharded); else DDP or as is
    wrapped, sharded, units = distribute(model, ema, cfg, task, dist, device, ckpt_dir)
    o = cfg.optim  # parameter groups after sharding: FSDP replaces the parameters by DTensors
    rules = group_rules(o)
    groups = task.param_groups(model, rules) or rules(model)
    check_coverage(model, groups)
    base_lr = scale_lr_by_batch(o.lr, samples_per_step(cfg, dist.world_size), o.base_batch)
    optimizer = build_optimizer(groups, o, lr=base_lr)
    if cfg.trainer.compile:
        wrapped = torch.compile(wrapped)
    clock = make_clock(cfg, source.batches_per_epoch)
    bases = {"lr": base_lr, "weight_decay": o.weight_decay, "momentum": o.momentum, "ema_decay": cfg.ema.decay,
             "bn_momentum": 0.1}
    scalars = ScheduledScalars(cfg.schedules, bases, clock, optimizer, model, task, ema)
    notes += [batch_note] if batch_note else []
    notes.append(precision.line())
    eval_precision = evaluation_precision(cfg.eval.precision, precision)
    if eval_precision is not FP32:
        notes.append(f"evaluation in {eval_precision.precision}, as eval.precision=train sets")
    if stale:
        notes.append(f"removed {len(stale)} temporary files an interrupted write left: {', '.join(stale)}")
    if units is not None:
        notes.append(f"fsdp: {len(units)} units sharded over {dist.world_size} ranks, and the root")
    if frozen:
        notes.append(f"frozen {len(frozen)} parameter tensors")
    return TrainingRun(cfg, task, dist, device, data.info, model, ema and ema.module, val_loader, eval_precision,
                       run_dir=run_dir, ema=ema, model=wrapped,
                       source=source, optimizer=optimizer, precision=precision,
                       scaler=precision.scaler(device), sharded=sharded, base_lr=base_lr,
                       clock=clock, scalars=scalars, notes=notes)


def build_evaluation(cfg: Config, task: Task, model: nn.Module, ema_model: nn.Module | None,
                     data_info: dict[str, Any]) -> EvalRun:
    """The evaluation side of a run around an already restored model (``validate``): the process,
    the device and the validation loader; no optimizer and no training loader."""
    dist, device = start_process(cfg)
    seed_everything(cfg.seed)
    val = val_loader(task.build_data(), cfg, dist, device)
    ema_model = place_model(ema_model, cfg, dist, device).eval() if ema_model is not None else None
    trained = choose_precision(cfg.trainer.precision, device, sharded=uses_fsdp(cfg, dist))
    precision = evaluation_precision(cfg.eval.precision, trained)
    return EvalRun(cfg, task, dist, device, data_info, place_model(model, cfg, dist, device), ema_model, val,
                   precision)
