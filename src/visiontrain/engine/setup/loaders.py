"""The data side of a run: the training source (the dataset under the resumable sampler), the
evaluation loader, and how DataLoader workers start."""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, Dataset

from visiontrain.core.config import Config
from visiontrain.core.process_tree import WORKER_PARENT_ENV, start_worker
from visiontrain.data.samplers import GroupedBatchSampler, ResumableBatchSampler, SeededDataset
from visiontrain.data.section import DataConfig
from visiontrain.data.stacked import keep_stacked
from visiontrain.engine.setup.data_choices import choose_workers, free_device_memory, keeps_on_device
from visiontrain.engine.parallel.distributed import DistInfo
from visiontrain.engine.setup.worker_check import check_sendable_to_workers
from visiontrain.engine.step.source import LoaderSource, TrainSource

log = logging.getLogger("visiontrain")


@dataclass(frozen=True)
class Workers:
    """How a loader's worker processes run: how many (0: loading in this process), whether batches
    land in pinned memory, whether the workers outlive an epoch, and how they start
    (``worker_context``: None is the platform's default)."""
    count: int = 0
    pin_memory: bool = False
    persistent: bool = False
    context: Any = None


def loaders(data: Any, cfg: Config, dist_info: DistInfo, device: torch.device) -> tuple[TrainSource, DataLoader]:
    """The training source and the evaluation loader of a task's ``TaskData``: its own source when
    ``data.train`` is one, else the map-style dataset through the resumable batch sampler (grouped
    by aspect ratio when the task gives groups)."""
    d: DataConfig = resolved_data(cfg, device, dist_info)
    context = worker_context(d.worker_start) if d.num_workers > 0 else None
    if isinstance(data.train, TrainSource):
        return data.train, val_loader(data, cfg, dist_info, device, context=context)
    data = place_on_device(data, cfg, device, say=dist_info.is_main)
    sampler = train_sampler(data, cfg, dist_info)
    if isinstance(sampler, GroupedBatchSampler) and dist_info.is_main and (left_out := sampler.left_out_message()):
        log.info("%s", left_out)  # said once: grouping drops each orientation's leftovers
    workers = Workers(d.num_workers, pins(cfg, device, data), d.persistent_workers, context)
    train = train_loader(data.train, sampler, random_transforms=data.random_transforms,
                         collate=keep_stacked(data.train_collate), workers=workers)
    val = val_loader(data, cfg, dist_info, device, context=context, placed=True)
    if d.num_workers > 0:  # what each worker will be sent, exactly as the loader holds it
        check_sendable_to_workers(d.worker_start, {
            "training dataset": train.dataset, "training collate function": train.collate_fn,
            "worker init function": train.worker_init_fn})
    return LoaderSource(sampler, train, cfg.trainer.accum_steps), val


def resolved_data(cfg: Config, device: torch.device, dist_info: DistInfo) -> DataConfig:
    """The data section with ``data.num_workers=auto`` made a number: already done at a run's start
    (``engine.setup.training.start_process``, which says it); here for loaders built without one."""
    line = choose_workers(cfg, device.type)
    if line and dist_info.is_main:
        log.info("%s", line)
    return cfg.data


def train_sampler(data: Any, cfg: Config, dist_info: DistInfo) -> ResumableBatchSampler:
    """This rank's batches of the training set, in the order its data source reads them
    (``DataConfig.batch_sampler``)."""
    return cfg.data.batch_sampler(len(data.train), data.group_ids, seed=cfg.seed, rank=dist_info.rank,
                                  world_size=dist_info.world_size)


def val_loader(data: Any, cfg: Config, dist_info: DistInfo, device: torch.device, *, context: Any = None,
               placed: bool = False) -> DataLoader:
    """The evaluation loader of a task's ``TaskData`` (all that ``validate`` builds of the data);
    ``placed``: ``data`` has been through :func:`place_on_device` already."""
    d: DataConfig = resolved_data(cfg, device, dist_info)
    if d.num_workers > 0 and context is None:
        context = worker_context(d.worker_start)
    if not placed:
        data = place_on_device(data, cfg, device, say=dist_info.is_main)
    val = eval_loader(data.val, d.eval_batch(), collate=keep_stacked(data.eval_collate), dist_info=dist_info,
                      workers=Workers(d.num_workers, pins(cfg, device, data), context=context))
    if d.num_workers > 0:
        check_sendable_to_workers(d.worker_start, {
            "validation dataset": val.dataset, "validation collate function": val.collate_fn,
            **{f"task's {name}": ds for name, ds in data.worker_datasets.items()}})
    return val


