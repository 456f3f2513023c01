"""Per-step scalars recorded on the device, read by the host once per log point.

A step hands over its named 0-dim device scalars (loss terms, total, grad norm); the recorder
keeps references to them and stacks every ``CHUNK`` steps' worth in one kernel, so recording
reads nothing. At a log point (or before a checkpoint or an evaluation) the stacked rows are joined
in one kernel and move to the host with a single ``.tolist()``. Keeping every step's row, not just
a running sum, is what lets the non-finite policy name the exact step and every term of it
without any per-step bookkeeping on the device.
"""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

import torch


#: Steps whose 0-dim scalars are stacked together as soon as they are all recorded. Holding a
#: few hundred separate scalars until the log point costs the CPU more than stacking them in
#: small groups (the many small blocks they keep alive; see BENCHMARKS.md, "Engine overhead").
CHUNK = 10


class StepRecorder:
    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity, self.device = capacity, device
        self.names: list[str] | None = None
        self.columns: list[int] | None = None  # names[j] is value columns[j] of a row; None: j
        self._column_index: torch.Tensor | None = None  # the same on the device, made at a read
        self.width = 0
        self.values: list[torch.Tensor] = []  # the rows since the last chunk, flattened
        self.chunks: list[torch.Tensor] = []  # earlier rows, stacked CHUNK rows at a time
        # Each step's found_inf flag (see TrainStep): 0 until the step's non-finite check sets it,
        # read by the fused optimizer; the filled cells are zeroed again at a read that saw one set.
        self.flag_buf = torch.zeros(capacity, dtype=torch.float32, device=device)
        self.flags = self.flag_buf.unbind(0)  # views, bound once: handing one out costs no kernel
        self.flags_used = False  # no cell handed out: the read neither copies nor zeroes them
        self.n = 0

    def record(self, names: list[str], values: list[torch.Tensor], columns: list[int] | None = None) -> None:
        """Keep one row: ``names[j]`` is ``values[columns[j]]`` (``values[j]`` without columns; the
        same names, columns and width every step). A value two names share (the total, when it is
        the only weighted loss term) is kept, and stacked, once."""
        if self.names is None:
            self.names, self.width = list(names), len(values)
            if columns is not None and columns != list(range(len(values))):
                self.columns = list(columns)
        if self.n >= self.capacity:
            raise RuntimeError(f"more than {self.capacity} steps recorded without a read")
        self.values.extend(values)
        self.n += 1
        if self.n % CHUNK == 0:  # one stack kernel per CHUNK steps; see CHUNK
            self.chunks.append(torch.stack(self.values))
            self.values = []

    def flag(self) -> torch.Tensor:
        """The last recorded row's flag cell: a 0-dim device tensor holding 0.0."""
        self.flags_used = True
        return self.flags[self.n - 1]

    def read(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Rows:
        """The rows recorded since the last read, on the host (one host sync), then empties. Each
        row's ``found_inf`` flag (1.0: the step was skipped on the device) comes in ``flags``."""
        if not self.n or self.names is None:
            return Rows([], [], [])
        n = self.n
        # the stacked chunks and the rest in one kernel; bf16/fp16 terms are promoted to fp32
        rows = torch.cat([*self.chunks, *([torch.stack(self.values)] if self.values else [])])
        rows = rows.float().view(n, self.width)
        if self.columns is not None:
            if self._column_index is None:  # (a copy to the device, here where the host waits anyway)
                self._column_index = torch.tensor(self.columns, device=self.device)
            rows = rows.index_select(1, self._column_index)
        if self.flags_used:
            rows = torch.cat([rows, self.flag_buf[:n, None]], dim=1)
        if reduce is not None:
            rows = reduce(rows)  # mean over ranks: one collective per read
        host = rows.tolist()  # host sync (log point / checkpoint / evaluation)
        self.values, self.chunks, self.n = [], [], 0
        if not self.flags_used:
            return Rows(self.names, host, [0.0] * n)
        flags = [row.pop() for row in host]
        if any(flags):
            self.flag_buf[:n].zero_()
        return Rows(self.names, host, flags)


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
