"""Per-step scalars recorded on the device, read by the host once per log point.

A step hands over its named 0-dim device scalars (loss terms, total, grad norm); the recorder only
keeps references to them, so recording launches no kernel and reads nothing. At a log point (or
before a checkpoint or an evaluation) every kept scalar is stacked in one kernel and moves to the
host with a single ``.tolist()``. Keeping every step's row, not just a running sum, is what lets
the non-finite policy name the exact step and every term of it without any per-step bookkeeping
on the device.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch


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

    def read(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Rows:
        """The rows recorded since the last read, on the host (one host sync), then empties. Each
        row's ``found_inf`` flag (1.0: the step was skipped on the device) comes in ``flags``."""
        if not self.n or self.names is None:
            return Rows([], [], [])
        n, width = self.n, len(self.names)
        # one kernel for all rows; bf16/fp16 terms are promoted with the rest to fp32
        rows = torch.stack(self.values).float().view(n, width)
        filled = torch.cat([rows, self.flag_buf[:n, None]], dim=1)
        if reduce is not None:
            filled = reduce(filled)  # mean over ranks: one collective per read
        host = filled.tolist()  # host sync (log point / checkpoint / evaluation)
        self.flag_buf[:n].zero_()
        self.values, self.n = [], 0
        return Rows(self.names, [row[:-1] for row in host], [row[-1] for row in host])


class Rows(NamedTuple):
    """Read rows as host lists: ``rows[i][j]`` is step i's value of ``names[j]``. Plain lists, not
    one dict per step: the log point only needs column means, and a dict is built for a bad step."""
    names: list[str]
    rows: list[list[float]]
    flags: list[float]


class PendingRows:
    """Rows read from the device and not yet logged. Checkpointed (as one dict per step), so a
    window cut by a checkpoint and a resume still logs every one of its steps."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.rows: list[list[float]] = []

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, read: Rows) -> None:
        if read.rows:
            self.names = read.names
            self.rows.extend(read.rows)

    def pop_means(self) -> tuple[int, dict[str, float]]:
        """(number of rows, each column's mean), then empties."""
        n, rows = len(self.rows), self.rows
        self.rows = []
        return n, {k: math.fsum(column) / n for k, column in zip(self.names, zip(*rows))} if n else {}

    def state_dict(self) -> list[dict[str, float]]:
        return [dict(zip(self.names, r)) for r in self.rows]

    def load_state_dict(self, state: list[dict[str, float]]) -> None:
        self.names = list(state[0]) if state else []
        self.rows = [[float(r[k]) for k in self.names] for r in state]


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
