"""Per-step scalars recorded on the device, read by the host once per log point.

A step hands over its named 0-dim device scalars (loss terms, total, grad norm); the recorder only
keeps references to them, so recording launches no kernel and reads nothing. At a log point (or
before a checkpoint or an evaluation) every kept scalar is stacked in one kernel and moves to the
host with a single ``.tolist()``. Keeping every step's row, not just a running sum, is what lets
the non-finite policy name the exact step and every term of it without any per-step bookkeeping
on the device.
"""
from __future__ import annotations

from typing import Callable

import torch


FLAG = "found_inf"  # the key of each read row's skip flag (not a logged metric)


class StepRecorder:
    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity, self.device = capacity, device
        self.names: list[str] | None = None
        self.values: list[torch.Tensor] = []  # n rows of len(names) scalars, flattened
        # Each step's found_inf flag (see TrainStep): 0 until the step's non-finite check sets it,
        # read by the fused optimizer; the filled cells are zeroed again at each read.
        self.flag_buf = torch.zeros(capacity, dtype=torch.float32, device=device)
        self.flags = self.flag_buf.unbind(0)  # views, bound once: handing one out costs no kernel
        self.n = 0

    def record(self, names: list[str], values: list[torch.Tensor]) -> torch.Tensor:
        """Keep one row (``values[i]`` named ``names[i]``, same names every step); returns the
        row's flag cell, a 0-dim device tensor holding 0.0."""
        if self.names is None:
            self.names = list(names)
        if self.n >= self.capacity:
            raise RuntimeError(f"more than {self.capacity} steps recorded without a read")
        self.values.extend(values)
        self.n += 1
        return self.flags[self.n - 1]

    def read(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[dict[str, float]]:
        """The rows recorded since the last read, as host dicts (one host sync), then empties. Each
        row also holds its step's ``found_inf`` flag (1.0: the step was skipped on the device)."""
        if not self.n or self.names is None:
            return []
        n, width = self.n, len(self.names)
        # one kernel for all rows; bf16/fp16 terms are promoted with the rest to fp32
        rows = torch.stack(self.values).float().view(n, width)
        filled = torch.cat([rows, self.flag_buf[:n, None]], dim=1)
        if reduce is not None:
            filled = reduce(filled)  # mean over ranks: one collective per read
        host = filled.tolist()  # host sync (log point / checkpoint / evaluation)
        self.flag_buf[:n].zero_()
        self.values, self.n = [], 0
        return [{**dict(zip(self.names, row)), FLAG: row[-1]} for row in host]


class EpochMeans:
    """An epoch's means of the logged values, from the window means already read at log points:
    host floats only, no extra sync. Checkpointed, so a resumed epoch's table counts every step."""

    def __init__(self) -> None:
        self.sums: dict[str, tuple[float, int]] = {}  # key -> (sum of window mean x steps, steps)

    def add(self, values: dict[str, float], n: int) -> None:
        for k, v in values.items():
            total, count = self.sums.get(k, (0.0, 0))
            self.sums[k] = (total + v * n, count + n)

    def pop(self) -> dict[str, float]:
        means = {k: total / max(n, 1) for k, (total, n) in self.sums.items()}
        self.sums = {}
        return means

    def state_dict(self) -> dict[str, list]:
        return {k: [v, n] for k, (v, n) in self.sums.items()}

    def load_state_dict(self, state: dict[str, list]) -> None:
        self.sums = {k: (float(v), int(n)) for k, (v, n) in state.items()}
