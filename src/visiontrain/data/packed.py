"""Compact, read-only sequences for a dataset's index: what every DataLoader worker holds a copy of.

A dataset's index as Python objects (a path string and a label an image, or a record with small
arrays) costs a worker memory twice over. A forkserver or spawned worker is sent the dataset pickled
and unpickles its own copy of every object; a forked worker shares its parent's pages until it
touches an object, when reference counting writes to the page and the kernel copies it, so its memory
grows through the epoch towards a full copy (pytorch#13246). Kept as a few numpy buffers instead, the
index pickles as its raw bytes and reading an item touches no shared Python object: a worker's copy
is the size of the data, and a forked worker's stays shared (detectron2 serialises its dataset dicts
for the same reason). Past ``shared_arrays.MIN_BYTES`` the buffers go further: into one file every
worker maps (``visiontrain.data.shared_arrays``), so a forkserver or spawned worker is sent the
file's path and keeps no copy of its own either. ``benchmarks/scale/worker_memory.py`` measures
both start methods.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np

from visiontrain.data.shared_arrays import SharedArrays, share_arrays

__all__ = ["PackedSamples", "PackedStrings", "position"]


def position(index: int, length: int) -> int:
    """``index`` as a position in ``0..length-1`` (negative counts from the end), as a list indexes."""
    i = int(index)
    if i < 0:
        i += length
    if not 0 <= i < length:
        raise IndexError(f"index {index} out of range for {length} items")
    return i


def offsets_of(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """int64 [n + 1]: where item i starts (``[i]``) and ends (``[i + 1]``) in one flat buffer."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


class PackedStrings(Sequence[str]):
    """Strings (file paths) as the prefix they all share, kept once, and the rest of each in one byte
    buffer with their offsets (ImageNet's 1.28 M paths share their root and the start of the class
    folder's name: about half of each path). Encoded with ``os.fsencode``, so a file name that is not
    valid UTF-8 comes back as the same name."""

    def __init__(self, strings: Iterable[str]) -> None:
        encoded = [os.fsencode(s) for s in strings]
        self.prefix = os.path.commonprefix(encoded) if encoded else b""
        rest = [b[len(self.prefix):] for b in encoded]
        self.offsets = offsets_of([len(b) for b in rest])
        self.data = np.frombuffer(b"".join(rest), dtype=np.uint8).copy()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        i = position(index, len(self))
        return os.fsdecode(self.prefix + self.data[self.offsets[i]:self.offsets[i + 1]].tobytes())

    def __iter__(self) -> Iterator[str]:
        data, offsets, prefix = self.data.tobytes(), self.offsets.tolist(), self.prefix
        return (os.fsdecode(prefix + data[a:b]) for a, b in zip(offsets[:-1], offsets[1:]))

    @property
    def nbytes(self) -> int:
        return len(self.prefix) + self.data.nbytes + self.offsets.nbytes

    def buffers(self, name: str) -> dict[str, np.ndarray]:
        """Its arrays, named under ``name``, for the owner's ``share_arrays`` (one file an index)."""
        return {f"{name}.offsets": self.offsets, f"{name}.data": self.data}

    def adopt(self, shared: SharedArrays, name: str) -> None:
        """Read from ``shared``'s copies of ``buffers(name)`` (mapped: the bytes every worker shares)."""
        self.offsets, self.data = shared[f"{name}.offsets"], shared[f"{name}.data"]

    def saved(self, name: str) -> dict[str, np.ndarray]:
        """``buffers(name)`` and the shared prefix, as uint8 [k] ``name.prefix``: all ``restored``
        needs to make the same strings again (a copy kept on disk between runs)."""
        return {**self.buffers(name), f"{name}.prefix": np.frombuffer(self.prefix, dtype=np.uint8)}

    @classmethod
    def restored(cls, arrays: Mapping[str, np.ndarray], name: str) -> PackedStrings:
        """The strings ``saved(name)`` was taken from; ValueError where the arrays do not fit
        together (a damaged copy: offsets that do not run from 0 to the data's end)."""
        prefix, offsets, data = (arrays[f"{name}.{part}"] for part in ("prefix", "offsets", "data"))
        if (prefix.dtype != np.uint8 or data.dtype != np.uint8 or offsets.dtype != np.int64 or offsets.ndim != 1
                or not len(offsets) or offsets[0] != 0 or offsets[-1] != len(data) or (np.diff(offsets) < 0).any()):
            raise ValueError(f"{name}: packed strings whose offsets do not fit their data")
        strings = cls.__new__(cls)
        strings.prefix, strings.offsets, strings.data = prefix.tobytes(), offsets, data
        return strings


class PackedSamples(Sequence[tuple[str, int]]):
    """An image folder's ``(path, label)`` samples as packed paths and an int64 label array; reads
    as the list of tuples it was made from."""

    def __init__(self, samples: Iterable[tuple[str, int]]) -> None:
        pairs = list(samples)
        self.paths = PackedStrings(p for p, _ in pairs)
        self.labels = np.array([t for _, t in pairs], dtype=np.int64)
        shared = share_arrays({**self.paths.buffers("paths"), "labels": self.labels})  # ImageNet's: 40 MiB
        self.paths.adopt(shared, "paths")
        self.labels = shared["labels"]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[str, int]:  # type: ignore[override]
        i = position(index, len(self))
        return self.paths[i], int(self.labels[i])

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return zip(self.paths, self.labels.tolist())

    def take(self, indices: Iterable[int]) -> PackedSamples:
        """The samples at ``indices``, in that order, packed anew."""
        return PackedSamples(self[i] for i in indices)

    @property
    def nbytes(self) -> int:
        return self.paths.nbytes + self.labels.nbytes
