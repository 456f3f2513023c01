"""Model EMA (cvnets, timm ModelEmaV3). The same class serves as DINO's teacher.

The average lives in a copy of the model whose parameters never require grad and are never seen
by the optimizer. An update is two foreach kernels (lerp for float tensors, copy for the rest)
with a host-side float decay: no host read. Under FSDP the copy is sharded like the model, so the
kernels run on the local shards.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from visiontrain.core.config import register_section
from visiontrain.core.typed_config import doc
from visiontrain.engine.parallel.fsdp import local


@dataclass
class EmaConfig:
    enabled: bool = doc("keep an exponential moving average of the weights", False)
    decay: float = doc("EMA decay (weight of the old average; cvnets momentum m = 1 - decay)", 0.9998)
    warmup: bool = doc("ramp the decay up from 0 early in training (timm ModelEmaV3)", False)
    every: int = doc("update the EMA every k optimizer steps", 1, minimum=1)


register_section("ema", EmaConfig, "EMA section")


def unwrap(model: nn.Module) -> nn.Module:
    """The module under DDP / torch.compile wrappers."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


class ModelEma:
    def __init__(self, model: nn.Module, decay: float, *, warmup: bool = False, every: int = 1) -> None:
        self.module = copy.deepcopy(unwrap(model)).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.decay, self.warmup, self.every = decay, warmup, every
        self.updates = 0  # host-side count: a pure function of the step, kept for the warmup

    def current_decay(self, decay: float | None = None) -> float:
        decay = self.decay if decay is None else decay
        if self.warmup:  # timm's ModelEmaV3 warmup: 1 - (1 + n)^(-2/3)
            decay = min(decay, 1.0 - (1.0 + self.updates) ** (-2.0 / 3.0))
        return decay

    def _pairs(self, model: nn.Module) -> tuple[list[torch.Tensor], ...]:
        """(lerp targets, lerp sources, copy targets, copy sources): floats average, the rest copy."""
        src = unwrap(model).state_dict(keep_vars=True)
        dst = self.module.state_dict(keep_vars=True)
        lerp_dst, lerp_src, copy_dst, copy_src = [], [], [], []
        for name, d in dst.items():
            s, d = local(src[name].detach()), local(d.data)
            if d.is_floating_point():
                lerp_dst.append(d), lerp_src.append(s)
            else:
                copy_dst.append(d), copy_src.append(s)
        return lerp_dst, lerp_src, copy_dst, copy_src

    @torch.no_grad()
    def update(self, model: nn.Module, step: int, decay: float | None = None) -> None:
        if step % self.every:
            return
        if not hasattr(self, "_cached") or self._cached[0] is not model:
            self._cached = (model, self._pairs(model))
        lerp_dst, lerp_src, copy_dst, copy_src = self._cached[1]
        torch._foreach_lerp_(lerp_dst, lerp_src, 1.0 - self.current_decay(decay))
        if copy_dst:
            torch._foreach_copy_(copy_dst, copy_src)
        self.updates += 1

    def state_dict(self) -> dict:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = int(state["updates"])
