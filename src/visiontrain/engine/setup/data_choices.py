"""What the data side chooses from the machine it runs on: ``data.num_workers: auto`` and
``data.on_device: auto`` (in-memory sets) become numbers and yes/no once the process knows its
device and its share of the cores, before any loader is built, and the run says what it chose in
one line. A recipe that names a number keeps it: auto only fills in what the user left open.

Why these rules: a DataLoader worker is a process that decodes and augments while the step
computes. On a GPU the step needs one core to launch kernels and the rest can feed it, so auto
takes all but one of this process's cores (capped at 16: past that, each worker's memory costs
more than the loading it adds for one device). On a CPU the step's own threads use the same cores,
so auto takes a quarter of them, at least one. A set held in memory loads by indexing: a worker
would only copy each batch once more, so auto gives none. Torchrun's processes on one machine
share its cores (``LOCAL_WORLD_SIZE``)."""
from __future__ import annotations

import os
from typing import Any

import torch

from visiontrain.core.config import Config, ConfigError
from visiontrain.core.cores import usable_cores

#: The most workers auto gives one process
MAX_AUTO_WORKERS = 16
#: The largest share of the GPU's free memory an in-memory set may take to be kept there
ON_DEVICE_SHARE = 0.25


def device_type(trainer_device: str) -> str:
    """The kind of device ``trainer.device`` gives this process ("cuda" or "cpu"), known before the
    process group and the device itself are set up."""
    cuda = trainer_device.startswith("cuda") or (trainer_device == "auto" and torch.cuda.is_available())
    return "cuda" if cuda else "cpu"


def auto_workers(cores: int, device_type: str, local_processes: int, in_memory: bool) -> int:
    """``data.num_workers: auto`` for a process on ``device_type`` that shares ``cores`` with
    ``local_processes - 1`` others."""
    if in_memory:
        return 0
    mine = max(1, cores // max(1, local_processes))
    if device_type == "cuda":
        return max(1, min(mine - 1, MAX_AUTO_WORKERS))
    return max(1, mine // 4)


def choose_workers(cfg: Config, device_type: str) -> str | None:
    """Sets ``cfg.data.num_workers`` to a number where it is auto (in place: the task reads the same
    section) and returns the line that says so; None where the config named a number."""
    d = cfg.data
    if d.num_workers != "auto":
        return None
    cores, local = usable_cores(), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    d.num_workers = auto_workers(cores, device_type, local, type(d).in_memory)
    if type(d).in_memory:
        why = f"data.name={d.name} is held in memory"
    else:
        shared = f", shared by {local} processes" if local > 1 else ""
        where = "a GPU" if device_type == "cuda" else "the step on the CPU"
        why = f"{cores} core{'s' if cores > 1 else ''}{shared}, {where}"
    return f"data.num_workers=auto: {d.num_workers} ({why})"


def keeps_on_device(setting: Any, device: torch.device, workers: int, nbytes: int, free_bytes: int | None) -> bool:
    """``data.on_device`` resolved: auto keeps the set on a GPU when it loads in this process
    (workers cannot reach the GPU's memory) and takes at most ``ON_DEVICE_SHARE`` of what is free."""
    if setting == "auto":
        return device.type == "cuda" and workers == 0 and free_bytes is not None \
            and nbytes <= ON_DEVICE_SHARE * free_bytes
    if setting and workers > 0:
        raise ConfigError(f"data.on_device=true keeps the set in the device's memory, which DataLoader workers "
                          f"cannot read: set data.num_workers=0 (got {workers}), or data.on_device=auto")
    return bool(setting)


def free_device_memory(device: torch.device) -> int | None:
    """Bytes free on a GPU now; None elsewhere."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)

