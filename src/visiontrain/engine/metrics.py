"""Device-side accumulators: values stay on the accelerator until a log point reads them all at once.

``add`` is a handful of in-place adds with no host read. ``read`` stacks every sum into one tensor
and moves it to the host with a single ``.tolist()``: one sync per log point, not one per value.
How many times each name was added is host-side bookkeeping (known without reading the device).
"""
from __future__ import annotations

from typing import Callable

import torch


class DeviceMeter:
    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}

    def add(self, values: dict[str, torch.Tensor]) -> None:
        for name, value in values.items():
            total = self.sums.get(name)
            if total is None:
                self.sums[name] = value.detach().float().clone()
                self.counts[name] = 1
            else:
                total.add_(value.detach())
                self.counts[name] += 1

    def __bool__(self) -> bool:
        return bool(self.counts)

    def read(self, reset: bool = True,
             reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> dict[str, float]:
        """Means since the last reset. The one host sync of a log point."""
        if not self.sums:
            return {}
        names = list(self.sums)
        stacked = torch.stack([self.sums[n].reshape(()).float() for n in names])
        if reduce is not None:
            stacked = reduce(stacked)  # mean over ranks: one collective per log point
        host = stacked.tolist()  # host sync (log point)
        out = {n: v / self.counts[n] for n, v in zip(names, host)}
        if reset:
            self.sums, self.counts = {}, {}
        return out

    def state_dict(self) -> dict:
        return {"sums": dict(self.sums), "counts": dict(self.counts)}

    def load_state_dict(self, state: dict, device: torch.device) -> None:
        self.sums = {k: v.to(device) for k, v in state["sums"].items()}
        self.counts = {k: int(v) for k, v in state["counts"].items()}
