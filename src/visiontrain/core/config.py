"""Recipes: YAML -> typed dataclasses, with `key=value` overrides and errors that name the key.

This module loads, merges and validates; it defines no section. Each section's dataclass sits
beside the part or task that reads it, which registers it here (:func:`register_section`): the
engine's parts their ``trainer``, ``eval``, ``checkpoint``... sections, each data source its kind of
``data`` section and each task its ``task`` section (:func:`register_kind`, typed by the section's
``name`` key). A module above a section's owner may add keys to it (:func:`extend_section`:
``eval.coco_backend`` is read by detection, while the engine's ``eval`` dataclass names no box).
Every key is a dataclass field with a type and a one-line doc (``doc``). Unknown keys
are errors that suggest the closest valid keys; wrong types name the key and the expected type.
Which modules register is written in one place, ``visiontrain.catalog``: every loader here
(:func:`load_config`, :func:`config_from_dict`, ``Config()``) imports it first, so a config means
the same whichever module a process imported first.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from visiontrain import catalog
from visiontrain.core import safe_yaml
from visiontrain.core.typed_config import (ConfigError, all_keys, build_typed, check_value, did_you_mean, doc,
                                           type_name, unknown_key)

__all__ = ["Config", "ConfigError", "SECTIONS", "Section", "config_from_dict", "config_to_dict", "describe_keys",
           "doc", "dump_config", "extend_section", "flatten", "list_recipes", "load_config", "parse_overrides",
           "register_kind", "register_section"]

RECIPES_DIR = Path(__file__).parents[1] / "recipes"
#: The order a dumped config and `show-config --docs` list the built-in sections in (a recipe's
#: order); a section registered later comes after them, in the order of registration.
LISTED_FIRST = ("task", "data", "optim", "schedules", "trainer", "ema", "eval", "checkpoint", "distributed",
                "logging")
SEED_DOC = "seed for sampling, augmentation and initialisation"


@dataclass
class Section:
    """A top-level key of a recipe and the type its value is checked against: a dataclass, another
    annotation (``schedules`` is ``dict[str, ScheduleConfig]``), or, for a section typed by its
    ``name`` key (``task``, ``data``), the dataclass registered for that name in ``kinds``."""
    name: str
    annotation: Any
    doc: str
    default_kind: str | None = None            # the ``name`` a section typed by name has when unset
    kinds: dict[str, type] = field(default_factory=dict)
    noun: str = ""                              # what the name names, for an error: "task", "dataset"

    def kind_class(self, tree: Any) -> Any:
        """The annotation this section's value ``tree`` is checked against."""
        if self.default_kind is None:
            extra = EXTRA_KEYS.get(self.name)
            return _with_keys(self.annotation, extra) if extra else self.annotation
        name = tree.get("name", self.default_kind) if isinstance(tree, dict) else self.default_kind
        found = self.kinds.get(name) if isinstance(name, str) else None
        if found is None:
            hint = did_you_mean(str(name), list(self.kinds))
            raise ConfigError(f"{self.name}.name: unknown {self.noun} {name!r}{hint}; "
                              f"expected one of {', '.join(sorted(self.kinds))}")
        return found

    def default(self) -> Any:
        kind = self.kind_class({})
        return build_typed(kind, {}, f"{self.name}.", known=[]) if dataclasses.is_dataclass(kind) else \
            typing.get_origin(kind)()


#: Every section, by its top-level key. Filled by register_section where each section is defined.
SECTIONS: dict[str, Section] = {}
#: Keys added to a section by modules other than its owner, by section (filled by extend_section).
EXTRA_KEYS: dict[str, tuple[type, ...]] = {}


def register_section(name: str, annotation: Any, doc_text: str, *, typed_by_name: str | None = None,
                     noun: str = "") -> Any:
    """Make ``name:`` a section of every recipe, checked against ``annotation``. ``typed_by_name``:
    the section is typed by its own ``name`` key (the dataclass :func:`register_kind` registered for
    it), and this is the name it has when a recipe sets none. Returns ``annotation``."""
    if name == "seed" or not name.isidentifier():
        raise ValueError(f"register_section({name!r}): a section's name is an identifier other than 'seed'")
    if name in SECTIONS and typed_by_name is not None:  # a kinded section keeps the kinds registered so far
        SECTIONS[name] = dataclasses.replace(SECTIONS[name], annotation=annotation, doc=doc_text,
                                             default_kind=typed_by_name, noun=noun)
    else:
        SECTIONS[name] = Section(name, annotation, doc_text, typed_by_name, noun=noun)
    return annotation


