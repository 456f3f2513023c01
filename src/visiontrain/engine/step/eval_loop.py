"""The engine's side of an evaluation: this rank's validation batches on the device, and the
reductions over ranks that turn per-rank counts or predictions into one metric.

A task's ``evaluate`` knows what to compute from a batch; where batches live (device, memory
format), which of them the distributed sampler made up, and how ranks combine are the engine's
business, so they are written once here instead of in every task.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch
import torch.distributed as torch_dist

from visiontrain.engine.parallel.distributed import DistInfo, real_samples
from visiontrain.engine.step.pipeline import to_device

__all__ = ["EvalData"]


class EvalData:
    """This rank's validation batches and the collectives of an evaluation.

    Iterating yields ``(batch, real)`` pairs: the batch as the loader gives it, every tensor in it
    (nested tuples, lists, dicts) on ``device``, 4-D ones channels_last when asked, as the training
    step moves its batches; ``real`` a slice of the batch's first dimension that leaves out the
    sampler's padding repeats (``real_samples``). The model runs on the whole batch and only its
    outputs are cut, ``outputs[real]``: under FSDP every forward is a collective, so a rank whose
    last batch is nothing but padding must still run it, and a detector cannot run on no images.

    The reductions go through ``dist`` rather than torch's process-group state, so a single-process
    evaluation (``dist.enabled`` false) never touches torch.distributed.
    """

    def __init__(self, loader: Iterable[Any], device: torch.device, dist: DistInfo, channels_last: bool) -> None:
        self.loader, self.device, self.dist, self.channels_last = loader, device, dist, channels_last

    @classmethod
    def local(cls, loader: Iterable[Any], device: torch.device | str = "cpu", channels_last: bool = False
              ) -> EvalData:
        """One process, no collectives: tests and tools that evaluate without the trainer, on any
        iterable of batches (a plain list will do)."""
        return cls(loader, torch.device(device), DistInfo(), channels_last)

    def over(self, loader: Iterable[Any]) -> EvalData:
        """The same device, ranks and memory format over another loader (DINO's k-NN bank)."""
        return EvalData(loader, self.device, self.dist, self.channels_last)

    def __iter__(self) -> Iterator[tuple[Any, slice]]:
        real, seen = real_samples(self.loader), 0
        for batch in self.loader:
            batch = to_device(batch, self.device, self.channels_last)
            if real is None:
                yield batch, slice(None)
                continue
            n = _batch_len(batch)  # (sizes are host metadata: no device read)
            keep, seen = max(0, min(n, real - seen)), seen + n
            yield batch, slice(None) if keep == n else slice(0, keep)

    # ------------------------------------------------------------------ reductions over ranks
    def sum_(self, *tensors: torch.Tensor) -> None:
        """Sum each tensor over the ranks, in place: every rank ends with the totals. Counts, not
        means, so that ranks with fewer real samples weigh what they hold."""
        if self.dist.enabled:
            for t in tensors:
                torch_dist.all_reduce(t)

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's rows concatenated in rank order, on every rank (ranks may hold different
        counts: the sizes are exchanged first and the rows padded to the largest)."""
        if not self.dist.enabled:
            return t
        n = torch.tensor([t.shape[0]], device=t.device)
        counts = [torch.zeros_like(n) for _ in range(self.dist.world_size)]
        torch_dist.all_gather(counts, n)
        sizes = [int(c) for c in counts]  # host sync (evaluation only)
        padded = torch.zeros((max(sizes), *t.shape[1:]), dtype=t.dtype, device=t.device)
        padded[: t.shape[0]] = t
        out = [torch.zeros_like(padded) for _ in sizes]
        torch_dist.all_gather(out, padded)
        return torch.cat([o[:s] for o, s in zip(out, sizes)])

    def gather(self, items: list[Any], dst: int | None = None) -> list[Any] | None:
        """Every rank's Python list concatenated in rank order (e.g. COCO detections).

        ``dst=None``: on every rank. ``dst=r``: on rank ``r`` only, the others get None (they have
        nothing to score and hold no copy of the whole set)."""
        if not self.dist.enabled:
            return items
        parts: list[Any] = [None] * self.dist.world_size
        if dst is None:
            torch_dist.all_gather_object(parts, items)
        else:
            torch_dist.gather_object(items, parts if self.dist.rank == dst else None, dst=dst)
            if self.dist.rank != dst:
                return None
        return [item for part in parts for item in part]


def _batch_len(batch: Any) -> int:
    """Samples in a collated batch: the first dimension of a tensor, or of the batch's first field
    (a batched tensor, or a per-sample list such as detection targets)."""
    if isinstance(batch, dict):
        batch = next(iter(batch.values()))
    elif isinstance(batch, (list, tuple)):
        batch = batch[0]
    return batch.shape[0] if isinstance(batch, torch.Tensor) else len(batch)