def pins(cfg: Config, device: torch.device, data: Any = None) -> bool:
    """Pinned host memory: only where a copy to a GPU follows (not for a set already there)."""
    on_device = data is not None and getattr(data.train, "stacked", False)
    return cfg.data.pin_memory and device.type == "cuda" and not on_device


def place_on_device(data: Any, cfg: Config, device: torch.device, *, say: bool) -> Any:
    """``data`` with its splits in ``device``'s memory where ``data.on_device`` (a key of the sources
    held in memory) chooses it, and the datasets can be placed (``placed_on``); else as it is."""
    setting = getattr(cfg.data, "on_device", False)
    if not setting or not hasattr(data.train, "placed_on"):
        return data
    nbytes = data.train.nbytes + data.val.nbytes
    if not keeps_on_device(setting, device, cfg.data.num_workers, nbytes, free_device_memory(device)):
        return data
    if say:
        log.info("data.on_device: the %s training and %s validation samples (%.0f MB) kept on %s; batches are "
                 "made there", f"{len(data.train):,}", f"{len(data.val):,}", nbytes / 1e6, device)
    return dataclasses.replace(data, train=data.train.placed_on(device), val=data.val.placed_on(device))


#: What the forkserver imports once, before it forks any worker: then a worker starts in
#: milliseconds instead of importing torch itself. ``__main__`` (a user's script that defines its
#: dataset) is imported the way multiprocessing's spawn does, without running its main block.
FORKSERVER_PRELOAD = ["__main__", "visiontrain.data.worker_preload"]


#: multiprocessing's resource tracker (a process the first worker, queue or forkserver starts)
#: unlinks the semaphores of a training killed with SIGKILL, and then prints a raw UserWarning
#: ("There appear to be 11 leaked semaphore objects to clean up at shutdown") as the last line of
#: the dead run's log. The cleaning is its job and it still does it; the warning, to a user who
#: killed the run, reads like a fault. Interpreter flags (``-W``) are how it is started, so the
#: filter goes there, before the tracker starts.
QUIET_RESOURCE_TRACKER = "ignore:resource_tracker:UserWarning"


def worker_context(start: str) -> Any:
    """The multiprocessing context DataLoader workers start from (``data.worker_start``).

    A fork copies the training process with whatever locks its other threads hold at that instant
    (gloo/NCCL work, the pin-memory thread, TensorBoard's writer); a worker that then needs one
    waits forever, and the run hangs at an evaluation. The forkserver is a separate process with a
    single thread, started once per training process, so its forks are clean."""
    os.environ[WORKER_PARENT_ENV] = str(os.getpid())  # each worker (and forkserver) checks it still has this parent
    if QUIET_RESOURCE_TRACKER not in sys.warnoptions:
        sys.warnoptions.append(QUIET_RESOURCE_TRACKER)
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
                 collate: Callable | None, workers: Workers = Workers()) -> DataLoader:
    # A private generator: creating an iterator draws worker base seeds from it, not from the global
    # RNG, so a resumed run (which creates its iterator mid-epoch) keeps the same global RNG stream.
    sampler.seeded = random_transforms
    w = workers
    return DataLoader(SeededDataset(ds) if random_transforms else ds, batch_sampler=sampler,
                      num_workers=w.count, collate_fn=collate, pin_memory=w.pin_memory,
                      worker_init_fn=start_worker if w.count > 0 else None,
                      persistent_workers=w.persistent and w.count > 0,
                      multiprocessing_context=w.context, generator=torch.Generator().manual_seed(0))


def eval_loader(ds: Dataset, batch_size: int, *, collate: Callable | None, dist_info: DistInfo,
                workers: Workers = Workers()) -> DataLoader:
    sampler = None
    if dist_info.enabled:
        from torch.utils.data.distributed import DistributedSampler

        sampler = DistributedSampler(ds, dist_info.world_size, dist_info.rank, shuffle=False)
    w = workers
    return DataLoader(ds, batch_size=batch_size, shuffle=False, sampler=sampler,
                      num_workers=w.count, collate_fn=collate, pin_memory=w.pin_memory,
                      worker_init_fn=start_worker if w.count > 0 else None,
                      multiprocessing_context=w.context, generator=torch.Generator().manual_seed(0))
