"""Recipes: YAML -> typed dataclasses, with `key=value` overrides and errors that name the key.

Every key is a dataclass field with a type and a one-line doc (``field(metadata={"doc": ...})``).
Unknown keys are errors that suggest the closest valid keys; wrong types name the key and the
expected type. The ``task`` section is typed by the task named in ``task.name`` (each task
registers its own dataclass), so task-specific keys are checked exactly like engine keys.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from visiontrain.config_sections import (SCHEDULED_SCALARS, CheckpointConfig, DataConfig, DistributedConfig, EmaConfig,
                                         EvalConfig, LoggingConfig, OptimConfig, ScheduleConfig, ScheduleShape,
                                         ScheduleUnit, TaskConfig, TrainerConfig, doc)
from visiontrain.typed_config import ConfigError, build_typed, type_name

__all__ = ["Config", "ConfigError", "LoggingConfig", "RegisteredTask", "TASK_REGISTRY", "TaskConfig",
           "config_from_dict", "config_to_dict", "describe_keys", "doc", "dump_config", "flatten", "list_recipes",
           "load_config", "parse_overrides", "registered_task"]

RECIPES_DIR = Path(__file__).parent / "recipes"


@dataclass
class Config:
    seed: int = doc("seed for sampling, augmentation and initialisation", 0)
    task: TaskConfig = doc("task section, typed by task.name", factory=TaskConfig)
    data: DataConfig = doc("data section", factory=DataConfig)
    optim: OptimConfig = doc("optimizer section", factory=OptimConfig)
    schedules: dict[str, ScheduleConfig] = doc(
        f"per-step schedules: {', '.join(SCHEDULED_SCALARS)}, loss.<term>, task.<scalar>", factory=dict)
    trainer: TrainerConfig = doc("trainer section", factory=TrainerConfig)
    ema: EmaConfig = doc("EMA section", factory=EmaConfig)
    eval: EvalConfig = doc("evaluation section", factory=EvalConfig)
    checkpoint: CheckpointConfig = doc("checkpoint section", factory=CheckpointConfig)
    distributed: DistributedConfig = doc("multi-process section (torchrun)", factory=DistributedConfig)
    logging: LoggingConfig = doc("experiment tracking section (MLflow)", factory=LoggingConfig)


@dataclass(frozen=True)
class RegisteredTask:
    """What ``task.name`` names: the class that builds the task and the dataclass that types its
    ``task:`` section. Filled only by ``engine.protocols.task.register_task``, which checks both; kept in
    this room, the lowest that reads it, because a recipe is typed before any task is built."""
    task_class: type                    # a visiontrain.engine.protocols.task.Task (a room above this one)
    config_class: type[TaskConfig]


#: task.name -> its task. ``import visiontrain.tasks`` registers the built-in ones.
TASK_REGISTRY: dict[str, RegisteredTask] = {}


def registered_task(name: Any) -> RegisteredTask:
    """The task registered as ``name``; an unknown name names the close one and every known one."""
    found = TASK_REGISTRY.get(name)
    if found is None:
        close = difflib.get_close_matches(str(name), list(TASK_REGISTRY), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"task.name: unknown task {name!r}{hint}; expected one of {', '.join(sorted(TASK_REGISTRY))}")
    return found


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if len(parts) >= 3 and parts[0] == "schedules" and parts[1] in ("loss", "task"):
        parts[1:3] = [f"{parts[1]}.{parts[2]}"]  # schedule names hold a dot: schedules.task.<scalar>.<field>
    node = tree
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(items: list[str]) -> list[tuple[str, Any]]:
    """`a.b=3` -> ("a.b", 3); values are parsed as YAML so `x=[1,2]` and `x=null` work."""
    out = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value (e.g. optim.lr=3e-4)")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        out.append((key.strip(), value))
    return out


def resolve_recipe_path(recipe: str) -> Path:
    path = Path(recipe)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise ConfigError(f"recipe file {str(path)!r} does not exist")
        return path
    builtin = RECIPES_DIR / f"{recipe}.yaml"
    if builtin.is_file():
        return builtin
    names = list_recipes()
    close = difflib.get_close_matches(recipe, names, n=2)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise ConfigError(f"unknown recipe {recipe!r}{hint} (built-in: {', '.join(names)}; or a .yaml path)")


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def config_from_dict(tree: dict, source: str = "config") -> Config:
    """Validate a plain dict (a recipe after overrides) into a Config."""
    if not isinstance(tree, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {type(tree).__name__}")
    tree = dict(tree)
    task_tree = dict(tree.pop("task", None) or {})
    task_name = task_tree.get("name", TaskConfig.name)
    try:
        task_cls = registered_task(task_name).config_class
        cfg = build_typed(Config, tree, root=Config)
        cfg.task = build_typed(task_cls, task_tree, "task.", root=Config)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    defaults = DataConfig()
    for key, instead in task_cls.unread_data_keys.items():  # a saved config holds every key at its default
        if getattr(cfg.data, key) != getattr(defaults, key):
            raise ConfigError(f"{source}: data.{key}={getattr(cfg.data, key)}: task {task_name!r} does not read "
                              f"it; {instead}")
    return cfg


def load_config(recipe: str, overrides: list[str] | None = None) -> Config:
    """Load a built-in recipe name or YAML path, apply `key=value` overrides, validate.

    The recipe is validated on its own first, so an error names where the bad key came from: the
    file, or the command line (a mistyped override is not the recipe's fault)."""
    path = resolve_recipe_path(recipe)
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(tree).__name__}")
    cfg = config_from_dict(copy.deepcopy(tree), source=str(path))
    if not overrides:
        return cfg
    for key, value in parse_overrides(overrides):
        _set_dotted(tree, key, value)
    return config_from_dict(tree, source=f"command line (over {path.name})")


def config_to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def flatten(tree: Any, prefix: str = "", whole: Callable[[dict], bool] | None = None) -> dict[str, Any]:
    """A nested mapping as ``{dotted.key: leaf}`` (``optim.lr``), the form compare's config diff, a
    resume's config changes and MLflow's params all show a config in. ``whole(node)``, when given,
    keeps a mapping it returns True for as one leaf (a mapping keyed by regexes, for a store that
    cannot name a key after them); an empty mapping has no leaves."""
    if not isinstance(tree, dict) or (prefix and whole is not None and whole(tree)):
        return {prefix[:-1]: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}{key}.", whole))
    return out


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def describe_keys(cfg: Config) -> list[tuple[str, str, str]]:
    """(dotted key, type, doc) for every key of this config, the task's keys included."""
    rows: list[tuple[str, str, str]] = []

    def walk(obj: Any, prefix: str) -> None:
        hints = typing.get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            low = f.metadata.get("min")
            text = f.metadata.get("doc", "") + (f" (at least {low})" if low is not None else "")
            rows.append((prefix + f.name, type_name(hints[f.name]), text))
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            elif isinstance(value, dict):
                for k, v in value.items():
                    if dataclasses.is_dataclass(v):
                        walk(v, f"{prefix}{f.name}.{k}.")

    walk(cfg, "")
    return rows
