"""Data that reads but is wrong, the same way for the image folder and the detection readers: how
much a skip policy may drop before the run stops, and class names spelled two ways.

A split that loses most of its images or boxes under ``skip`` is more often read wrongly than
dirty (COCO boxes written as x1,y1,x2,y2 lose three in four; a clone without ``git lfs pull`` holds
pointers, not photos), so above ``data.max_skipped_share`` the run stops with the count and, where
the readers noticed one, the likely cause. Class names are taken as written but for the spaces
around them; names equal but for case or spacing ('Tree', 'tree') stay different classes, with a
warning naming both spellings and where each comes from.
"""
from __future__ import annotations

import logging
import math
from typing import Mapping, Sequence

log = logging.getLogger("visiontrain")


def leaves_its_directory(name: str) -> bool:
    """Whether a file name an annotation gives (COCO's ``file_name``, a VOC id or ``<filename>``)
    points outside the directory it is joined to: an absolute path or a ``..`` step. A downloaded
    annotation file names only files under its dataset's directories."""
    return name.startswith(("/", "\\")) or ".." in name.replace("\\", "/").split("/")


def listed(items: Sequence[str], most: int = 5, sep: str = ", ") -> str:
    """The first ``most`` items of a message's list, and how many there are when that is more."""
    shown = sep.join(items[:most])
    return shown + (f"{sep}... ({len(items):,} in all)" if len(items) > most else "")


def likely_cause(causes: Mapping[str, int], skipped: int) -> str:
    """"; likely cause: ..." when one cause the readers noted covers more than half of what was skipped."""
    if not causes:
        return ""
    cause, count = max(causes.items(), key=lambda item: item[1])
    return f"; likely cause: {cause} ({count:,} of the {skipped:,})" if 2 * count > skipped else ""


def check_skipped_share(where: str, what: str, skipped: int, total: int, max_share: float,
                        causes: Mapping[str, int] | None = None, detail: str = "") -> None:
    """Raise when ``skipped`` of ``total`` (images, boxes) is more than ``data.max_skipped_share``:
    one line with the count, the share, the likely cause and the value that would accept it.
    ``what`` says what the skipped ones are ("image files cannot be read"); ``detail``, by reason."""
    if not skipped or skipped <= max_share * total:
        return
    share = skipped / total
    accept = min(math.ceil(share * 100) / 100, 1.0)
    raise ValueError(f"{where}: {skipped:,} of {total:,} {what} ({share:.0%}{'; ' + detail if detail else ''}), "
                     f"more than "
                     f"data.max_skipped_share={max_share:g} lets a run skip{likely_cause(causes or {}, skipped)}; "
                     f"correct the data, or set data.max_skipped_share={accept:g} to train on the other "
                     f"{total - skipped:,}")


def spelling_key(name: str) -> str:
    """What two names equal but for case or spacing have in common."""
    return "".join(name.split()).casefold()


def alike_in(name: str, names: Sequence[str]) -> str:
    """" (differs from 'Tree' only in case or spacing)" when ``names`` holds such a spelling of ``name``."""
    key = spelling_key(name)
    same = [n for n in names if n != name and spelling_key(n) == key]
    return f" (differs from {same[0]!r} only in case or spacing)" if same else ""


def class_difference(train: Sequence[str], other: Sequence[str], train_name: str, other_name: str) -> str:
    """What another split's classes lack and add against the training split's, for an error: the
    names themselves, not two whole lists (among ImageNet's 1,000 the one missing name is lost)."""
    missing = [repr(c) for c in train if c not in set(other)]
    extra = [f"{c!r}{alike_in(c, train)}" for c in other if c not in set(train)]
    parts = ([f"missing from {other_name}: {len(missing):,} ({listed(missing)})"] if missing else []) + \
        ([f"not in {train_name}: {len(extra):,} ({listed(extra)})"] if extra else [])
    return "; ".join(parts) or f"the same names in another order ({listed(list(other))})"


def warn_spelled_alike(where: str, classes: Sequence[tuple[str, str]]) -> None:
    """One warning per group of classes whose names are equal but for case or spacing. ``classes``:
    (name as written, where it comes from: files, a category id) for each class."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for name, origin in classes:
        groups.setdefault(spelling_key(name), []).append((name, origin))
    for group in groups.values():
        if len(group) > 1:
            log.warning("%s: class names equal but for case or spacing are different classes here: %s; if they "
                        "name one class, write it one way", where,
                        " and ".join(f"{name!r} ({origin})" for name, origin in group))
