"""The parts of a run, in order, and where a new one is registered.

A run's parts and hooks are made here from an ordered list of factories (:data:`PARTS`), each given
the trainer (what it built: ``run``, ``progress``, ``log``, ``recorder``, the parts made before it
in ``parts``) and returning a part, a hook, a list of them, or None where the run has none. Their
order is the order of the hook events and of the parts after each step. Whatever has
``state_dict`` / ``load_state_dict`` is registered in the run's ``States`` under its
``state_name`` (else its ``name``); hooks without a name (a task's, a user's) are saved together
under ``hooks``, each by its import path. So a new stateful periodic duty is one new file (a
``Part``, or a ``Hook`` with a ``cadence``, and the dataclass of its config section) and one
registration: a line in :data:`PARTS`, or :func:`register_part` from outside the engine, which
registers the section too; the trainer, the checkpointer and ``core/config.py`` do not change.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from visiontrain.core.config import Config, register_section
from visiontrain.engine.parts.checkpointer import Checkpointer
from visiontrain.engine.parts.early_stop import EarlyStopping
from visiontrain.engine.parts.evaluator import Evaluator
from visiontrain.engine.parts.log_point import LogPoint
from visiontrain.engine.parts.preemption import StopCheck
from visiontrain.engine.protocols.hooks import Hook, HookList, hook_path, load_hooks
from visiontrain.engine.protocols.part import Part, PeriodicHook
from visiontrain.engine.records.first_look import FirstLook
from visiontrain.engine.records.plots import PlotHook
from visiontrain.engine.records.profiling import ProfileSteps
from visiontrain.engine.records.provenance import Launch
from visiontrain.engine.records.tracking import TrackRun, Tracker, make_trackers
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.engine.state.checkpoint import RngState, WeightsState

PartFactory = Callable[[Any], "Hook | Sequence[Hook] | None"]


@dataclass
class Prepared:
    """What a run adds to its parts and can check on the config alone, before anything is built or
    written: the user's hooks (``trainer.hooks`` and the caller's) and the trackers."""
    hooks: list[Hook]
    trackers: list[Tracker]
    launch: Launch
    ends_trackers: bool  # the trainer made them: it ends them when fit returns


def prepare(cfg: Config, run_dir: str | Path | None, *, hooks: Sequence[Hook], trackers: list[Tracker] | None,
            launch: Launch | None) -> Prepared:
    """A hook path that does not import, or a tracker that cannot start, is a ConfigError here."""
    launch = launch or Launch()
    made = trackers is None
    user = [*load_hooks(cfg.trainer.hooks), *hooks]
    return Prepared(user, make_trackers(cfg, run_dir, launch.recipe) if made else trackers, launch, made)


def _tracking(trainer: Any) -> TrackRun:
    p = trainer.prepared
    return TrackRun(p.trackers, p.launch, ends=p.ends_trackers)


#: The parts and hooks of every run, in order. Tracking first (it records the launch before any
#: hook runs); the measuring parts, then the task's and the user's hooks, the views of the run,
#: the keeping parts; the first look last of the ``before_train`` hooks (a task's hook may bind
#: what its forward pass needs).
PARTS: list[PartFactory] = [
    _tracking,
    lambda trainer: trainer.log.hooks(),
    LogPoint.for_run,
    Evaluator.for_run,
    lambda trainer: trainer.task.hooks(),
    lambda trainer: trainer.prepared.hooks,
    PlotHook.for_run,
    ProfileSteps.for_run,
    Checkpointer.for_run,
    EarlyStopping.for_run,
    StopCheck.for_run,
    FirstLook.for_run,
]


def register_part(factory: PartFactory, *, section: tuple[str, type, str] | None = None) -> PartFactory:
    """Add a part (or hook) to every run made from now on, after the built-in ones: ``factory(trainer)``
    returns it, or None where a run has none. Its ``due`` is asked after each step before the
    checkpointer's (unless it ``keeps``); returned, so that ``PARTS.remove`` can take it out again.
    ``section``: ``(name, dataclass, doc)`` of the part's own config section, registered with it
    (``config.register_section``): recipes and overrides set it, ``show-config --docs`` lists it,
    and the factory reads it as ``trainer.cfg.<name>``."""
    if section is not None:
        register_section(*section)
    PARTS.append(factory)
    return factory


class HookStates:
    """The state of every stateful hook without a name of its own (a task's, a user's), by import path;
    a second hook of the same class is ``PATH#2``."""

    def __init__(self, hooks: list[Hook], log: Any) -> None:
        self.by_key: dict[str, Hook] = {}
        for hook in hooks:
            key, n = hook_path(hook), 2
            while key in self.by_key:
                key, n = f"{hook_path(hook)}#{n}", n + 1
            self.by_key[key] = hook
        self.log = log

    def state_dict(self) -> dict[str, Any]:
        return {key: hook.state_dict() for key, hook in self.by_key.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, hook in self.by_key.items():
            if key in state:
                hook.load_state_dict(state[key])
            else:
                self.log.print(f"resume: the checkpoint holds no state of hook {key}: it starts afresh")
        for key in sorted(set(state) - set(self.by_key)):
            self.log.print(f"resume: the checkpoint holds the state of hook {key}, which this run does not have")


def _made(factory: PartFactory, trainer: Any) -> list[Hook]:
    made = factory(trainer)
    return [] if made is None else [made] if isinstance(made, Hook) else list(made)


def assemble(trainer: Any) -> tuple[list[Part], HookList]:
    """The run's parts (in order) and its hooks, every state registered in ``trainer.states`` (the
    weights, scaler, position, data and task first; the RNGs last); ``trainer.parts`` names them."""
    run, states = trainer.run, trainer.states
    states.register(fmt.WEIGHTS, WeightsState(run, trainer.progress))
    if run.scaler is not None:
        states.register(fmt.SCALER, run.scaler)
    states.register(fmt.PROGRESS, trainer.progress)
    states.register(fmt.DATA, run.source)
    states.register(fmt.TASK, trainer.task)
    components: list[Hook] = []
    for factory in PARTS:
        for component in _made(factory, trainer):
            components.append(component)
            if getattr(component, "name", ""):
                trainer.parts[component.name] = component
    parts = [c if isinstance(c, Part) else PeriodicHook(c) for c in components
             if isinstance(c, Part) or c.cadence is not None]
    unnamed = []
    for c in components:
        if hasattr(c, "state_dict") and getattr(c, "has_state", True):
            name = getattr(c, "state_name", "") or getattr(c, "name", "")
            if name:
                states.register(name, c)
            else:
                unnamed.append(c)
    if unnamed:
        states.register(fmt.HOOKS, HookStates(unnamed, trainer.log))
    states.register(fmt.RNG, RngState())
    wrappers = [p for p in parts if isinstance(p, PeriodicHook)]
    return parts, HookList([*components, *wrappers], trainer)
