"""Set-up pieces a run is built from (engine.run): device, seeds, the training source and the
evaluation loader, wrapping, the step clock and the rules of accumulation (``accum_steps_at``,
``samples_per_step``)."""
from __future__ import annotations

import logging
import multiprocessing
import random
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from visiontrain.config import Config, ConfigError
from visiontrain.data.sources import DataConfig
from visiontrain.data.samplers import GroupedBatchSampler, ResumableBatchSampler, SeededDataset
from visiontrain.engine.distributed import DistInfo, wrap_ddp
from visiontrain.engine.fsdp import ShardedCheckpoints, shard_model
from visiontrain.engine.source import LoaderSource, TrainSource
from visiontrain.engine.trainer_config import TrainerConfig
from visiontrain.stop_signals import ignore_stop_signals
from visiontrain.engine.schedules import StepClock
from visiontrain.engine.worker_check import check_sendable_to_workers

log = logging.getLogger("visiontrain")


def pick_device(name: str, dist_info: DistInfo) -> torch.device:
    """``trainer.device`` as a torch device; ``cuda`` is this rank's GPU. A device this machine does not
    have is a mistake in the config, named as typed (exit 2), not a traceback from torch."""
    typed = name
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        name = f"cuda:{dist_info.local_rank}"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"trainer.device={typed}: not a device; expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"trainer.device={typed}: CUDA is not available here (torch {torch.__version__}); "
                          f"use trainer.device=cpu, or auto to take a GPU where there is one")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"trainer.device={typed}: this machine has {torch.cuda.device_count()} GPU(s) "
                          f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return device


def uses_fsdp(cfg: Config, dist_info: DistInfo) -> bool:
    """Whether this run shards its model: ``distributed.strategy=fsdp`` under torchrun."""
    return dist_info.enabled and cfg.distributed.strategy == "fsdp"


def distribute(model: nn.Module, ema: Any, cfg: Config, task: Any, dist_info: DistInfo, device: torch.device,
               ckpt_dir: Any) -> tuple[nn.Module, ShardedCheckpoints | None, list[str] | None]:
    """The module the step calls, the sharded checkpoints (FSDP only) and the FSDP unit names.
    FSDP shards ``model`` (and the EMA copy) in place: build the optimizer after this."""
    if not uses_fsdp(cfg, dist_info):
        return wrap_ddp(model, dist_info, device, find_unused_parameters=task.find_unused_parameters), None, None
    if cfg.trainer.precision == "fp16":
        raise ValueError("distributed.strategy=fsdp with trainer.precision=fp16: the gradient scaler does not "
                         "handle sharded gradients; use trainer.precision=bf16")
    units = shard_model(model, dist_info, device, cfg.distributed, [ema.module] if ema is not None else [])
    return model, ShardedCheckpoints(ckpt_dir, dist_info), units


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def loaders(data: Any, cfg: Config, dist_info: DistInfo, device: torch.device) -> tuple[TrainSource, DataLoader]:
    """The training source and the evaluation loader of a task's ``TaskData``: its own source when
    ``data.train`` is one, else the map-style dataset through the resumable batch sampler (grouped
    by aspect ratio when the task gives groups)."""
    d: DataConfig = cfg.data
    context = worker_context(d.worker_start) if d.num_workers > 0 else None
    if isinstance(data.train, TrainSource):
        return data.train, val_loader(data, cfg, dist_info, device, context=context)
    sampler = train_sampler(data, cfg, dist_info)
    if isinstance(sampler, GroupedBatchSampler) and dist_info.is_main and (left_out := sampler.left_out_message()):
        log.info("%s", left_out)  # said once: grouping drops each orientation's leftovers
    train = train_loader(data.train, sampler, random_transforms=data.random_transforms, collate=data.train_collate,
                         num_workers=d.num_workers, pin_memory=pins(cfg, device),
                         persistent_workers=d.persistent_workers, context=context)
    val = val_loader(data, cfg, dist_info, device, context=context)
    if d.num_workers > 0:  # what each worker will be sent, exactly as the loader holds it
        check_sendable_to_workers(d.worker_start, {
            "training dataset": train.dataset, "training collate function": train.collate_fn,
            "worker init function": train.worker_init_fn})
    return LoaderSource(sampler, train), val


def train_sampler(data: Any, cfg: Config, dist_info: DistInfo) -> ResumableBatchSampler:
    """This rank's batches of the training set: grouped by aspect ratio when the task gives groups."""
    shard = {"rank": dist_info.rank, "world_size": dist_info.world_size}
    if data.group_ids is not None:
        return GroupedBatchSampler(data.group_ids, cfg.data.batch_size, seed=cfg.seed, **shard)
    return ResumableBatchSampler(len(data.train), cfg.data.batch_size, seed=cfg.seed, **shard)


