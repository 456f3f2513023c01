"""The shards' names, their index file and what a shard size is written as.

``index.json``::

    {"format": "visiontrain-shards", "version": 2,
     "kind": "classification" | "detection" | "semantic" | "panoptic", "class_names": [...],
     "category_ids": [...] (detection), "pixel_max": 255 (the in-memory sets' white: digits' is 16),
     "ignore_index": 255 (semantic: the label maps' value of no class),
     "categories": [{"id", "name", "isthing"}, ...] (panoptic: as its JSON lists them),
     "order": {"shuffled": true, "seed": 0} (the samples' order in the shards: ``writer.written_order``),
     "source": {"data": {the data section it was written from}, "fingerprint": {split: sha256 of its samples}},
     "splits": {"train": {"samples": N, "complete": true,
                          "shards": [{"name": "train-000000.tar", "samples": n, "bytes": b}, ...],
                          "samples_file": "train-samples.npz"}, ...}}

It is rewritten (atomically) after every finished shard, so a killed ``shard`` knows which shards are
whole: a split is done when ``complete`` is true, and the samples of its listed shards are the first
ones of the split, in order. A complete split also has its samples file (``samples``): where each
sample lies in its shard and its labels, so a run reads any sample without reading the shards before it.

A sample's members are ``KEY.EXT`` (its image, EXT without a dot), ``KEY.json`` (its labels),
``KEY.cls`` (classification) and the label files a kind adds, named ``KEY.ROLE.png``
(``LABEL_MAP_MEMBER``, ``PANOPTIC_MEMBER``): a member whose extension has a dot is never the image.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

FORMAT, VERSION = "visiontrain-shards", 2
INDEX_FILE = "index.json"
PARTIAL = ".partial"  # a shard being written; never listed in the index
KEY_DIGITS = 9  # sample keys: the sample's position in its split, zero-padded
TAR_BLOCK = 512  # a tar header, and the unit every member's data is padded to
#: The label files a sample of a kind carries beside its image and JSON, by extension: semantic
#: shards' label map (grey PNG, one class a pixel) and panoptic shards' id PNG (COCO's colours).
LABEL_MAP_MEMBER, PANOPTIC_MEMBER = "seg.png", "pan.png"
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def shard_name(split: str, number: int) -> str:
    return f"{split}-{number:06d}.tar"


def padded(size: int) -> int:
    """The bytes ``size`` bytes of member data take in a tar: a whole number of blocks."""
    return -(-size // TAR_BLOCK) * TAR_BLOCK


def samples_file(split: str) -> str:
    return f"{split}-samples.npz"


def sample_key(position: int) -> str:
    return f"{position:0{KEY_DIGITS}d}"


def expand_braces(pattern: str) -> list[str]:
    """``train-{000000..000003}.tar`` (zero-padded as the first bound is) and ``{a,b}`` alternatives,
    expanded in order, as the shell and WebDataset's brace patterns do."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    head, tail, body = pattern[:match.start()], pattern[match.end():], match.group(1)
    numbers = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if numbers:
        first, last = numbers.group(1), numbers.group(2)
        if int(last) < int(first):
            raise ValueError(f"{pattern}: the range {{{body}}} runs backwards")
        choices = [str(n).zfill(len(first)) for n in range(int(first), int(last) + 1)]
    else:
        choices = body.split(",")
    return [f"{head}{choice}{rest}" for choice in choices for rest in expand_braces(tail)]


def split_pattern(shards: str) -> tuple[str, tuple[str, ...]]:
    """``data.shards`` as (the directory holding index.json, the shard names a brace pattern picks:
    none when it names the directory)."""
    if "{" not in shards:
        return shards.rstrip("/"), ()
    directory, _, names = shards.rstrip("/").rpartition("/")
    if "{" in directory or not directory:
        raise ValueError(f"data.shards={shards}: a brace pattern may only name shards of one directory, "
                         f"such as s3://bucket/prefix/train-{{000000..000099}}.tar")
    return directory, tuple(expand_braces(names))


def parse_size(text: str) -> int:
    """``--shard-size``: bytes, or a number with a unit (``500MB``, ``1GB``, ``256MiB``, ``64k``)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"--shard-size: expected bytes or a size such as 500MB, 1GB or 256MiB, got {text!r}")
    size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
    if size < 1:
        raise ValueError(f"--shard-size: must be at least 1 byte, got {text!r}")
    return size


def read_index(directory: Path) -> dict[str, Any] | None:
    """The index of a local shard directory; None where there is none yet."""
    path = directory / INDEX_FILE
    if not path.is_file():
        return None
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ValueError(f"{path}: not a readable shard index ({err})") from None
    return parse_index(text, str(path))


def parse_index(text: str, where: str) -> dict[str, Any]:
    """A shard index from its text; one that is not a shard index is an error naming ``where``."""
    try:
        index = json.loads(text)
    except ValueError as err:
        raise ValueError(f"{where}: not a readable shard index ({err})") from None
    except RecursionError:
        raise ValueError(f"{where}: not a readable shard index (nested too deeply for a JSON reader)") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"{where}: not a visiontrain shard index (no \"format\": \"{FORMAT}\")")
    if index.get("version") != VERSION:
        raise ValueError(f"{where}: shard index version {index.get('version')!r}; this visiontrain reads version "
                         f"{VERSION} (write the shards again with `visiontrain shard`)")
    for split, entry in (index.get("splits") or {}).items():
        named = [("samples_file", entry.get("samples_file"))] if "samples_file" in entry else []
        named += [(f"shards[{i}].name", s.get("name")) for i, s in enumerate(entry.get("shards", []))]
        for key, name in named:
            if not _plain_file_name(name):
                raise ValueError(f"{where}: splits.{split}.{key} is {name!r}; expected a file name in the shard "
                                 f"directory (a downloaded index names nothing outside it)")
    return index


def _plain_file_name(name: Any) -> bool:
    """A name ``visiontrain shard`` could have written: one file in the shard directory itself."""
    return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def write_index(directory: Path, index: dict[str, Any]) -> None:
    """Replace the index in one step: a kill leaves the old one or the new one, never half of one."""
    write_atomically(directory / INDEX_FILE, json.dumps(index, indent=1).encode("utf-8"))


def write_atomically(path: Path, data: bytes) -> None:
    """``data`` as the file ``path``, written beside it, flushed to the disk, then renamed into place."""
    tmp = path.with_name(path.name + PARTIAL)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
