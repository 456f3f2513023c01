"""Process-group set-up from torchrun's environment, DDP wrapping, rank-0 I/O, reductions.

With no torchrun variables this is a single process and every helper is a no-op.
"""
from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Literal

import torch
import torch.distributed as dist
from torch import nn

from visiontrain.core.config import register_section
from visiontrain.core.typed_config import doc


@dataclass
class DistributedConfig:
    strategy: Literal["ddp", "fsdp"] = doc(
        "under torchrun: ddp replicates the model (DistributedDataParallel); fsdp shards parameters, "
        "gradients and optimizer state over the ranks (FSDP2 fully_shard), checkpoints sharded (DCP)", "ddp")
    fsdp_units: list[str] = doc(
        "fsdp: regexes of module names each sharded as its own unit, gathered only around its forward "
        "and backward (default: every block of a list of repeated blocks, e.g. a ViT's blocks.N)", factory=list)
    fsdp_reshard_after_forward: bool = doc(
        "fsdp: free each unit's gathered parameters after its forward (least memory); false keeps them "
        "until its backward (one all-gather fewer per unit, more memory)", True)


register_section("distributed", DistributedConfig, "multi-process section (torchrun)")


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device_kind: str) -> DistInfo:
    """Join torchrun's process group (NCCL on GPU, gloo on CPU) when WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    info = DistInfo(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        backend = "nccl" if device_kind == "cuda" else "gloo"
        if device_kind == "cuda":
            torch.cuda.set_device(info.local_rank)
        dist.init_process_group(backend=backend)
    return info


def wrap_ddp(model: nn.Module, info: DistInfo, device: torch.device,
             find_unused_parameters: bool = False) -> nn.Module:
    if not info.enabled:
        return model
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids,
                                               find_unused_parameters=find_unused_parameters)


def grad_sync_paused(model: nn.Module) -> Callable[[], ContextManager] | None:
    """What pauses the gradient reduction on non-final micro-batches of an accumulated step:
    DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync(False)``; None for a plain module."""
    if hasattr(model, "no_sync"):
        return model.no_sync
    if hasattr(model, "set_requires_gradient_sync"):
        @contextlib.contextmanager
        def paused() -> Iterator[None]:
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        return paused
    return None


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """Rank 0's value on every rank (a collective and a host sync: evaluation and checkpoints only)."""
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def sync_buffers(modules: list[nn.Module | None], info: DistInfo) -> None:
    """Rank 0's buffers (BatchNorm running statistics) on every rank: a collective that every rank
    runs before an evaluation and before a checkpoint, never between steps.

    The parameters are the same on every rank (DDP averages the gradients, FSDP shards them); the
    buffers are not: each rank's forward updates them from its own batch, and each rank's EMA
    averages its own. DDP broadcasts rank 0's model buffers as each forward starts; nothing
    broadcasts the EMA's. Left so, a sharded evaluation measures another model on each rank, and a
    resumed run's ranks, which all read rank 0's checkpoint, go on from other buffers than an
    uninterrupted run's did. Rank 0's are what the checkpoint holds."""
    if not info.enabled:
        return
    for module in modules:
        for buffer in module.buffers() if module is not None else ():
            dist.broadcast(buffer, src=0)


def convert_sync_bn(model: nn.Module, info: DistInfo, device: torch.device) -> nn.Module:
    """BatchNorm -> SyncBatchNorm under DDP (``trainer.sync_bn``); a model without BN is unchanged.
    torch's SyncBatchNorm has no CPU kernel, so a CPU run with BN layers is refused at start-up
    rather than failing at its first training step."""
    if not info.enabled:
        return model
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if device.type == "cpu" and any(isinstance(m, nn.SyncBatchNorm) for m in model.modules()):
        raise ValueError("trainer.sync_bn=true: torch's SyncBatchNorm runs on GPUs only and this run is on "
                         "the CPU; set trainer.sync_bn=false (each rank then keeps its own batch statistics)")
    return model


def all_reduce_mean(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Mean over ranks (log points and evaluation only: a collective is a sync point)."""
    if info.enabled:
        t = t.clone()
        dist.all_reduce(t)
        t /= info.world_size
    return t


def real_samples(loader: Any) -> int | None:
    """How many of this rank's evaluation samples are the data set's own; None: all of them.

    The evaluation loader's ``DistributedSampler`` pads the set with repeats of its first samples
    so that every rank runs the same number of batches (under FSDP each forward is a collective).
    Rank r gets padded positions r, r + W, ..., so its repeats are its last samples: a task that
    counts only the first ``real_samples`` of its shard counts every sample once over all ranks."""
    from torch.utils.data.distributed import DistributedSampler

    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last:
        return None
    return len(range(sampler.rank, len(sampler.dataset), sampler.num_replicas))  # type: ignore[arg-type]


#: How a collective or the rendezvous store fails when another rank is gone: gloo's and NCCL's words
#: (a plain RuntimeError from DDP's reducer, or torch's DistError subclasses) and the TCP store's.
PEER_LOST_WORDS = ("gloo/", "NCCL", "TCPStore", "Connection closed by peer", "Connection reset by peer",
                   "Broken pipe")


class PeerLost(RuntimeError):
    """This rank stopped because another rank of the run is gone; the message says what to do."""


def lost_peer(err: BaseException) -> bool:
    """Whether ``err`` is a collective (or the store) failing because another rank is gone."""
    if not dist.is_available() or not dist.is_initialized() or not isinstance(err, RuntimeError):
        return False
    return isinstance(err, dist.DistError) or any(words in str(err) for words in PEER_LOST_WORDS)


def shutdown(*, barrier: bool = True) -> None:
    """Leave the process group (torchrun runs): every rank, after its last collective.

    Objects that hold the group must be gone before it is destroyed: a DDP reducer that outlives it
    aborts the process at exit ("terminate called without an active exception"). The trainer is
    kept alive only by reference cycles (its hooks point back to it) once the caller drops it, so
    they are collected first. The barrier makes the ranks leave together (rank 0 still writes files
    after the last collective); after an error on one rank the others may never arrive, so the
    error paths leave without it."""
    if dist.is_initialized():
        gc.collect()
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
