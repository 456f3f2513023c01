"""Writing a split's samples into tar shards of about a given size, resumably.

A shard is written as ``NAME.tar.partial``, flushed to the disk, then renamed into place, and only
then listed in ``index.json`` (``layout.write_index`` replaces it in one step). A ``shard`` killed
at any moment thus leaves whole shards, all listed, and at most one ``.partial`` file, which the
next ``shard`` into the same directory removes before it continues from the first sample not yet in
a listed shard. Each shard is read back into a scan (``samples.write_shard_scan``) before it is
listed, and a split's samples file is written from those scans once its shards are all there, before
the index calls the split complete. A write to a URL (``write_shards_to``) does all this in a local
staging directory and uploads each file once whole, a shard's local copy then removed. The samples
go in a fixed shuffle of the reader's order (``written_order``), so the shards of a resumed run are
the bytes a straight run writes (the tar headers carry no time or owner). The directory's index also
records a fingerprint of each split's samples: continuing into a directory written from other data
is refused, naming it.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from visiontrain.data.shards.layout import (FORMAT, INDEX_FILE, PARTIAL, TAR_BLOCK, VERSION, padded, parse_index,
                                            read_index, sample_key, samples_file, shard_name, write_index)
from visiontrain.data.shards.raw import RawData, RawSample, RawSplit
from visiontrain.data.shards.samples import shard_sidecar, write_samples_file, write_shard_scan
from visiontrain.data.shards.storage import ShardStore, is_url

log = logging.getLogger("visiontrain")
ORDER_SEED = 0
Publish = Callable[[Path], None]


def fingerprint(split: RawSplit) -> str:
    """sha256 of a split's sample count and sources: what makes two writes the same data."""
    digest = hashlib.sha256(f"{split.name}\n{split.count}\n".encode())
    for i in range(split.count):
        digest.update(os.fsencode(split.source(i)) + b"\n")
    return digest.hexdigest()


def _member_bytes(size: int) -> int:
    """What a member of ``size`` bytes takes in a tar: its header and its data padded to a block."""
    return TAR_BLOCK + padded(size)


