"""Hooks: the few documented events where code outside the engine may act.

In the spirit of detectron2's HookBase: extension by composition, not by flags on the trainer.
Each hook gets the trainer (``self.trainer``) and reads what it needs from it: ``step`` (optimizer
steps done), ``epoch``, ``model``, ``optimizer``, ``task``, ``cfg``, ``ema``, and ``run`` (everything
the build phase made: loaders, sampler, scaler, clock; engine.run.TrainingRun).

Hooks run on the host between device work. A hook that reads a tensor value forces a host-device
sync: do that only in ``after_epoch`` / ``after_eval`` / ``after_train``, never per step.
"""
from __future__ import annotations

from typing import Any


class Hook:
    trainer: Any = None

    def before_train(self) -> None:
        """Once, after model/optimizer/data are built and a resume (if any) is loaded."""

    def before_epoch(self) -> None:
        """At the start of each epoch (also a resumed, partly done one). E.g. switch mixup off."""

    def before_step(self) -> None:
        """Before the micro-batches of one optimizer step are loaded; schedules are already set."""

    def after_backward(self) -> None:
        """Gradients are final (accumulated, unscaled, clipped) and the optimizer has not stepped.
        The place for gradient surgery, e.g. cancelling DINO's last-layer gradients."""

    def after_step(self) -> None:
        """After the optimizer step and the EMA update; ``trainer.step`` already counts it."""

    def after_epoch(self) -> None:
        """After the last step of an epoch, before that epoch's evaluation and checkpoint."""

    def after_eval(self, metrics: dict[str, Any]) -> None:
        """After each evaluation, with the flat dict of metrics (``ema/`` prefix for the EMA); the
        one value that is not a number is a task's per-class table (``metrics_file.PER_CLASS``)."""

    def after_train(self) -> None:
        """Once, after the final evaluation and checkpoint."""


class HookList:
    """Calls each event on every hook, in order. Empty events cost one Python loop."""

    def __init__(self, hooks: list[Hook], trainer: Any) -> None:
        self.hooks = list(hooks)
        for hook in self.hooks:
            hook.trainer = trainer
        # Only hooks that override an event are called for it: per-step dispatch stays cheap.
        self._by_event = {
            name: [getattr(h, name) for h in self.hooks if getattr(type(h), name) is not getattr(Hook, name)]
            for name in ("before_train", "before_epoch", "before_step", "after_backward",
                         "after_step", "after_epoch", "after_eval", "after_train")
        }

    def __call__(self, event: str, *args: Any) -> None:
        for fn in self._by_event[event]:
            fn(*args)

    def callbacks(self, event: str) -> list:
        """The bound methods of one event, for the per-step events the trainer calls inline."""
        return self._by_event[event]
