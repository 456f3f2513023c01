"""The next batch copied to the accelerator on a side stream while the current step computes.

A plain ``batch.to(device, non_blocking=True)`` at the top of the step queues the copy on the
compute stream, behind nothing but ahead of the forward: the GPU idles for the copy's length every
step. Here the copy of batch k+1 is queued on a second stream as soon as batch k is handed over,
so it runs under batch k's kernels. Three rules make that safe:

- the loader pins its memory (``data.pin_memory``), else the "asynchronous" copy is synchronous;
- the compute stream waits for the copy stream before it touches a prefetched batch;
- every prefetched tensor is marked as used by the compute stream (``record_stream``), so the
  caching allocator does not hand its memory to the copy of the next batch while it is in use.

Nothing here reads a device value: prefetching adds no host sync. The loader is asked for one batch
ahead; that does not affect resume, which restarts the loader at the step's batch.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

from visiontrain.engine.step.pipeline import to_device


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from _tensors(v)


class DevicePrefetcher:
    """Wraps a loader iterator: yields batches already on ``device``, one copy always in flight."""

    def __init__(self, batches: Iterator[Any], device: torch.device, channels_last: bool = False) -> None:
        self.batches, self.device, self.channels_last = batches, device, channels_last
        self.streams = torch.get_device_module(device.type)
        self.copy_stream = self.streams.Stream(device)
        self.ahead: Any = None
        self.done = False
        self._queue_next()

    def _queue_next(self) -> None:
        try:
            batch = next(self.batches)
        except StopIteration:
            self.done, self.ahead = True, None
            return
        with self.streams.stream(self.copy_stream):
            self.ahead = to_device(batch, self.device, self.channels_last)

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> Any:
        if self.done:
            raise StopIteration
        compute = self.streams.current_stream(self.device)
        compute.wait_stream(self.copy_stream)  # a GPU-side wait: the host does not block
        batch = self.ahead
        if self.device.type != "cpu":  # (CPU tensors have no streams to record)
            for t in _tensors(batch):
                t.record_stream(compute)
        self._queue_next()
        return batch


def prefetches(device: torch.device, prefetch: bool) -> bool:
    """Whether :func:`device_batches` hands over batches already on ``device`` (and channels_last):
    then the step moves nothing again."""
    return prefetch and device.type != "cpu"


def device_batches(batches: Iterator[Any], device: torch.device, *, prefetch: bool,
                   channels_last: bool = False) -> Iterator[Any]:
    """The loader's batches, prefetched to the accelerator where there is one (CUDA: a side
    stream); on the CPU, as they come (they are already where the step needs them)."""
    if not prefetches(device, prefetch):
        return batches
    return DevicePrefetcher(batches, device, channels_last)
