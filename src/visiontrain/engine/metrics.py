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


class StepRecorder:
    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity, self.device = capacity, device
        self.names: list[str] | None = None
        self.n = 0

    def _allocate(self, names: list[str]) -> None:
        self.names = names
        self.buf = torch.zeros(self.capacity, len(names), dtype=torch.float32, device=self.device)
        self.rows = self.buf.unbind(0)  # views, bound once: writing a row is one stack kernel

    def record(self, values: dict[str, torch.Tensor]) -> None:
        if self.names is None:
            self._allocate(list(values))
        elif len(values) != len(self.names) or any(a != b for a, b in zip(values, self.names)):
            raise ValueError(f"the step's scalars changed from {self.names} to {list(values)}: a task's "
                             f"losses() must return the same terms every step")
        if self.n >= self.capacity:
            raise RuntimeError(f"more than {self.capacity} steps recorded without a read")
        torch.stack(list(values.values()), out=self.rows[self.n])
        self.n += 1

    def read(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> list[dict[str, float]]:
        """The rows recorded since the last read, as host dicts (one host sync), then empties."""
        if not self.n or self.names is None:
            return []
        filled = self.buf[: self.n]
        if reduce is not None:
            filled = reduce(filled)  # mean over ranks: one collective per read
        host = filled.tolist()  # host sync (log point / checkpoint / evaluation)
        self.n = 0
        return [dict(zip(self.names, row)) for row in host]
