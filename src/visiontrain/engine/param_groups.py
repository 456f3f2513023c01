"""Parameter groups by rule, freezing, and the optimizer built over them.

Rules (GluonCV --no-wd, DINO, cvnets no_decay_bn_filter_bias, DETR's backbone lr):
- biases, norm-layer weights and every parameter with fewer than 2 dims get no weight decay;
- ``lr_mult``: the first regex that matches a parameter's name sets its lr multiplier;
- ``freeze``: regexes whose parameters get requires_grad=False; a BatchNorm whose parameters are
  all frozen becomes a FrozenBatchNorm2d, so its statistics freeze too.
Every trainable parameter must land in exactly one group; ``check_coverage`` names any that don't.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm)


class ParamGroupError(ValueError):
    """Trainable parameters missing from the optimizer's groups, or present in two of them."""


def freeze_parameters(model: nn.Module, patterns: list[str], frozen_bn: bool = True) -> list[str]:
    """Freeze parameters whose name matches any regex; return their names."""
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
    from visiontrain._tv_compat import ensure_torchvision

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


def no_decay_names(model: nn.Module) -> set[str]:
    """Biases, norm-layer parameters and all 1-D parameters (LayerScale, pos-embed gains...)."""
    names = set()
    for mod_name, mod in model.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if p.ndim <= 1 or p_name == "bias" or isinstance(mod, NORM_TYPES):
                names.add(full)
    return names


def build_param_groups(model: nn.Module, weight_decay: float, *, no_decay_bias_norm: bool = True,
                       lr_mult: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """Groups keyed by (decay?, lr multiplier); each has ``name``, ``lr_mult`` and ``decay`` keys."""
    rules = [(re.compile(k), v) for k, v in (lr_mult or {}).items()]
    skip = no_decay_names(model) if no_decay_bias_norm else set()
    groups: "OrderedDict[tuple[bool, float], dict[str, Any]]" = OrderedDict()
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        mult = next((m for r, m in rules if r.search(name)), 1.0)
        decay = weight_decay > 0 and name not in skip
        key = (decay, mult)
        if key not in groups:
            groups[key] = {"params": [], "param_names": [], "decay": decay, "lr_mult": mult,
                           "weight_decay": weight_decay if decay else 0.0,
                           "name": f"{'decay' if decay else 'no_decay'}_x{mult:g}"}
        groups[key]["params"].append(param)
        groups[key]["param_names"].append(name)
    return list(groups.values())


def check_coverage(model: nn.Module, groups: list[dict[str, Any]]) -> None:
    """Every trainable parameter in exactly one group (a task may build its own groups)."""
    seen: dict[int, int] = {}
    for group in groups:
        for p in group["params"]:
            seen[id(p)] = seen.get(id(p), 0) + 1
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in seen]
    twice = [n for n, p in model.named_parameters() if seen.get(id(p), 0) > 1]
    if missing or twice:
        parts = []
        if missing:
            parts.append(f"not in any parameter group: {', '.join(missing)}")
        if twice:
            parts.append(f"in more than one group: {', '.join(twice)}")
        raise ParamGroupError("; ".join(parts))


def _use_fused(impl: str, groups: list[dict[str, Any]]) -> bool:
    if impl == "fused":
        return True
    if impl != "auto":
        return False
    params = [p for g in groups for p in g["params"]]
    return all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)


def build_optimizer(groups: list[dict[str, Any]], name: str, *, lr: float, momentum: float = 0.9,
                    beta2: float = 0.999, eps: float = 1e-8, nesterov: bool = False,
                    impl: str = "auto") -> torch.optim.Optimizer:
    """SGD / Adam / AdamW over the groups, fused where possible (it also lets a step be skipped
    on the device through ``found_inf``, see ``engine.step``)."""
    fused = _use_fused(impl, groups)
    kind = {"fused": fused} if fused else {"foreach": impl != "loop"}
    for g in groups:
        g["lr"] = lr * g["lr_mult"]
    if name == "sgd":
        opt = torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov, **kind)
        if fused and momentum > 0:
            # Fused SGD leaves a new momentum buffer uninitialised when its first step is skipped
            # through found_inf. A zero buffer is what the first step would have made (dampening 0:
            # buf = 0 * m + grad), so create them up front.
            for g in opt.param_groups:
                for p in g["params"]:
                    opt.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return opt
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}.get(name)
    if cls is None:
        raise ValueError(f"optim.name: unknown optimizer {name!r}; expected sgd, adam or adamw")
    return cls(groups, lr=lr, betas=(momentum, beta2), eps=eps, **kind)


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    return bool(optimizer.defaults.get("fused"))
