"""Plain values (YAML, overrides) checked against dataclass annotations: the config's types.

Only int -> float is converted (and a YAML 1.1 string such as 3e-4 to float); everything else must
already have its annotated type. Every error names the dotted key and what was expected; an unknown
key gets the closest valid keys, most similar first.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Sequence, Union


class ConfigError(ValueError):
    """A recipe or override does not fit the schema; the message names the key."""


def doc(text: str, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING, *,
        minimum: int | None = None) -> Any:
    """A dataclass field with its documentation attached (shown by `show-config --docs`); ``minimum``
    bounds a number, so that e.g. ``data.batch_size=0`` is an error naming the key, not a crash later."""
    meta = {"doc": text} if minimum is None else {"doc": text, "min": minimum}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(a) for a in typing.get_args(tp))}]"
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        keys.append(prefix + f.name)
        if dataclasses.is_dataclass(tp):
            keys += all_keys(tp, f"{prefix}{f.name}.")
    return keys


def check_value(value: Any, tp: Any, key: str, known: Sequence[str]) -> Any:
    """Check `value` against the annotation `tp`, converting only int -> float."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        for arg in args:
            try:
                return check_value(value, arg, key, known)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in args:
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{key}: expected one of {type_name(tp)}, got {value!r}{hint}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key}: expected null, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {tp.__name__} keys, got {value!r}")
        return build_typed(tp, value, key + ".", known=known)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [check_value(v, args[0], f"{key}[{i}]", known) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return {str(k): check_value(v, args[1], f"{key}.{k}", known) for k, v in value.items()}
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        with contextlib.suppress(ValueError):  # YAML 1.1 reads 3e-4 (no dot) as a string
            return float(value)
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{key}: expected bool (true/false), got {value!r}")
    if tp in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}")
    if isinstance(value, tp):
        return value
    raise ConfigError(f"{key}: expected {type_name(tp)}, got {value!r} ({type(value).__name__})")


def did_you_mean(value: str, candidates: list[str] | tuple[str, ...]) -> str:
    """ " (did you mean 'image-folder'?)" for the closest candidate, or "" when none is close."""
    close = _closest(str(value), list(candidates), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _closest(key: str, candidates: list[str], n: int = 3) -> list[str]:
    """The ``n`` candidates most similar to ``key``, most similar first."""
    close = difflib.get_close_matches(key, candidates, n=n, cutoff=0.6)
    return sorted(close, key=lambda c: -difflib.SequenceMatcher(None, key, c).ratio())


def unknown_key(prefix: str, key: str, names: Sequence[str], known: Sequence[str], hint: str = "") -> ConfigError:
    """The error for ``prefix + key``, not one of ``names``: the closest keys of the whole config
    (``known``) and of its section, then the section's valid keys; ``hint`` says what to set instead."""
    full = prefix + str(key)
    close = set(_closest(full, list(known))) | {prefix + c for c in _closest(str(key), sorted(names))}
    close = _closest(full, sorted(close), n=3) or sorted(close)[:3]
    suggestion = f"; did you mean {', '.join(close)}?" if close else ""
    return ConfigError(f"unknown config key {full!r}{hint}{suggestion} "
                       f"(valid keys under {prefix or 'the top level'}: {', '.join(sorted(names))})")


def build_typed(cls: type, values: dict, prefix: str = "", *, known: Sequence[str]) -> Any:
    """``cls(**values)`` with every value checked against its annotation (nested dataclasses too), and
    an unknown key named with the closest keys of ``known`` (every key of the config) and of its section."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in names:
            raise unknown_key(prefix, key, sorted(names), known)
    kwargs = {k: check_value(v, hints[k], prefix + k, known) for k, v in values.items()}
    for f in dataclasses.fields(cls):
        low, value = f.metadata.get("min"), kwargs.get(f.name)
        if low is not None and isinstance(value, (int, float)) and value < low:  # not "warmup" in float | "warmup"
            floats = hints[f.name] is float or float in typing.get_args(hints[f.name])
            kind = "a number" if floats else "an integer"
            raise ConfigError(f"{prefix}{f.name}: expected {kind} >= {low}, got {value!r}")
    return cls(**kwargs)
