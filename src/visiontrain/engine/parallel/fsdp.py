"""FSDP2 (``distributed.strategy=fsdp``): sharding a model over the ranks.

Sharding. ``fully_shard`` makes each unit's parameters DTensors sharded on dim 0; a unit's full
parameters exist only around its forward and backward (an all-gather before, a reduce-scatter of
its gradients after). The units are the blocks of the model's lists of repeated blocks unless
``distributed.fsdp_units`` names them; the root is always one. The EMA copy (DINO's teacher) is
sharded the same way, so its update lerps local shards with no communication.

Its checkpoints are ``engine.state.sharded``'s.
"""
from __future__ import annotations

import re
import sys

import torch
from torch import nn

from visiontrain.engine.parallel.distributed import DistInfo, DistributedConfig


def _dtensor() -> type | None:
    """torch's DTensor class once something has imported it (FSDP does), else None: no tensor can be
    one before that. Importing ``torch.distributed.tensor`` costs 1.3 s of every process's start-up
    on a 2-core machine, so a run that shards nothing never does."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (shares its storage; call under no_grad to write into it), else t."""
    dtensor = _dtensor()
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t


def is_sharded(tensors: list[torch.Tensor]) -> bool:
    dtensor = _dtensor()
    return dtensor is not None and any(isinstance(t, dtensor) for t in tensors)


def block_units(model: nn.Module) -> list[str]:
    """Names of the blocks of every ModuleList/Sequential of >= 2 same-class, non-leaf modules:
    transformer blocks, ResNet bottlenecks, DETR layers. A conv-bn-relu Sequential is not one."""
    names = []
    for prefix, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) < 2:
            continue
        kids = list(container.named_children())
        if len({type(m) for _, m in kids}) == 1 and all(next(m.children(), None) is not None for _, m in kids):
            names += [f"{prefix}.{n}" if prefix else n for n, _ in kids]
    return names


def pick_units(model: nn.Module, patterns: list[str]) -> list[str]:
    if not patterns:
        return block_units(model)
    names = [n for n, _ in model.named_modules() if n and any(re.fullmatch(p, n) for p in patterns)]
    if not names:
        raise ValueError(f"distributed.fsdp_units={patterns}: no module name matches; names look like "
                         f"{[n for n, _ in model.named_modules() if n][:8]}")
    return names


def shard_model(model: nn.Module, info: DistInfo, device: torch.device, cfg: DistributedConfig,
                copies: list[nn.Module] = ()) -> list[str]:
    """fully_shard the units (deepest first) and the root of ``model`` and of each copy (the EMA),
    in place. Returns the unit names."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (info.world_size,))
    units = pick_units(model, cfg.fsdp_units)
    order = sorted(units, key=lambda n: -n.count("."))
    for m in (model, *copies):
        for name in order:
            fully_shard(m.get_submodule(name), mesh=mesh, reshard_after_forward=cfg.fsdp_reshard_after_forward)
        fully_shard(m, mesh=mesh, reshard_after_forward=False)  # backward starts with the root: keep it
    return units


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every rank calls (a gather); rank 0 gets the full tensors on the CPU, the others {}."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
