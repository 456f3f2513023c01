"""Per-step scalars recorded on the device, read by the host once per log point.

Each step's named scalars (loss terms, total, grad norm) are stacked straight into row ``i`` of a
``[log_every, n]`` device buffer: one kernel, no host read. At a log point (or before a checkpoint
or an evaluation) the filled rows move to the host with a single ``.tolist()``. Keeping every step's
row, not just a running sum, is what lets the non-finite policy name the exact step and every term
of it without any per-step bookkeeping on the device.
"""
from __future__ import annotations

from typing import Callable

import torch


FLAG = "found_inf"  # the key of each read row's skip flag (not a logged metric)


class StepRecorder:
    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity, self.device = capacity, device
        self.names: list[str] | None = None
        self.n = 0

    def _allocate(self, names: list[str]) -> None:
        self.names = names
        # The last column is the step's found_inf flag (see TrainStep): written as 0 with the row,
        # set to 1 on the device by the non-finite check, read by the fused optimizer.
        self.buf = torch.zeros(self.capacity, len(names) + 1, dtype=torch.float32, device=self.device)
        self.rows = self.buf.unbind(0)  # views, bound once: writing a row is one stack kernel
        self.flags = self.buf[:, -1].unbind(0)
        self._zero = torch.zeros((), device=self.device)

    def record(self, names: list[str], values: list[torch.Tensor]) -> torch.Tensor:
        """Write one row (``values[i]`` named ``names[i]``, same names every step); returns the
        row's flag cell, a 0-dim device tensor holding 0.0."""
        if self.names is None:
            self._allocate(list(names))
        if self.n >= self.capacity:
            raise RuntimeError(f"more than {self.capacity} steps recorded without a read")
        values.append(self._zero)
        torch.stack(values, out=self.rows[self.n])  # dtype promotion casts bf16/fp16 values to fp32
        self.n += 1
        return self.flags[self.n - 1]

    def read(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[dict[str, float]]:
        """The rows recorded since the last read, as host dicts (one host sync), then empties. Each
        row also holds its step's ``found_inf`` flag (1.0: the step was skipped on the device)."""
        if not self.n or self.names is None:
            return []
        filled = self.buf[: self.n]
        if reduce is not None:
            filled = reduce(filled)  # mean over ranks: one collective per read
        host = filled.tolist()  # host sync (log point / checkpoint / evaluation)
        self.n = 0
        return [{**dict(zip(self.names, row)), FLAG: row[-1]} for row in host]
