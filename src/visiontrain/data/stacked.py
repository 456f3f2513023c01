"""Batches a dataset makes whole: a set kept on the GPU (``data.on_device``) indexes, flips and
normalises a batch in a few tensor ops where it lies, and hands the loader the stacked tensors.
Splitting them into samples for ``default_collate`` to stack again would cost a launch and a
Python object per sample, which on a GPU is the step's own time (classify-fashion's step is a few
milliseconds)."""
from __future__ import annotations

from functools import partial
from typing import Any, Callable

from torch.utils.data import default_collate


class Stacked(tuple):
    """A batch already collated by its dataset (``(images [B, ...], labels [B])``): the loader's
    collate passes it on as it is."""


def _collate(collate: Callable[[list[Any]], Any] | None, items: Any) -> Any:
    if isinstance(items, Stacked):
        return tuple(items)
    return (collate or default_collate)(items)


def keep_stacked(collate: Callable[[list[Any]], Any] | None) -> Callable[[Any], Any]:
    """``collate`` (None: torch's default), except that a :class:`Stacked` batch passes through."""
    return partial(_collate, collate)


def as_samples(items: Any) -> Any:
    """A :class:`Stacked` batch as the list of its samples (``(image, label)`` each), what a caller
    that takes the first few samples of a batch expects; anything else as it is."""
    if isinstance(items, Stacked):
        return list(zip(*(t.unbind(0) for t in items)))
    return items
