"""The search space of ``visiontrain tune``: a YAML file naming config keys and the distribution each
is drawn from, checked against the recipe before any trial starts.

    task.teacher_temp: {float: [0.03, 0.06]}          # uniform
    optim.lr: {log: [1.0e-4, 3.0e-3]}                 # log-uniform
    trainer.epochs: {int: [2, 6], step: 2}            # integers (``log: true`` for log-uniform)
    task.out_dim: {categorical: [1024, 2048, 4096]}
    task.local_scale: {categorical: [[0.05, 0.4], [0.1, 0.4]]}   # a choice may be any YAML value

Every key is applied to the recipe with its lowest and highest value and with each choice, through
the same checks as a ``key=value`` on the command line: a misspelt key is one line with the closest
keys, a value of the wrong type one line naming the key and the type it takes.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from visiontrain.core import config as C
from visiontrain.core import safe_yaml

#: A parameter's distribution: the one key of its mapping that names the kind.
KINDS = ("float", "log", "int", "categorical")
#: The other keys a parameter's mapping may have.
OPTIONS = ("step", "log")


class SpaceError(C.ConfigError):
    """A search-space file that cannot be searched: the message names the file and the key."""


@dataclasses.dataclass(frozen=True)
class Param:
    """One searched config key. ``choices`` of a categorical are kept as YAML text when they are not
    plain scalars (Optuna stores None, bool, int, float and str only); ``value_of`` reads them back."""

    key: str
    kind: str
    low: float | int | None = None
    high: float | int | None = None
    step: float | int | None = None
    log: bool = False
    choices: tuple[Any, ...] = ()

    def suggest(self, trial: Any) -> Any:
        """The trial's value of this key (drawn by the sampler, or fixed: an enqueued trial's)."""
        if self.kind == "categorical":
            return self.value_of(trial.suggest_categorical(self.key, list(self.choices)))
        if self.kind == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        return trial.suggest_float(self.key, float(self.low), float(self.high), step=self.step,
                                   log=self.kind == "log" or self.log)

    def value_of(self, stored: Any) -> Any:
        """A stored choice as the config value it stands for."""
        return safe_yaml.load(stored) if self.kind == "categorical" and isinstance(stored, str) \
            and stored in self._text_choices else stored

    @property
    def _text_choices(self) -> set[str]:
        return {c for c in self.choices if isinstance(c, str) and c.startswith(("[", "{"))}

    def checked_values(self) -> list[Any]:
        """The values each key is tried with against the recipe: both ends, or every choice."""
        if self.kind == "categorical":
            return [self.value_of(c) for c in self.choices]
        return [self.low, self.high]


def yaml_text(value: Any) -> str:
    """A value as the YAML a ``key=value`` override reads back to the same value (``1.0e-05``, not
    ``1e-05``, which YAML reads as a string)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("...").strip()


def override(key: str, value: Any) -> str:
    return f"{key}={yaml_text(value)}"


def read_space(path: str | Path) -> list[Param]:
    """The parameters of a space file, each checked for its own shape (not yet against a recipe)."""
    path = Path(path)
    if not path.is_file():
        raise SpaceError(f"--space {path}: no such file (expected a YAML mapping of config keys to "
                         f"distributions, e.g. 'optim.lr: {{log: [1.0e-4, 1.0e-2]}}')")
    try:
        tree = safe_yaml.load(path.read_text())
    except yaml.YAMLError as err:
        raise SpaceError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(tree, dict) or not tree:
        raise SpaceError(f"{path}: expected a mapping of config keys to distributions, e.g. "
                         f"'optim.lr: {{log: [1.0e-4, 1.0e-2]}}'; got {type(tree).__name__ if tree else 'nothing'}")
    return [_param(path, str(key), spec) for key, spec in tree.items()]


