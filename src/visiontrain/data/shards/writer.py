"""Writing a split's samples into tar shards of about a given size, resumably.

A shard is written as ``NAME.tar.partial``, flushed to the disk, then renamed into place, and only
then listed in ``index.json`` (``layout.write_index`` replaces it in one step). A ``shard`` killed
at any moment thus leaves whole shards, all listed, and at most one ``.partial`` file, which the
next ``shard`` into the same directory removes before it continues from the first sample not yet in
a listed shard. A split's samples file (``samples``) is written from its shards once they are all
there, before the index calls the split complete. The samples go in a fixed shuffle of the reader's
order (``written_order``), so the shards of a resumed run are the bytes a straight run writes (the
tar headers carry no time or owner). The directory's index also records a fingerprint of each split's
samples: continuing into a directory written from other data is refused, naming it.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tarfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from visiontrain.data.shards.layout import (FORMAT, PARTIAL, VERSION, read_index, sample_key, samples_file,
                                            shard_name, write_index)
from visiontrain.data.shards.raw import RawData, RawSplit
from visiontrain.data.shards.samples import write_samples_file

log = logging.getLogger("visiontrain")
TAR_BLOCK = 512
ORDER_SEED = 0


def fingerprint(split: RawSplit) -> str:
    """sha256 of a split's sample count and sources: what makes two writes the same data."""
    digest = hashlib.sha256(f"{split.name}\n{split.count}\n".encode())
    for i in range(split.count):
        digest.update(os.fsencode(split.source(i)) + b"\n")
    return digest.hexdigest()


def _member_bytes(size: int) -> int:
    """What a member of ``size`` bytes takes in a tar: its header and its data padded to a block."""
    return TAR_BLOCK + -(-size // TAR_BLOCK) * TAR_BLOCK


def _archive_bytes(used: int) -> int:
    """The file's size for ``used`` bytes of members and end blocks: tarfile pads it to a record."""
    return -(-used // tarfile.RECORDSIZE) * tarfile.RECORDSIZE


def _members(kind: str, key: str, ext: str, image: bytes, labels: dict[str, Any]) -> list[tuple[str, bytes]]:
    members = [(f"{key}.{ext}", image), (f"{key}.json", json.dumps(labels).encode())]
    if kind == "classification":
        members.append((f"{key}.cls", str(labels["label"]).encode()))
    return members


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644  # no time or owner: a rewrite is the same bytes
    tar.addfile(info, io.BytesIO(data))


def written_order(count: int) -> np.ndarray:
    """The reader's sample at each position of a split's shards: a fixed shuffle (``ORDER_SEED``).
    Readers list an image folder class by class and COCO by id; a run reads whole shards in turn and
    shuffles only within a buffer, so shards in the reader's order would feed it one class at a time."""
    return np.random.default_rng(ORDER_SEED).permutation(count)


def write_shard(split: RawSplit, kind: str, start: int, path: Path, shard_size: int,
                advance: Callable[[int], None]) -> int:
    """Samples from position ``start`` on (``written_order``) into the tar at ``path`` until the next
    would pass ``shard_size`` (a shard holds at least one); the number written. The file is on the disk
    when this returns."""
    written, used = 0, 2 * TAR_BLOCK  # a tar ends with two zero blocks
    order = written_order(split.count)
    with open(path, "wb") as f:
        with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for position in range(start, split.count):
                ext, image, labels = split.load(int(order[position]))
                members = _members(kind, sample_key(position), ext, image, labels)
                cost = sum(_member_bytes(len(data)) for _, data in members)
                if written and _archive_bytes(used + cost) > shard_size:
                    break
                for name, data in members:
                    _add(tar, name, data)
                written, used = written + 1, used + cost
                advance(1)
        f.flush()
        os.fsync(f.fileno())
    return written


def _check_listed(out: Path, entry: dict[str, Any]) -> None:
    """Every shard the index lists is there with its size, or the directory cannot be continued."""
    for shard in entry["shards"]:
        path = out / shard["name"]
        if not path.is_file() or path.stat().st_size != shard["bytes"]:
            found = f"{path.stat().st_size:,} bytes" if path.is_file() else "missing"
            raise ValueError(f"{path}: listed in {out / 'index.json'} with {shard['bytes']:,} bytes, but {found}; "
                             f"remove the directory (or the index) to write the shards again")


def write_split(split: RawSplit, kind: str, out: Path, index: dict[str, Any], shard_size: int,
                advance: Callable[[int], None]) -> None:
    """The split's shards after those the index already lists, the index rewritten after each."""
    entry = index["splits"][split.name]
    _check_listed(out, entry)
    position = sum(shard["samples"] for shard in entry["shards"])
    advance(position)
    while position < split.count:
        name = shard_name(split.name, len(entry["shards"]))
        partial = out / (name + PARTIAL)
        count = write_shard(split, kind, position, partial, shard_size, advance)
        os.replace(partial, out / name)
        entry["shards"].append({"name": name, "samples": count, "bytes": (out / name).stat().st_size})
        write_index(out, index)
        position += count
        log.info("%s: %s samples (%s of %s in split %s)", out / name, f"{count:,}", f"{position:,}",
                 f"{split.count:,}", split.name)
    entry["samples_file"] = samples_file(split.name)
    write_samples_file(out, entry["samples_file"], entry, kind)
    entry["complete"] = True
    write_index(out, index)


def start_index(raw: RawData, out: Path, data_section: dict[str, Any]) -> dict[str, Any]:
    """The directory's index: the one there (refused if it was written from other data), or a new one."""
    prints = {split.name: fingerprint(split) for split in raw.splits}
    index = read_index(out)
    if index is not None:
        if index["source"]["fingerprint"] != prints:
            counts = ", ".join(f"{name}: {entry['samples']:,}" for name, entry in index["splits"].items())
            raise ValueError(f"{out}: holds shards of other data ({index['source']['data'].get('name')!r}, "
                             f"{counts} samples); write to another --out, or remove it first")
        return index
    index = {"format": FORMAT, "version": VERSION, "kind": raw.kind, "class_names": raw.class_names,
             "order": {"shuffled": True, "seed": ORDER_SEED},
             "source": {"data": data_section, "fingerprint": prints},
             "splits": {s.name: {"samples": s.count, "complete": False, "shards": []} for s in raw.splits}}
    if raw.category_ids is not None:
        index["category_ids"] = raw.category_ids
    if raw.kind == "classification":
        index["pixel_max"] = raw.pixel_max
    return index


def write_shards(raw: RawData, out: Path, shard_size: int, data_section: dict[str, Any],
                 advance: Callable[[int], None] = lambda n: None) -> dict[str, Any]:
    """Every split of ``raw`` into ``out``, continuing what a killed write left (module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    index = start_index(raw, out, data_section)
    for leftover in out.glob(f"*{PARTIAL}"):
        leftover.unlink()
    for split in raw.splits:
        if not index["splits"][split.name]["complete"]:
            write_split(split, raw.kind, out, index, shard_size, advance)
    return index