def _archive_bytes(used: int) -> int:
    """The file's size for ``used`` bytes of members and end blocks: tarfile pads it to a record."""
    return -(-used // tarfile.RECORDSIZE) * tarfile.RECORDSIZE


def _members(kind: str, key: str, sample: RawSample) -> list[tuple[str, bytes]]:
    """A sample's tar members: its image, its labels, a classification sample's class as text, and
    the label files its kind adds (``RawSample.extra``), each named by the sample's key."""
    members = [(f"{key}.{sample.ext}", sample.image), (f"{key}.json", json.dumps(sample.labels).encode())]
    if kind == "classification":
        members.append((f"{key}.cls", str(sample.labels["label"]).encode()))
    return members + [(f"{key}.{ext}", data) for ext, data in sample.extra]


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644  # no time or owner: a rewrite is the same bytes
    tar.addfile(info, io.BytesIO(data))


def written_order(count: int) -> np.ndarray:
    """The reader's sample at each position of a split's shards: a fixed shuffle (``ORDER_SEED``).
    Readers list an image folder class by class and COCO by id; a run reads whole shards in turn and
    shuffles only within a buffer, so shards in the reader's order would feed it one class at a time."""
    return np.random.default_rng(ORDER_SEED).permutation(count)


def write_shard(split: RawSplit, kind: str, order: np.ndarray, start: int, path: Path, shard_size: int,
                advance: Callable[[int], None]) -> int:
    """The samples of ``order`` (``written_order``) from position ``start`` on into the tar at
    ``path``, until the next would pass ``shard_size`` (a shard holds at least one); the number
    written. The file is on the disk when this returns."""
    written, used = 0, 2 * TAR_BLOCK  # a tar ends with two zero blocks
    with open(path, "wb") as f:
        with tarfile.open(fileobj=f, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for position in range(start, split.count):
                members = _members(kind, sample_key(position), split.load(int(order[position])))
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


def _check_listed(out: Path, entry: dict[str, Any], kept: bool) -> None:
    """Every shard the index lists has its scan (and, where shards are ``kept`` here, is here with its
    size), or the directory cannot be continued."""
    for shard in entry["shards"]:
        path, scan = out / shard["name"], out / shard_sidecar(shard["name"])
        if not scan.is_file() or (kept and (not path.is_file() or path.stat().st_size != shard["bytes"])):
            found = f"{path.stat().st_size:,} bytes" if path.is_file() else "missing"
            raise ValueError(f"{path}: listed in {out / 'index.json'} with {shard['bytes']:,} bytes, but {found} "
                             f"or without its scan; remove the directory (or the index) to write the shards again")


def write_split(split: RawSplit, kind: str, out: Path, index: dict[str, Any], shard_size: int,
                advance: Callable[[int], None], publish: Publish | None = None) -> None:
    """The split's shards after those the index already lists, the index rewritten after each.
    ``publish(path)``: each finished file to its destination (``shard --out URL``), after which a
    shard's local copy goes."""
    entry = index["splits"][split.name]
    _check_listed(out, entry, kept=publish is None)
    position = sum(shard["samples"] for shard in entry["shards"])
    advance(position)
    order = written_order(split.count)
    while position < split.count:
        name = shard_name(split.name, len(entry["shards"]))
        partial = out / (name + PARTIAL)
        count = write_shard(split, kind, order, position, partial, shard_size, advance)
        os.replace(partial, out / name)
        listed = {"name": name, "samples": count, "bytes": (out / name).stat().st_size}
        write_shard_scan(out, len(entry["shards"]), listed)
        if publish is not None:
            publish(out / name)
            (out / name).unlink()
        entry["shards"].append(listed)
        _write_index(out, index, publish)
        position += count
        log.info("%s: %s samples (%s of %s in split %s)", name, f"{count:,}", f"{position:,}",
                 f"{split.count:,}", split.name)
    entry["samples_file"] = samples_file(split.name)
    write_samples_file(out, entry["samples_file"], entry, kind)
    if publish is not None:
        publish(out / entry["samples_file"])
    entry["complete"] = True
    _write_index(out, index, publish)
    for shard in entry["shards"]:
        (out / shard_sidecar(shard["name"])).unlink()


def _write_index(out: Path, index: dict[str, Any], publish: Publish | None) -> None:
    write_index(out, index)
    if publish is not None:
        publish(out / INDEX_FILE)


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
    return {**index, **raw.index_keys}


def staging_for(url: str) -> Path:
    """Where a write to ``url`` keeps its index and scans (and each shard until it is uploaded): the
    same directory for the same URL, so a killed write continues."""
    return Path(tempfile.gettempdir()) / f"visiontrain-shard-{hashlib.sha256(url.encode()).hexdigest()[:16]}"


def write_shards_to(raw: RawData, out: str, shard_size: int, data_section: dict[str, Any],
                    advance: Callable[[int], None] = lambda n: None, staging: Path | None = None) -> dict[str, Any]:
    """``write_shards`` into a directory, or to a URL (fsspec): each file is written in ``staging``
    first and uploaded once whole, a shard's local copy then removed, so the machine holds one shard
    at a time besides the index and the scans; the staging directory goes once the write is done."""
    if not is_url(out):
        return write_shards(raw, Path(out), shard_size, data_section, advance)
    store, staging = ShardStore(out), staging or staging_for(out)
    if read_index(staging) is None and store.exists(INDEX_FILE):
        remote = parse_index(store.read(INDEX_FILE).decode("utf-8"), store.url(INDEX_FILE))
        if not all(entry["complete"] for entry in remote["splits"].values()):
            raise ValueError(f"{out}: holds an unfinished write whose staging directory ({staging}) is not on this "
                             f"machine; pass --staging with that directory, or remove what is at {out}")
        staging.mkdir(parents=True, exist_ok=True)
        write_index(staging, remote)  # finished: nothing left to write, unless it is other data (refused)
    index = write_shards(raw, staging, shard_size, data_section, advance,
                         publish=lambda path: store.put(str(path), path.name))
    shutil.rmtree(staging)  # all of it is at the URL now; a rerun reads the index there
    return index


def write_shards(raw: RawData, out: Path, shard_size: int, data_section: dict[str, Any],
                 advance: Callable[[int], None] = lambda n: None, publish: Publish | None = None) -> dict[str, Any]:
    """Every split of ``raw`` into ``out``, continuing what a killed write left (module docstring);
    with ``publish``, ``out`` is the staging directory of a write to a URL (``publish``)."""
    out.mkdir(parents=True, exist_ok=True)
    index = start_index(raw, out, data_section)
    for leftover in out.glob(f"*{PARTIAL}"):
        leftover.unlink()
    for split in raw.splits:
        if not index["splits"][split.name]["complete"]:
            write_split(split, raw.kind, out, index, shard_size, advance, publish)
    return index