def extend_section(name: str, keys: type) -> type:
    """Add the fields of the dataclass ``keys`` to the section ``name`` (a dataclass section, not
    one typed by name): the key sits where a user looks for it (``eval.coco_backend``) while the
    module that reads it stays above the section's owner, which never names it. The section's values
    are then of a dataclass subclassing both, so its owner reads them as before. Every field of
    ``keys`` needs a default. Either module may be imported first. Returns ``keys``."""
    section = SECTIONS.get(name)
    if section is not None and section.default_kind is not None:
        raise ValueError(f"extend_section({name!r}): a section typed by its name gets keys through register_kind")
    if not dataclasses.is_dataclass(keys):
        raise ValueError(f"extend_section({name!r}): expected a dataclass of keys, got {keys!r}")
    ours = {f.name for f in dataclasses.fields(keys)}
    others = [k for k in EXTRA_KEYS.get(name, ()) if (k.__module__, k.__qualname__) != (keys.__module__,
                                                                                       keys.__qualname__)]
    owner = [section.annotation] if section is not None and dataclasses.is_dataclass(section.annotation) else []
    taken = ours & {f.name for other in owner + others for f in dataclasses.fields(other)}
    if taken:
        raise ValueError(f"extend_section({name!r}, {keys.__name__}): {name} already has {', '.join(sorted(taken))}")
    EXTRA_KEYS[name] = (*others, keys)
    return keys


@functools.lru_cache(maxsize=None)
def _with_keys(base: type, extra: tuple[type, ...]) -> type:
    """The dataclass of a section with keys added (``extend_section``), the owner's keys listed first:
    one class per combination, so two configs built from the same sections compare equal. It is
    built at run time, so a value pickles as its parts (a DataLoader worker, a spawned process)."""
    def reduce(value: Any) -> tuple:
        return _section_value, (base, extra, {f.name: getattr(value, f.name) for f in dataclasses.fields(value)})

    bases = (*extra[::-1], base)  # fields are collected from the last base on: the owner's come first
    combined = dataclasses.make_dataclass(base.__name__, [], bases=bases, namespace={"__reduce__": reduce})
    combined.__doc__ = base.__doc__
    return combined


def _section_value(base: type, extra: tuple[type, ...], values: dict[str, Any]) -> Any:
    """A value of ``_with_keys(base, extra)`` from its fields (unpickling)."""
    return _with_keys(base, extra)(**values)


def register_kind(section: str, name: str, config_class: type) -> type:
    """Make ``SECTION.name: NAME`` type the section by ``config_class`` (a dataclass whose ``name``
    field defaults to NAME); registering a name again replaces it. Returns ``config_class``."""
    if not (dataclasses.is_dataclass(config_class) and "name" in {f.name for f in dataclasses.fields(config_class)}):
        raise ValueError(f"register_kind({section!r}, {name!r}): expected a dataclass with a 'name' field, "
                         f"got {config_class!r}")
    SECTIONS.setdefault(section, Section(section, config_class, "", name)).kinds[name] = config_class
    return config_class


def listed_sections() -> list[Section]:
    """The sections in the order a recipe lists them (:data:`LISTED_FIRST`, then the others)."""
    first = [SECTIONS[n] for n in LISTED_FIRST if n in SECTIONS]
    return first + [s for n, s in SECTIONS.items() if n not in LISTED_FIRST]


