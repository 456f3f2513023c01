"""The side-stream prefetcher's iterator logic, run with torch's CPU stream stand-ins (the CUDA
stream semantics themselves are torch's; this task's machines have no GPU)."""
from __future__ import annotations

import torch

from visiontrain.engine.prefetch import DevicePrefetcher, device_batches


class Counted:
    def __init__(self, items):
        self.items, self.pulled = list(items), 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.pulled == len(self.items):
            raise StopIteration
        self.pulled += 1
        return self.items[self.pulled - 1]


def batches(n):
    return [(torch.full((2, 3, 4, 4), float(i)), {"labels": torch.tensor([i, i])}, [torch.tensor(i)])
            for i in range(n)]


def test_yields_every_batch_in_order_keeping_one_copy_ahead():
    source = Counted(batches(4))
    pre = DevicePrefetcher(source, torch.device("cpu"))
    assert source.pulled == 1  # the first copy is queued at once
    out = []
    for b in pre:
        out.append(b)
        assert source.pulled == min(len(out) + 1, 4)  # exactly one batch ahead, never more
    assert [int(b[0][0, 0, 0, 0]) for b in out] == [0, 1, 2, 3]
    assert [int(b[1]["labels"][0]) for b in out] == [0, 1, 2, 3] and int(out[2][2][0]) == 2
    assert next(pre, "end") == "end"


def test_an_empty_loader_stops_at_once():
    assert list(DevicePrefetcher(Counted([]), torch.device("cpu"))) == []


def test_channels_last_is_applied_to_images_only():
    (images, target, extra), = list(DevicePrefetcher(Counted(batches(1)), torch.device("cpu"), channels_last=True))
    assert images.is_contiguous(memory_format=torch.channels_last) and target["labels"].shape == (2,)


def test_the_cpu_gets_the_loader_iterator_itself():
    source = Counted(batches(2))
    assert device_batches(source, torch.device("cpu"), prefetch=True) is source
    assert device_batches(source, torch.device("cuda"), prefetch=False) is source
