"""StepRecorder: rows come back exactly as recorded, whatever the chunking and column sharing."""
from __future__ import annotations

import pytest
import torch

from visiontrain.engine.step import metrics
from visiontrain.engine.step.metrics import StepRecorder


@pytest.mark.parametrize("steps", [1, 9, 10, 23, 50])
def test_rows_read_back_across_chunks_with_a_shared_column(steps):
    rec = StepRecorder(capacity=50, device=torch.device("cpu"))
    expected = []
    for s in range(steps):
        a, b = torch.tensor(float(s)), torch.tensor(s + 0.5, dtype=torch.bfloat16)
        rec.record(["a", "b", "total"], [a, b], columns=[0, 1, 0])
        expected.append([float(s), s + 0.5, float(s)])
    read = rec.read()
    assert read.names == ["a", "b", "total"]
    assert read.rows == expected and read.flags == [0.0] * steps
    assert rec.n == 0 and not rec.values and not rec.chunks
    assert rec.read().rows == []  # nothing recorded since


def test_flags_are_read_and_zeroed_only_once_handed_out(monkeypatch):
    monkeypatch.setattr(metrics, "CHUNK", 4)
    rec = StepRecorder(capacity=8, device=torch.device("cpu"))
    for s in range(6):
        rec.record(["loss"], [torch.tensor(float(s))])
        if s == 2:
            rec.flag().fill_(1.0)  # what the non-finite check does on the device
    read = rec.read()
    assert read.rows == [[float(s)] for s in range(6)]
    assert read.flags == [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert rec.flag_buf.sum().item() == 0.0  # zeroed for the next window
    rec.record(["loss"], [torch.tensor(7.0)])
    assert rec.read().flags == [0.0]


def test_more_steps_than_the_capacity_is_an_error():
    rec = StepRecorder(capacity=2, device=torch.device("cpu"))
    for _ in range(2):
        rec.record(["x"], [torch.tensor(1.0)])
    with pytest.raises(RuntimeError, match="more than 2 steps recorded without a read"):
        rec.record(["x"], [torch.tensor(1.0)])
