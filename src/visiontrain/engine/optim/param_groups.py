"""Parameter groups by rule, freezing, and the optimizer built over them.

Rules (GluonCV --no-wd, DINO, cvnets no_decay_bn_filter_bias, DETR's backbone lr):
- biases, norm-layer weights and every parameter with fewer than 2 dims get no weight decay;
- ``lr_mult``: the first regex that matches a parameter's name sets its lr multiplier;
- ``freeze``: regexes whose parameters get requires_grad=False; a BatchNorm whose parameters are
  all frozen becomes a FrozenBatchNorm2d, so its statistics freeze too (``models.freezing``, which
  model builders use as well);
- ``NormGroups`` (a task's option, seamseg's R-CNN): norm-layer parameters in groups of their own,
  at lr 0 when batch norm is frozen and spared weight decay unless asked.
Every trainable parameter must land in exactly one group; ``check_coverage`` names any that don't.
"""
from __future__ import annotations

import functools
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from visiontrain.core.config import ConfigError, register_section
from visiontrain.core.typed_config import doc


@dataclass
class OptimConfig:
    name: Literal["sgd", "adam", "adamw"] = doc("optimizer", "adamw")
    lr: float = doc("base learning rate (before the batch-size rule)", 1e-3, minimum=0)
    weight_decay: float = doc("weight decay of the decayed parameter group", 0.0, minimum=0)
    momentum: float = doc("SGD momentum / Adam beta1", 0.9, minimum=0)
    beta2: float = doc("Adam beta2", 0.999, minimum=0)
    eps: float = doc("Adam epsilon", 1e-8, minimum=0)
    nesterov: bool = doc("SGD Nesterov momentum", False)
    impl: Literal["auto", "fused", "foreach", "loop"] = doc(
        "torch optimizer implementation; auto = fused where the device supports it", "auto")
    no_decay_bias_norm: bool = doc("no weight decay on biases, norm layers and 1-D params", True)
    lr_mult: dict[str, float] = doc("regex on parameter name -> lr multiplier (first match)", factory=dict)
    freeze: list[str] = doc("regexes of parameter names to freeze (requires_grad False)", factory=list)
    frozen_bn: bool = doc("replace BatchNorm in frozen modules by FrozenBatchNorm2d", True)
    base_batch: int | None = doc("if set, lr *= global_batch / base_batch", None)


register_section("optim", OptimConfig, "optimizer section")

__all__ = ["NORM_TYPES", "NormGroups", "ParamGroupError", "build_optimizer", "build_param_groups", "check_coverage",
           "group_rules", "is_fused", "no_decay_names", "norm_param_names"]

NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.LocalResponseNorm)


class ParamGroupError(ValueError):
    """Trainable parameters missing from the optimizer's groups, or present in two of them."""


def no_decay_names(model: nn.Module) -> set[str]:
    """Biases, norm-layer parameters and all 1-D parameters (LayerScale, pos-embed gains...)."""
    names = set()
    for mod_name, mod in model.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if p.ndim <= 1 or p_name == "bias" or isinstance(mod, NORM_TYPES):
                names.add(full)
    return names


@dataclass(frozen=True)
class NormGroups:
    """Norm-layer parameters kept in groups of their own (seamseg's detectors), named ``norm...``
    beside the ``other...`` groups. A task that freezes batch norm statistics stops their affine
    parameters too (``frozen``: lr multiplier 0, whatever ``lr_mult`` says), and norm parameters
    get weight decay only with ``weight_decay`` (the no-decay rule still applies on top).
    ``trained``: the modules (name prefixes) whose norm layers train even when ``frozen``: a head
    added on a frozen backbone, whose norms start untrained (Panoptic FPN's semantic head)."""
    frozen: bool = False
    weight_decay: bool = False
    trained: tuple[str, ...] = ()


def norm_param_names(model: nn.Module) -> set[str]:
    """Names of the parameters that norm layers own directly."""
    return {f"{m_name}.{p_name}" if m_name else p_name
            for m_name, mod in model.named_modules() if isinstance(mod, NORM_TYPES)
            for p_name, _ in mod.named_parameters(recurse=False)}


