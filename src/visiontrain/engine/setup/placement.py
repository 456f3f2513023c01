"""Where the run computes: this rank's device, the seeds, and the module the step calls (DDP, or the
model sharded by FSDP2 with its sharded checkpoints)."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn

from visiontrain.core.config import Config, ConfigError
from visiontrain.engine.parallel.distributed import DistInfo, wrap_ddp
from visiontrain.engine.parallel.fsdp import shard_model
from visiontrain.engine.state.sharded import ShardedCheckpoints


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
    """The module the step calls, the sharded checkpoints (``distributed.strategy=fsdp``) and the FSDP
    unit names. FSDP shards ``model`` (and the EMA copy) in place: build the optimizer after this.
    On one process FSDP shards nothing, but its checkpoints keep their sharded format (one shard
    a tensor), so a run moves between one process and several in either direction."""
    if not uses_fsdp(cfg, dist_info):
        wrapped = wrap_ddp(model, dist_info, device, find_unused_parameters=task.find_unused_parameters)
        one_shard = ShardedCheckpoints(ckpt_dir, dist_info) if cfg.distributed.strategy == "fsdp" else None
        return wrapped, one_shard, None
    units = shard_model(model, dist_info, device, cfg.distributed, [ema.module] if ema is not None else [])
    return model, ShardedCheckpoints(ckpt_dir, dist_info), units


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
