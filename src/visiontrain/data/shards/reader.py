"""Reading a shard directory written by ``visiontrain shard``: its index, a split's samples, and one
sample's members, each read as one byte range of its shard (``samples``)."""
from __future__ import annotations

import functools
import tarfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from visiontrain.data.shards.layout import INDEX_FILE, TAR_BLOCK, padded, parse_index, sample_key
from visiontrain.data.shards.samples import SplitSamples, check_samples, read_samples
from visiontrain.data.shards.storage import ShardStore


@dataclass(frozen=True)
class ShardSpec:
    """What the datasets of ``data.name=shards`` read: where the shards are, and the shuffle buffer
    (``data.shuffle_buffer``), whose bytes a remote reader keeps cached."""

    location: str
    shuffle_buffer: int = 0
    only: tuple[str, ...] = ()  # the shards a brace pattern picks (none: every shard)


def picked(spec: ShardSpec, split: str) -> list[bool]:
    """Which of a split's shards a run reads: those ``spec.only`` names, where it names any of this
    split's, else all of them. A name no split lists is an error naming it."""
    index = shard_index(spec.location)
    names = [s["name"] for s in index["splits"][split]["shards"]]
    listed = {s["name"] for entry in index["splits"].values() for s in entry["shards"]}
    unknown = [name for name in spec.only if name not in listed]
    if unknown:
        raise ValueError(f"data.shards: {unknown[0]} (of {len(unknown)} the pattern names that are not there) is not "
                         f"a shard listed in {spec.location}/{INDEX_FILE}")
    mine = set(spec.only) & set(names)
    return [not mine or name in mine for name in names]


def split_shard_sizes(spec: ShardSpec, split: str, limit: int | None) -> list[int]:
    """The samples a run reads from each of a split's shards (``picked``, the first ``limit``), from
    the index alone."""
    counts = [s["samples"] if keep else 0
              for s, keep in zip(shard_index(spec.location)["splits"][split]["shards"], picked(spec, split))]
    left, sizes = (sum(counts) if limit is None else limit), []
    for count in counts:
        sizes.append(min(count, left))
        left -= sizes[-1]
    return sizes


@functools.lru_cache(maxsize=8)
def shard_index(location: str) -> dict[str, Any]:
    """The index of the shards at ``location`` (read once per process: the data section asks for
    the shard sizes, the task's data for the splits)."""
    return parse_index(ShardStore(location).read(INDEX_FILE).decode("utf-8"), f"{location}/{INDEX_FILE}")


def sample_members(data: bytes, where: str) -> dict[str, bytes]:
    """A sample's tar members (header, data, padding, ...) as ``{extension: bytes}``."""
    members, pos = {}, 0
    while pos + TAR_BLOCK <= len(data):
        try:
            info = tarfile.TarInfo.frombuf(data[pos:pos + TAR_BLOCK], "utf-8", "surrogateescape")
        except tarfile.HeaderError as err:
            raise ValueError(f"{where}: not a tar member at byte {pos} of the sample ({err})") from None
        start = pos + TAR_BLOCK
        members[info.name.partition(".")[2]] = data[start:start + info.size]
        pos = start + padded(info.size)
    return members


class ShardSplit:
    """One split of a shard directory: its samples (first ``limit``) and how to read one of them."""

    def __init__(self, spec: ShardSpec, split: str, limit: int | None = None) -> None:
        location = spec.location
        index = shard_index(location)
        if split not in index["splits"]:
            raise ValueError(f"{location}: no split {split!r} in its {INDEX_FILE} (it has "
                             f"{', '.join(index['splits'])}); data.train_split and data.val_split name the splits")
        entry = index["splits"][split]
        if not entry.get("complete"):
            written = sum(s["samples"] for s in entry["shards"])
            raise ValueError(f"{location}: split {split!r} is not completely written ({written:,} of "
                             f"{entry['samples']:,} samples); run `visiontrain shard` again to finish it")
        self.split, self.kind = split, index["kind"]
        self.shard_names = [s["name"] for s in entry["shards"]]
        mean_bytes = sum(s["bytes"] for s in entry["shards"]) / max(1, entry["samples"])
        # twice the buffer's bytes: the window a worker's reads fall in (``storage``)
        self.store = ShardStore(location, cache_bytes=int(2 * spec.shuffle_buffer * mean_bytes))
        samples_name = entry["samples_file"]
        shown = self.store.shown(samples_name)
        samples = read_samples(self.store.read(samples_name), shown, self.kind)
        check_samples(samples, entry, len(index["class_names"]), shown)
        positions = np.arange(len(samples))  # each sample's key: its position in the whole split
        keep = np.array(picked(spec, split))[samples.shard]
        if not keep.all():
            samples, positions = samples.take(keep), positions[keep]
        samples = samples.first(limit)
        # one file every DataLoader worker maps, not a copy each (``SplitSamples.shared``)
        self.samples: SplitSamples
        self.samples, kept = samples.shared(positions=positions[:len(samples)])
        self.positions = kept["positions"]

    def __len__(self) -> int:
        return len(self.samples)

    def where(self, i: int) -> str:
        """Sample ``i`` in words, for errors: its shard's URL and its key."""
        return f"{self.store.url(self.shard_names[self.samples.shard[i]])} sample {sample_key(int(self.positions[i]))}"

    def members(self, i: int) -> dict[str, bytes]:
        s = self.samples
        name = self.shard_names[s.shard[i]]
        return sample_members(self.store.read_range(name, int(s.start[i]), int(s.end[i])), self.where(i))

    def image_bytes(self, i: int) -> bytes:
        """Sample ``i``'s encoded image, as it was written."""
        return image_member(self.members(i), self.where(i))


def image_member(members: dict[str, bytes], where: str) -> bytes:
    """A sample's image among its ``members``: the one whose extension is neither its labels
    (``json``, ``cls``) nor a label file (``KEY.ROLE.png``: a dot in the extension, ``layout``)."""
    for ext, data in members.items():
        if ext not in ("json", "cls") and "." not in ext:
            return data
    raise ValueError(f"{where}: no image member")