def build_param_groups(model: nn.Module, weight_decay: float, *, no_decay_bias_norm: bool = True,
                       lr_mult: dict[str, float] | None = None, norms: NormGroups | None = None
                       ) -> list[dict[str, Any]]:
    """Groups keyed by (decay?, lr multiplier), and by norm or not with ``norms``; each has
    ``name``, ``lr_mult`` and ``decay`` keys. Tasks with their own group rules pass them here rather
    than building groups themselves, so that every ``optim.*`` key keeps its meaning for them."""
    rules = [(re.compile(k), v) for k, v in (lr_mult or {}).items()]
    skip = no_decay_names(model) if no_decay_bias_norm else set()
    norm_names = norm_param_names(model) if norms is not None else set()
    frozen_norms = norms is not None and norms.frozen
    spared_norms = norms is not None and not norms.weight_decay
    groups: "OrderedDict[tuple[str, bool, float], dict[str, Any]]" = OrderedDict()
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        is_norm = name in norm_names
        frozen = is_norm and frozen_norms and not name.startswith(norms.trained)
        mult = 0.0 if frozen else next((m for r, m in rules if r.search(name)), 1.0)
        decay = weight_decay > 0 and name not in skip and not (is_norm and spared_norms)
        kind = "" if norms is None else "norm" if is_norm else "other"
        key = (kind, decay, mult)
        if key not in groups:
            groups[key] = {"params": [], "param_names": [], "decay": decay, "lr_mult": mult,
                           "weight_decay": weight_decay if decay else 0.0, "name": _group_name(kind, decay, mult)}
        groups[key]["params"].append(param)
        groups[key]["param_names"].append(name)
    return list(groups.values())


def group_rules(optim: OptimConfig) -> Callable[..., list[dict[str, Any]]]:
    """``rules(model, norms=None)``: :func:`build_param_groups` with the ``optim`` section's keys, what
    a task's ``param_groups`` receives to build its own groups by the engine's rules."""
    return functools.partial(build_param_groups, weight_decay=optim.weight_decay,
                             no_decay_bias_norm=optim.no_decay_bias_norm, lr_mult=optim.lr_mult)


def _group_name(kind: str, decay: bool, mult: float) -> str:
    """``decay_x1`` / ``no_decay_x0.1``; with norm groups ``other_x1`` / ``norm_no_decay_x0`` (the
    names the logged ``lr/<group>`` columns carry)."""
    if not kind:
        return f"{'decay' if decay else 'no_decay'}_x{mult:g}"
    return f"{kind}{'' if decay else '_no_decay'}_x{mult:g}"


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


def _use_fused(impl: str, groups: list[dict[str, Any]], name: str) -> bool:
    """Fused where asked, or under ``auto`` where every parameter allows it. Torch has no fused SGD
    for sharded (FSDP's DTensor) parameters: its kernel has no sharding rule, and the first step
    would fail."""
    params = [p for g in groups for p in g["params"]]
    sharded_sgd = name == "sgd" and any(isinstance(p, DTensor) for p in params)
    if impl == "fused" and sharded_sgd:
        raise ConfigError("optim.impl=fused: torch has no fused SGD for sharded parameters "
                         "(distributed.strategy=fsdp); use optim.impl=auto or foreach")
    if impl != "auto":
        return impl == "fused"
    return not sharded_sgd and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)


def build_optimizer(groups: list[dict[str, Any]], optim: OptimConfig, *, lr: float) -> torch.optim.Optimizer:
    """SGD / Adam / AdamW over the groups, as ``optim`` names and sets it (``optim.lr`` aside: ``lr`` is
    the base rate after any batch scaling), fused where possible (it also lets a step be skipped on
    the device through ``found_inf``, see ``engine.step.pipeline``)."""
    name, momentum, impl = optim.name, optim.momentum, optim.impl
    fused = _use_fused(impl, groups, name)
    kind = {"fused": fused} if fused else {"foreach": impl != "loop"}
    for g in groups:
        g["lr"] = lr * g["lr_mult"]
    if name == "sgd":
        opt = torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=optim.nesterov, **kind)
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
    return cls(groups, lr=lr, betas=(momentum, optim.beta2), eps=optim.eps, **kind)


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    return bool(optimizer.defaults.get("fused"))
