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


def test_a_prefetched_batch_is_not_moved_again_by_the_step(monkeypatch):
    """On CUDA the prefetcher has already placed the batch (device, channels_last): the step must
    not walk it a second time. Shown on the CPU by counting the step's calls to ``to_device``."""
    from visiontrain.engine import step as step_module
    from visiontrain.engine.metrics import StepRecorder
    from visiontrain.engine.prefetch import prefetches

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
        step = step_module.TrainStep(model, losses, opt, device=torch.device("cpu"), precision="fp32", scaler=None,
                                     clip_grad=None, clip_mode="norm", channels_last=True, after_backward=[],
                                     recorder=StepRecorder(4, torch.device("cpu")), placed=placed)
        step([(torch.randn(2, 3), torch.randn(2, 1))], {"mse": 1.0})
        assert bool(calls) == moved  # (the walk recurses: any call means the batch was walked)
