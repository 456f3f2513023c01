"""Freezing parameters by name, and the batch norms whose parameters are all frozen.

Below the engine on purpose: a model builder (R-CNN's frozen stages) freezes its own layers, and
models must not import the engine; the engine's ``optim.freeze`` rules use the same function.
"""
from __future__ import annotations

import re

from torch import nn

from visiontrain.core._tv_compat import ensure_torchvision

__all__ = ["freeze_parameters"]


def freeze_parameters(model: nn.Module, patterns: list[str], frozen_bn: bool = True) -> list[str]:
    """Freeze parameters whose name matches any regex; return their names. With ``frozen_bn`` a
    BatchNorm left with no trainable parameter becomes a FrozenBatchNorm2d, so its running
    statistics stop moving too (requires_grad alone would keep updating them in train mode)."""
    if not patterns:
        return []
    regexes = [re.compile(p) for p in patterns]
    frozen = [n for n, p in model.named_parameters() if any(r.search(n) for r in regexes)]
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    if frozen_bn:
        _freeze_batchnorms(model)
    return frozen


def _freeze_batchnorms(module: nn.Module) -> None:
    ensure_torchvision()
    from torchvision.ops import FrozenBatchNorm2d

    for name, child in list(module.named_children()):
        params = list(child.parameters(recurse=False))
        if isinstance(child, nn.BatchNorm2d) and params and not any(p.requires_grad for p in params):
            frozen = FrozenBatchNorm2d(child.num_features, eps=child.eps).to(child.weight.device)
            for key in ("weight", "bias", "running_mean", "running_var"):
                getattr(frozen, key).copy_(getattr(child, key).detach())
            setattr(module, name, frozen)
        else:
            _freeze_batchnorms(child)
