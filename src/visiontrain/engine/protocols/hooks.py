"""Hooks: the few documented events where code outside the engine may act.

In the spirit of detectron2's HookBase: extension by composition, not by flags on the trainer.
Each hook gets a weak reference to the trainer (``self.trainer``) and reads what it needs from it:
``step`` (optimizer steps done), ``epoch``, ``model``, ``optimizer``, ``task``, ``cfg``, ``ema``,
``log`` (the run's logger: ``log.print``), ``progress``, ``parts`` (every part by name) and ``run``
(everything the build phase made: loaders, scaler, clock; engine.setup.training.TrainingRun).

A hook with a ``cadence`` (``engine.protocols.cadence.Cadence``: every N steps or epochs, plus at the end)
is also a part of the loop: its ``periodic()`` runs after each step at which the cadence is due,
before that step's checkpoint. A hook with ``state_dict`` / ``load_state_dict`` is saved in every
checkpoint and restored on resume. ``trainer.hooks`` names hooks to add by import path
(:func:`load_hooks`).

Hooks run on the host between device work. A hook that reads a tensor value forces a host-device
sync: do that only in ``after_epoch`` / ``after_eval`` / ``after_train`` or a ``periodic()`` of a
sparse cadence, never every step.
"""
from __future__ import annotations

import importlib
import os
import sys
import weakref
from typing import Any, Sequence

from visiontrain.core.config import ConfigError
from visiontrain.engine.protocols.cadence import Cadence

EVENTS = ("before_train", "before_epoch", "before_step", "after_backward", "after_step", "after_epoch",
          "after_eval", "after_train", "on_exception")


class Hook:
    trainer: Any = None
    cadence: Cadence | None = None  # set: periodic() runs on it (see the module docstring)

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

    def on_exception(self, err: BaseException) -> None:
        """Once, when ``fit`` stops on ``err`` (an error, a stop signal, Ctrl-C), before it propagates.
        The place to release what ``before_train`` took."""

    def periodic(self) -> None:
        """After each optimizer step at which ``cadence`` is due (the loop's position is
        ``trainer.progress``); ``cadence`` None: never."""


class HookList:
    """Calls each event on every hook, in order. Empty events cost one Python loop."""

    def __init__(self, hooks: Sequence[Hook], trainer: Any) -> None:
        self.hooks = list(hooks)
        ref = trainer if isinstance(trainer, weakref.ProxyTypes) or trainer is None else weakref.proxy(trainer)
        for hook in self.hooks:
            hook.trainer = ref
        # Only hooks that override an event are called for it: per-step dispatch stays cheap.
        self._by_event = {
            name: [getattr(h, name) for h in self.hooks if getattr(type(h), name) is not getattr(Hook, name)]
            for name in EVENTS}

    def __call__(self, event: str, *args: Any) -> None:
        for fn in self._by_event[event]:
            fn(*args)

    def callbacks(self, event: str) -> list:
        """The bound methods of one event, for the per-step events the trainer calls inline."""
        return self._by_event[event]


def hook_path(hook: Hook) -> str:
    """``package.module:ClassName``: what ``trainer.hooks`` names a hook by, and its key in a checkpoint."""
    return f"{type(hook).__module__}:{type(hook).__qualname__}"


def load_hooks(paths: Sequence[str], key: str = "trainer.hooks") -> list[Hook]:
    """One hook per ``package.module:ClassName``, each built without arguments. The module is found
    on ``sys.path`` or in the current directory. Anything else (a path that is not one, a module that
    cannot be imported, a name that is no subclass of ``visiontrain.Hook``, a class that needs
    arguments) is a ConfigError naming ``key``, the path and what was expected."""
    want = "expected 'package.module:ClassName', a subclass of visiontrain.Hook built without arguments"
    hooks = []
    for path in paths:
        module_name, _, name = str(path).partition(":")
        if not module_name or not name or ":" in name:
            raise ConfigError(f"{key}: {path!r} is not an import path; {want}")
        if os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except Exception as err:  # noqa: BLE001  (ImportError, or the module's own failure: one line either way)
            raise ConfigError(f"{key}: {path!r} cannot be imported ({type(err).__name__}: {err}); {want}") from None
        cls = getattr(module, name, None)
        if not (isinstance(cls, type) and issubclass(cls, Hook)):
            what = f"module {module_name!r} has no {name!r}" if cls is None else f"{name!r} is a {type(cls).__name__}"
            raise ConfigError(f"{key}: {path!r}: {what}, not a hook; {want}")
        try:
            hooks.append(cls())
        except TypeError as err:
            raise ConfigError(f"{key}: {path!r} cannot be built without arguments ({err}); {want}") from None
    return hooks
