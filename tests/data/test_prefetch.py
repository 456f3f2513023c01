"""The side-stream prefetcher: its iterator logic in the suite, with torch's CPU stream stand-ins;
on a GPU (benchmarks/gpu_check.py runs the file with ``-m cuda``) the real side stream, pinned
memory and the caching allocator's reuse of a prefetched batch's memory."""
from __future__ import annotations

import pytest
import torch

from devices import TEST_DEVICE
from visiontrain.engine.step.prefetch import DevicePrefetcher, device_batches

pytestmark = pytest.mark.cuda


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


def batches(n, pinned=False):
    def t(x):
        return x.pin_memory() if pinned else x

    return [(t(torch.full((2, 3, 4, 4), float(i))), {"labels": t(torch.tensor([i, i]))}, [t(torch.tensor(i))])
            for i in range(n)]


def test_yields_every_batch_in_order_keeping_one_copy_ahead():
    source = Counted(batches(4, pinned=TEST_DEVICE.type == "cuda"))
    pre = DevicePrefetcher(source, TEST_DEVICE)
    assert source.pulled == 1  # the first copy is queued at once
    out = []
    for b in pre:
        out.append(b)
        assert source.pulled == min(len(out) + 1, 4)  # exactly one batch ahead, never more
    assert {b[0].device.type for b in out} == {b[1]["labels"].device.type for b in out} == {TEST_DEVICE.type}
    assert [int(b[0][0, 0, 0, 0]) for b in out] == [0, 1, 2, 3]
    assert [int(b[1]["labels"][0]) for b in out] == [0, 1, 2, 3] and int(out[2][2][0]) == 2
    assert next(pre, "end") == "end"


def test_an_empty_loader_stops_at_once():
    assert list(DevicePrefetcher(Counted([]), TEST_DEVICE)) == []


def test_channels_last_is_applied_to_images_only():
    (images, target, extra), = list(DevicePrefetcher(Counted(batches(1)), TEST_DEVICE, channels_last=True))
    assert images.is_contiguous(memory_format=torch.channels_last) and target["labels"].shape == (2,)


def test_batches_consumed_while_the_next_copies_keep_their_values():
    """Each batch is read by work queued on the compute stream while the copy of the next one runs
    on the side stream, and is freed after: if the allocator gave a batch's memory to a later copy
    before the compute stream was done with it (a missing ``record_stream``), sums would mix."""
    n, size = 24, (8, 3, 64, 64)
    source = Counted([(torch.full(size, float(i)).pin_memory() if TEST_DEVICE.type == "cuda" else
                       torch.full(size, float(i)),) for i in range(n)])
    sums = []
    weight = torch.randn(3, 3, 3, 3, device=TEST_DEVICE)
    for (images,) in DevicePrefetcher(source, TEST_DEVICE):
        work = torch.nn.functional.conv2d(images, weight, padding=1)  # keeps the compute stream busy
        sums.append(images.sum() + 0 * work.sum())
        del images, work  # freed while later copies are queued
    expected = [float(i) * torch.Size(size).numel() for i in range(n)]
    assert [float(s) for s in sums] == expected


def test_the_cpu_gets_the_loader_iterator_itself():
    source = Counted(batches(2))
    assert device_batches(source, torch.device("cpu"), prefetch=True) is source
    assert device_batches(source, torch.device("cuda"), prefetch=False) is source


def test_a_prefetched_batch_is_not_moved_again_by_the_step(monkeypatch):
    """On CUDA the prefetcher has already placed the batch (device, channels_last): the step must
    not walk it a second time. Shown on the CPU by counting the step's calls to ``to_device``."""
    from visiontrain.engine.step import pipeline as step_module
    from visiontrain.engine.step.metrics import StepRecorder
    from visiontrain.engine.step.prefetch import prefetches

    assert prefetches(torch.device("cuda"), True) and not prefetches(torch.device("cpu"), True)
    assert not prefetches(torch.device("cuda"), False)
    calls = []
    real = step_module.to_device
    monkeypatch.setattr(step_module, "to_device", lambda *a: calls.append(1) or real(*a))
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def losses(m, batch):
        return {"mse": (m(batch[0]) - batch[1]).pow(2).mean()}

    for placed, moved in ((False, True), (True, False)):
        calls.clear()
        options = step_module.StepOptions(torch.device("cpu"), channels_last=True, placed=placed)
        step = step_module.TrainStep(model, losses, opt, options, recorder=StepRecorder(4, torch.device("cpu")))
        step([(torch.randn(2, 3), torch.randn(2, 1))], {"mse": 1.0})
        assert bool(calls) == moved  # (the walk recurses: any call means the batch was walked)


def test_one_channel_batches_get_nhwc_strides_too():
    """For one channel ``contiguous(memory_format=channels_last)`` keeps NCHW strides (the bytes are
    the same), and a convolution then runs the network in NCHW against channels_last weights: on an
    H200 that cost ResNet-50 on grey images 11-18 % of its speed. The batch is re-strided (a view)."""
    from visiontrain.data.batch_ops import channels_last
    from visiontrain.engine.step.pipeline import to_device

    grey = torch.arange(2 * 1 * 3 * 4, dtype=torch.float32).reshape(2, 1, 3, 4)
    assert grey.contiguous(memory_format=torch.channels_last).stride() == (12, 12, 4, 1)  # torch's own: NCHW
    nhwc = channels_last(grey)
    assert nhwc.stride() == (12, 1, 4, 1) and torch.equal(nhwc, grey) and nhwc.data_ptr() == grey.data_ptr()
    weight = torch.randn(5, 1, 3, 3).contiguous(memory_format=torch.channels_last)
    out = torch.nn.functional.conv2d(nhwc, weight, padding=1)
    assert out.is_contiguous(memory_format=torch.channels_last) and out.stride(1) == 1  # NHWC from the first layer
    rgb = torch.randn(2, 3, 4, 4)
    assert channels_last(rgb).stride() == rgb.contiguous(memory_format=torch.channels_last).stride()
    placed = to_device((grey, torch.tensor([0, 1])), TEST_DEVICE, channels_last=True)
    assert placed[0].stride() == (12, 1, 4, 1) and placed[1].shape == (2,)