def val_loader(data: Any, cfg: Config, dist_info: DistInfo, device: torch.device, *, context: Any = None
               ) -> DataLoader:
    """The evaluation loader of a task's ``TaskData`` (all that ``validate`` builds of the data)."""
    d: DataConfig = cfg.data
    if d.num_workers > 0 and context is None:
        context = worker_context(d.worker_start)
    val = eval_loader(data.val, d.eval_batch(), collate=data.eval_collate, num_workers=d.num_workers,
                      pin_memory=pins(cfg, device), dist_info=dist_info, context=context)
    if d.num_workers > 0:
        check_sendable_to_workers(d.worker_start, {
            "validation dataset": val.dataset, "validation collate function": val.collate_fn,
            **{f"task's {name}": ds for name, ds in data.worker_datasets.items()}})
    return val


def pins(cfg: Config, device: torch.device) -> bool:
    """Pinned host memory: only where a copy to a GPU follows."""
    return cfg.data.pin_memory and device.type == "cuda"


#: What the forkserver imports once, before it forks any worker: then a worker starts in
#: milliseconds instead of importing torch itself. ``__main__`` (a user's script that defines its
#: dataset) is imported the way multiprocessing's spawn does, without running its main block.
FORKSERVER_PRELOAD = ["__main__", "visiontrain.data.worker_preload"]


def worker_context(start: str) -> Any:
    """The multiprocessing context DataLoader workers start from (``data.worker_start``).

    A fork copies the training process with whatever locks its other threads hold at that instant
    (gloo/NCCL work, the pin-memory thread, TensorBoard's writer); a worker that then needs one
    waits forever, and the run hangs at an evaluation. The forkserver is a separate process with a
    single thread, started once per training process, so its forks are clean."""
    if start == "spawn":
        from visiontrain.data.worker_preload import SpawnContext

        return SpawnContext()
    context = multiprocessing.get_context(start)
    if start == "forkserver":
        from multiprocessing import forkserver

        context.set_forkserver_preload(FORKSERVER_PRELOAD)
        forkserver.ensure_running()  # its imports now overlap with building the model
    return context


def train_loader(ds: Dataset, sampler: ResumableBatchSampler, *, random_transforms: bool,
                 collate: Callable | None, num_workers: int, pin_memory: bool,
                 persistent_workers: bool, context: Any = None) -> DataLoader:
    # A private generator: creating an iterator draws worker base seeds from it, not from the global
    # RNG, so a resumed run (which creates its iterator mid-epoch) keeps the same global RNG stream.
    sampler.seeded = random_transforms
    return DataLoader(SeededDataset(ds) if random_transforms else ds, batch_sampler=sampler,
                      num_workers=num_workers, collate_fn=collate, pin_memory=pin_memory,
                      worker_init_fn=ignore_stop_signals if num_workers > 0 else None,
                      persistent_workers=persistent_workers and num_workers > 0,
                      multiprocessing_context=context, generator=torch.Generator().manual_seed(0))


def eval_loader(ds: Dataset, batch_size: int, *, collate: Callable | None, num_workers: int,
                pin_memory: bool, dist_info: DistInfo, context: Any = None) -> DataLoader:
    sampler = None
    if dist_info.enabled:
        from torch.utils.data.distributed import DistributedSampler

        sampler = DistributedSampler(ds, dist_info.world_size, dist_info.rank, shuffle=False)
    return DataLoader(ds, batch_size=batch_size, shuffle=False, sampler=sampler,
                      num_workers=num_workers, collate_fn=collate, pin_memory=pin_memory,
                      worker_init_fn=ignore_stop_signals if num_workers > 0 else None,
                      multiprocessing_context=context, generator=torch.Generator().manual_seed(0))


def accum_steps_at(t: TrainerConfig, epoch: int) -> int:
    """Micro-batches per optimizer step in ``epoch``: ``trainer.accum_steps`` from
    ``trainer.accum_after_epoch`` on (0: from the start), one before."""
    return t.accum_steps if epoch >= t.accum_after_epoch else 1


def samples_per_step(cfg: Config, world_size: int, epoch: int | None = None) -> int:
    """The samples one optimizer step trains on, over every process (the global batch): in ``epoch``,
    or (None) once accumulation is on."""
    accum = cfg.trainer.accum_steps if epoch is None else accum_steps_at(cfg.trainer, epoch)
    return cfg.data.batch_size * world_size * accum


def make_clock(cfg: Config, batches_per_epoch: int) -> StepClock:
    """Optimizer steps per epoch (before / after accumulation switches on) and the run's total."""
    t = cfg.trainer
    accum_from = t.accum_after_epoch if t.accum_steps > 1 and t.accum_after_epoch > 0 else 0
    first = batches_per_epoch // accum_steps_at(t, 0)
    after = batches_per_epoch // t.accum_steps
    if after == 0:
        raise ValueError(f"trainer.accum_steps={t.accum_steps} exceeds the {batches_per_epoch} "
                         f"batches of an epoch")
    total = first * min(accum_from, t.epochs) + after * max(0, t.epochs - accum_from) if accum_from \
        else first * t.epochs
    if t.max_steps is not None:
        total = min(total, t.max_steps)
    if accum_from and accum_from < t.epochs:
        return StepClock(first, total, change_epoch=accum_from, steps_per_epoch_after=after)
    return StepClock(first, total)
