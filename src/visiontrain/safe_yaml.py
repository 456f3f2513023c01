"""YAML from files a user may have been sent: recipes, ``tune --space`` files, overrides, a YOLO
``data.yaml``, another run's ``config.yaml``.

PyYAML's safe loader builds no objects, but it keeps an alias as a second reference to its anchor's
value, so a few hundred bytes ("billion laughs": nine levels of ten aliases each) load in
microseconds into a structure of 10^9 values, which then hangs whatever walks it: a dataclass copy,
an error message's ``repr``, a list of class names. ``load`` counts the values a document expands to
and stops at ``MAX_VALUES`` (a recipe has a few hundred, a data.yaml one per class), raising
``TooLarge``, a ``yaml.YAMLError``: every caller already turns that into its one-line "not valid
YAML" error naming the file.
"""
from __future__ import annotations

from typing import IO, Any

import yaml

MAX_VALUES = 100_000


class TooLarge(yaml.YAMLError):
    """A document whose aliases expand it past ``MAX_VALUES`` values."""


def load(stream: str | bytes | IO[str]) -> Any:
    """``yaml.safe_load``, refusing a document that expands past ``MAX_VALUES`` values."""
    data = yaml.safe_load(stream)
    count, todo = 0, [data]
    while todo:  # each alias counted as often as it appears: the size a walk of the data would meet
        node = todo.pop()
        count += 1
        if count > MAX_VALUES:
            raise TooLarge(f"it expands to more than {MAX_VALUES:,} values through its anchors and aliases "
                           f"(&name, *name); refused")
        if isinstance(node, dict):
            todo.extend(node.keys())
            todo.extend(node.values())
        elif isinstance(node, (list, tuple, set)):
            todo.extend(node)
    return data