def _param(path: Path, key: str, spec: Any) -> Param:
    where = f"{path}: {key}"
    kinds = [k for k in KINDS if isinstance(spec, dict) and k in spec]
    if len(kinds) != 1:
        raise SpaceError(f"{where}: expected a mapping with one of {', '.join(KINDS)} (e.g. {{float: [0.1, 0.5]}}, "
                         f"{{categorical: [a, b]}}); got {spec!r}")
    kind = kinds[0]
    unknown = sorted(set(spec) - {kind, *OPTIONS})
    if unknown:
        raise SpaceError(f"{where}: unknown option {', '.join(map(str, unknown))} (a {kind} takes "
                         f"{'nothing more' if kind == 'categorical' else 'step, log'})")
    if kind == "categorical":
        return _categorical(where, key, spec[kind], spec)
    return _ranged(where, key, kind, spec)


def _categorical(where: str, key: str, choices: Any, spec: dict) -> Param:
    if set(spec) != {"categorical"}:
        raise SpaceError(f"{where}: a categorical takes its list of choices only")
    if not isinstance(choices, list) or not choices:
        raise SpaceError(f"{where}: categorical expects a non-empty list of choices, got {choices!r}")
    stored = tuple(c if c is None or isinstance(c, (bool, int, float, str)) else yaml_text(c) for c in choices)
    if len(set(map(repr, stored))) != len(stored):
        raise SpaceError(f"{where}: a choice is listed twice in {choices!r}")
    return Param(key, "categorical", choices=stored)


def _ranged(where: str, key: str, kind: str, spec: dict) -> Param:
    bounds, step, log = spec[kind], spec.get("step"), bool(spec.get("log", False))
    numbers = (int,) if kind == "int" else (int, float)
    if (not isinstance(bounds, list) or len(bounds) != 2
            or not all(isinstance(b, numbers) and not isinstance(b, bool) for b in bounds)):
        raise SpaceError(f"{where}: {kind} expects [low, high] of {'integers' if kind == 'int' else 'numbers'}, "
                         f"got {bounds!r}")
    low, high = bounds
    if not low < high:
        raise SpaceError(f"{where}: expected low < high, got [{low}, {high}]")
    if (kind == "log" or log) and low <= 0:
        raise SpaceError(f"{where}: a log-uniform range must be above 0, got [{low}, {high}]")
    if step is not None and (isinstance(step, bool) or not isinstance(step, numbers) or step <= 0
                             or kind == "log" or log):
        raise SpaceError(f"{where}: step must be a positive {'integer' if kind == 'int' else 'number'} and "
                         f"cannot go with a log scale, got {step!r}")
    if kind == "float" and not isinstance(spec.get("log", False), bool):
        raise SpaceError(f"{where}: log must be true or false")
    if step is not None:
        _check_whole_steps(where, low, high, step)
    return Param(key, kind, low, high, step, log)


def _check_whole_steps(where: str, low: float, high: float, step: float) -> None:
    """[low, high] must be a whole number of steps: Optuna would cut the top off silently in the
    study and warn about it in raw form at every trial; the user's range is the user's to fix."""
    steps = (high - low) / step
    if abs(steps - round(steps)) > 1e-9 * max(1.0, abs(steps)):
        top = low + int(steps) * step
        raise SpaceError(f"{where}: [{low}, {high}] is not a whole number of steps of {step} (the values drawn "
                         f"would stop at {top:.10g}): write [{low}, {top:.10g}] or [{low}, {top + step:.10g}]")


def check_against(space: list[Param], path: str | Path, recipe: str, overrides: list[str]) -> C.Config:
    """Apply every key of the space to the recipe (each end of a range, each choice): a key that is
    not the recipe's, or a value its type refuses, is a SpaceError naming the space file. A key also
    set by ``overrides`` is refused (which would win is a guess). Returns the recipe's config."""
    cfg = C.load_config(recipe, overrides)
    fixed = {key for key, _ in C.parse_overrides(overrides)}
    for param in space:
        if param.key in fixed:
            raise SpaceError(f"{path}: {param.key} is searched here and set on the command line "
                             f"({param.key}=...): drop one")
        for value in param.checked_values():
            try:
                C.load_config(recipe, [*overrides, override(param.key, value)], source=str(path))
            except C.ConfigError as err:
                raise SpaceError(str(err)) from None
    return cfg
