"""The scheduled scalars: every ``schedules.<name>`` applied at step s, on the host.

Schedules are pure functions of the step (engine.step.schedules); this is where their values land in
the optimizer's groups, the EMA, the BatchNorm layers, the loss weights and the task.
"""
from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import nn

from visiontrain.engine.optim.schedules import SCHEDULED_SCALARS, Schedule, ScheduleConfig, StepClock, build_schedule

log = logging.getLogger("visiontrain")


def warmup_length(spec: ScheduleConfig, clock: StepClock) -> str:
    """A warmup as the recipe gives it, with its length in steps when it is given in epochs."""
    steps = f" = {clock.to_steps(spec.warmup, 'epochs'):g} steps" if spec.unit == "epochs" else ""
    return f"{spec.warmup:g} {spec.unit}{steps}"


class ScheduledScalars:
    """Applies every configured schedule for step s: pure functions of s, set on the host.

    Targets: ``lr`` (x each group's lr_mult), ``weight_decay`` (decayed groups only),
    ``momentum`` (SGD momentum / Adam beta1), ``ema_decay``, ``bn_momentum``, ``loss.<term>``
    and ``task.<scalar>``.
    """

    def __init__(self, specs: dict[str, ScheduleConfig], bases: dict[str, float], clock: StepClock,
                 optimizer: torch.optim.Optimizer, model: nn.Module, task: Any, ema: Any = None) -> None:
        self.optimizer, self.task, self.ema = optimizer, task, ema
        self.schedules: dict[str, Schedule] = {}
        for name, spec in specs.items():
            if name not in SCHEDULED_SCALARS and not re.match(r"^(loss|task)\.\w+$", name):
                raise ValueError(f"schedules.{name}: unknown scalar; expected one of "
                                 f"{', '.join(sorted(SCHEDULED_SCALARS))}, loss.<term> or task.<scalar>")
            base = bases.get(name)
            if name.startswith("task."):
                base = float(getattr(task, name[5:], 0.0))
            sched = self.schedules[name] = build_schedule(spec, 0.0 if base is None else base, clock, name=name)
            length = warmup_length(spec, clock)
            if sched.warmup_floored:  # a warmup in epochs on a small dataset: said once
                log.info("visiontrain: schedules.%s.warmup (%s) is shorter than schedules.%s.warmup_min_steps: "
                         "%s warms up over %d steps", name, length, name, name, spec.warmup_min_steps)
                length += f", lengthened to warmup_min_steps={spec.warmup_min_steps}"
            if sched.warmup_outlasts_run:  # a smoke run or a step budget: said once, then trained as asked
                log.warning("visiontrain: warning: schedules.%s.warmup (%s) is longer than the run (%d steps): "
                            "%s stays in its warmup to the end", name, length, clock.total_steps, name)
        self.bn_layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)] \
            if "bn_momentum" in self.schedules else []
        self.values: dict[str, float] = {}

    def logged(self, optimizer: torch.optim.Optimizer) -> dict[str, float]:
        """What a log point records of them: each group's lr (``lr/<name>``), the first group's as
        ``lr``, and every other scheduled value as it was last set."""
        groups = optimizer.param_groups
        values = {f"lr/{g.get('name', i)}": g["lr"] for i, g in enumerate(groups)}
        return {**values, "lr": groups[0]["lr"], **{k: v for k, v in self.values.items() if k != "lr"}}

    def apply(self, step: int, loss_weights: dict[str, float]) -> None:
        for name, sched in self.schedules.items():
            value = self.values[name] = sched(step)
            if name == "lr":
                for g in self.optimizer.param_groups:
                    g["lr"] = value * g.get("lr_mult", 1.0)
            elif name == "weight_decay":
                for g in self.optimizer.param_groups:
                    if g.get("decay", True):
                        g["weight_decay"] = value
            elif name == "momentum":
                for g in self.optimizer.param_groups:
                    if "betas" in g:
                        g["betas"] = (value, g["betas"][1])
                    else:
                        g["momentum"] = value
            elif name == "ema_decay":
                if self.ema is not None:
                    self.ema.decay = value
            elif name == "bn_momentum":
                for m in self.bn_layers:
                    m.momentum = value
            elif name.startswith("loss."):
                loss_weights[name[5:]] = value
            elif name.startswith("task."):
                self.task.set_scalar(name[5:], value)