class Config:
    """A run's settings: ``seed`` and one attribute per registered section (``cfg.trainer.epochs``),
    each of the type its owner registered. A part or task is handed its own section; the whole
    Config travels only to what builds the run and what records it."""

    seed: int

    def __init__(self, seed: int = 0, **sections: Any) -> None:
        catalog.load()  # every built-in section registered (the one arrow from core up, on purpose)
        self.seed = seed
        for section in listed_sections():
            setattr(self, section.name, sections.pop(section.name) if section.name in sections else section.default())
        if sections:
            raise TypeError(f"Config: no section {', '.join(sorted(sections))} is registered")

    def __getattr__(self, name: str) -> Any:
        """Only reached for a name that is not set: a section nobody registered."""
        raise AttributeError(f"the config has no section {name!r} (registered: {', '.join(SECTIONS)})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and vars(self) == vars(other)

    def __repr__(self) -> str:
        return f"Config({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


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
            value = safe_yaml.load(raw) if raw != "" else ""
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
    catalog.load()
    try:
        return _typed_config(dict(tree))
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None


def _typed_config(tree: dict) -> Config:
    for key in tree:
        if key != "seed" and key not in SECTIONS:
            raise unknown_key("", key, ["seed", *SECTIONS], ["seed", *SECTIONS])
    kinds = {s.name: s.kind_class(tree.get(s.name) or {}) for s in SECTIONS.values()}
    known = ["seed", *[k for name, kind in kinds.items() for k in _keys(name, kind)]]
    task_keys = getattr(kinds.get("task"), "unread_data_keys", {})
    if "data" in kinds and isinstance(tree.get("data"), dict):
        tree["data"] = _drop_unread_data_keys(tree["data"], kinds["data"], tree.get("task") or {}, task_keys)
    sections = {name: build_typed(kind, tree.get(name) or {}, f"{name}.", known=known)
                if dataclasses.is_dataclass(kind) else _checked(kind, tree.get(name), name, known)
                for name, kind in kinds.items()}
    seed = _checked(int, tree.get("seed", 0), "seed", known)
    return Config(seed, **sections)


def _keys(name: str, kind: Any) -> list[str]:
    return [name, *all_keys(kind, f"{name}.")] if dataclasses.is_dataclass(kind) else [name]


def _checked(annotation: Any, value: Any, key: str, known: list[str]) -> Any:
    """A section that is no dataclass (``schedules``), or the seed: its value checked; unset, its default."""
    if value is None and typing.get_origin(annotation) is dict:
        return {}
    return check_value(value, annotation, key, known)


def _drop_unread_data_keys(data: dict, kind: type, task: dict, task_keys: dict[str, str]) -> dict:
    """``data`` without the keys its source does not read that hold their default (a saved config, or
    one from before the data section was split by source, lists every key); a key set to anything
    else is refused: one the task does not read names what it reads instead, another the sources
    that read it."""
    own = {f.name: f for f in dataclasses.fields(kind)}
    own_defaults, defaults = dataclasses.asdict(kind()), _data_defaults()
    out = {}
    for key, value in data.items():
        # the source's own default where it has the key (train_split is "train" for an image folder,
        # "training" for ADE20K), else any source's
        at_default = value == own_defaults[key] if key in own_defaults else value in defaults.get(key, [])
        if key in task_keys and not at_default:
            raise ConfigError(f"data.{key}={value}: task {task.get('name', SECTIONS['task'].default_kind)!r} "
                              f"does not read it; {task_keys[key]}")
        if key in own and key not in task_keys or not at_default:
            out[key] = value
    for key in set(out) - set(own):
        readers = sorted(n for n, k in SECTIONS["data"].kinds.items() if key in {f.name for f in dataclasses.fields(k)})
        hint = f" (data.name {data.get('name', SECTIONS['data'].default_kind)!r} does not read it; " \
               f"{', '.join(readers)} do)" if readers else ""
        raise unknown_key("data.", key, sorted(own), [f"data.{k}" for k in own], hint)
    return out


def _data_defaults() -> dict[str, list[Any]]:
    """Each data key's defaults, over every registered source (in their names' order: the same
    whatever order their modules were imported in); sources may differ (their split names)."""
    out: dict[str, list[Any]] = {}
    kinds = SECTIONS["data"].kinds
    for kind in (kinds[name] for name in sorted(kinds)):
        for key, value in dataclasses.asdict(kind()).items():
            if value not in out.setdefault(key, []):
                out[key].append(value)
    return out


def load_config(recipe: str, overrides: list[str] | None = None, *, source: str = "command line") -> Config:
    """Load a built-in recipe name or YAML path, apply `key=value` overrides, validate.

    The recipe is validated on its own first, so an error names where the bad key came from: the
    file, or the overrides' ``source`` (a mistyped override is not the recipe's fault; ``tune`` names
    its search-space file)."""
    path = resolve_recipe_path(recipe)
    try:
        tree = safe_yaml.load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(tree).__name__}")
    cfg = config_from_dict(copy.deepcopy(tree), source=str(path))
    if not overrides:
        return cfg
    for key, value in parse_overrides(overrides):
        _set_dotted(tree, key, value)
    return config_from_dict(tree, source=f"{source} (over {path.name})")


def config_to_dict(cfg: Config) -> dict:
    """The config as plain values, the form a checkpoint, config.yaml and MLflow's params keep."""
    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return dataclasses.asdict(value)
        return {k: plain(v) for k, v in value.items()} if isinstance(value, dict) else copy.deepcopy(value)

    return {key: plain(value) for key, value in vars(cfg).items()}


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
    """(dotted key, type, doc) for every key of this config, the task's and the data source's included."""
    rows: list[tuple[str, str, str]] = [("seed", "int", SEED_DOC)]

    def walk(obj: Any, prefix: str) -> None:
        hints = typing.get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            low = f.metadata.get("min")
            text = f.metadata.get("doc", "") + (f" (at least {low})" if low is not None else "")
            rows.append((prefix + f.name, type_name(hints[f.name]), text))
            nested(getattr(obj, f.name), f"{prefix}{f.name}.")

    def nested(value: Any, prefix: str) -> None:
        if dataclasses.is_dataclass(value):
            walk(value, prefix)
        elif isinstance(value, dict):
            for k, v in value.items():
                if dataclasses.is_dataclass(v):
                    walk(v, f"{prefix}{k}.")

    for section in listed_sections():
        value = getattr(cfg, section.name)
        kind = type(value) if dataclasses.is_dataclass(value) else section.annotation
        rows.append((section.name, type_name(kind), section.doc))
        nested(value, f"{section.name}.")
    return rows
