"""YAML from files a user may have been sent: recipes, ``tune --space`` files, overrides, a YOLO
``data.yaml``, another run's ``config.yaml``.

PyYAML's safe loader builds no objects, but it keeps an alias as a second reference to its anchor's
value, so a few hundred bytes ("billion laughs": nine levels of ten aliases each) load in
microseconds into a structure of 10^9 values, which then hangs whatever walks it: a dataclass copy,
an error message's ``repr``, a list of class names. ``load`` counts the values a document expands to
and stops at ``MAX_VALUES`` (a recipe has a few hundred, a data.yaml one per class), raising
``TooLarge``, a ``yaml.YAMLError``: every caller already turns that into its one-line "not valid
YAML" error naming the file. A document nested deeper than ``MAX_DEPTH`` (a recipe is 3 levels
deep; ``[[[[...]]]]`` a thousand deep exhausts PyYAML's recursion) is refused the same way.
"""
from __future__ import annotations

from typing import IO, Any

import yaml

MAX_VALUES = 100_000
MAX_DEPTH = 100


class TooLarge(yaml.YAMLError):
    """A document whose aliases expand it past ``MAX_VALUES`` values, or nested past ``MAX_DEPTH``."""


def load(stream: str | bytes | IO[str]) -> Any:
    """``yaml.safe_load``, refusing a document that expands past ``MAX_VALUES`` values or nests
    deeper than ``MAX_DEPTH``."""
    try:
        data = yaml.safe_load(stream)
    except RecursionError:
        raise TooLarge(f"it is nested deeper than {MAX_DEPTH} levels; refused") from None
    count, todo = 0, [(data, 1)]
    while todo:  # each alias counted as often as it appears: the size a walk of the data would meet
        node, depth = todo.pop()
        count += 1
        if count > MAX_VALUES:
            raise TooLarge(f"it expands to more than {MAX_VALUES:,} values through its anchors and aliases "
                           f"(&name, *name); refused")
        if depth > MAX_DEPTH:
            raise TooLarge(f"it is nested deeper than {MAX_DEPTH} levels; refused")
        if isinstance(node, dict):
            todo.extend((child, depth + 1) for child in (*node.keys(), *node.values()))
        elif isinstance(node, (list, tuple, set)):
            todo.extend((child, depth + 1) for child in node)
    return data
