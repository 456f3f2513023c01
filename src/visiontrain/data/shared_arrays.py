"""Read-only numpy buffers in one file that every DataLoader worker maps: a dataset's index shared, not copied.

A forkserver or spawned DataLoader worker is sent its dataset pickled, and a packed index
(``data/packed.py``) pickles as its bytes, so each worker unpickled a copy of its own: 32 MiB of
COCO's detection records, about 40 MiB of ImageNet's image-folder samples or of its shards' samples
file, once a worker. ``share_arrays`` writes the buffers once into one file and gives back read-only
views of its mapping. A view pickles as the file's path, where each buffer lies in it and its own
name (a few hundred bytes for a whole index), and the worker that unpickles it maps the same file:
its pages are the kernel's page cache, one copy for every process of the run. A forked worker
shares them through the mapping it inherits. What is derived from a view (a slice, a copy, a sum) is
a plain array again.

Where: the temp directory (``TMPDIR``), not ``/dev/shm`` as ``data.cache=ram``'s pixels. An index is
read all through a run, so the page cache keeps its pages in memory as tmpfs would, and a container's
``/dev/shm`` (often 64 MiB) stays free for the pixels. Below ``MIN_BYTES``, or where no file can be
written there (a read-only or full temp directory), the buffers stay in memory as before: a small
index costs a worker less than a file and a mapping.

Clean-up as ``image_cache``'s: a file is named with its creator's pid; the creator holds an ``flock``
on it while it lives and removes it when the buffers are garbage-collected or the interpreter exits
(an exception, SIGTERM, Ctrl-C included); a later run removes the files whose creator has gone (a kill -9).
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import logging
import mmap
import os
import tempfile
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MIN_BYTES", "MappedArray", "SharedArrays", "mapped_file", "remove_stale_files", "share_arrays"]

log = logging.getLogger("visiontrain")

PREFIX, SUFFIX = "visiontrain-index-", ".bin"  # PREFIX + "<pid of the creator>-<random>" + SUFFIX
MIN_BYTES = 2 ** 20  # smaller indexes stay in memory (read when they are made: tests lower it)
_ALIGN = 64  # each buffer starts on a cache line
Layout = tuple[tuple[str, str, tuple[int, ...], int], ...]  # (name, dtype, shape, offset) a buffer

_swept: set[str] = set()  # directories whose stale files this process has removed
_attached: weakref.WeakValueDictionary[str, SharedArrays] = weakref.WeakValueDictionary()  # path -> its mapping


def plan(arrays: Mapping[str, np.ndarray]) -> tuple[Layout, int]:
    """(where each buffer lies, the file's size): the buffers one after another, each aligned."""
    layout, end = [], 0
    for name, a in arrays.items():
        if a.dtype.hasobject or a.dtype.names:
            raise TypeError(f"{name}: a {a.dtype} array cannot be shared as raw bytes")
        offset = -(-end // _ALIGN) * _ALIGN
        layout.append((name, a.dtype.str, tuple(int(s) for s in a.shape), offset))
        end = offset + a.nbytes
    return tuple(layout), end


class MappedArray(np.ndarray):
    """A buffer of a mapped ``SharedArrays``, read-only. It pickles as its file's handle and its name,
    so the process that unpickles it maps the file instead of receiving the bytes; an array derived
    from it has no ``_source`` (or is a plain ndarray: indexing gives one) and pickles its bytes."""

    _source: tuple[SharedArrays, str] | None = None

    def __array_finalize__(self, obj: Any) -> None:
        self._source = None  # a view, copy or result: not the stored buffer itself

    def __reduce_ex__(self, protocol: int) -> Any:  # type: ignore[override]
        if self._source is None:
            return self.view(np.ndarray).__reduce_ex__(protocol)
        return _buffer, self._source

    def __getitem__(self, key: Any) -> Any:
        out = super().__getitem__(key)
        return out.view(np.ndarray) if isinstance(out, MappedArray) else out


def _buffer(shared: SharedArrays, name: str) -> np.ndarray:
    """Unpickling a ``MappedArray``: the buffer of the (mapped) file."""
    return shared[name]


class SharedArrays(Mapping[str, np.ndarray]):
    """Named read-only arrays, in one mapped file (``path``) or, where that was not made, in memory
    (``path`` None). Mapped, it pickles as ``(path, layout, size)``; in memory, as its arrays."""

    def __init__(self, arrays: Mapping[str, np.ndarray], *, directory: str | None = None,
                 min_bytes: int | None = None) -> None:
        arrays = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
        self.layout, self.size = plan(arrays)
        self.path: str | None = None
        threshold = MIN_BYTES if min_bytes is None else min_bytes
        made = _create(arrays, self.layout, self.size, directory or tempfile.gettempdir()) \
            if self.size >= max(1, threshold) else None
        if made is None:
            for a in arrays.values():
                a.flags.writeable = False  # as the mapped buffers: a transform that writes fails the same way
            self._arrays: dict[str, np.ndarray] = arrays
            return
        self.path, fd = made
        self._arrays = _views(self, self.path)
        _attached[self.path] = self
        weakref.finalize(self, _remove, self.path, fd, os.getpid())

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def __reduce__(self) -> Any:
        if self.path is None:
            return _in_memory, (self._arrays,)
        return _attach, (self.path, self.layout, self.size)


def _in_memory(arrays: dict[str, np.ndarray]) -> SharedArrays:
    """Unpickling an unmapped ``SharedArrays``: its arrays, kept in memory (never a file of this process's)."""
    return SharedArrays(arrays, min_bytes=2 ** 63)


def _attach(path: str, layout: Layout, size: int) -> SharedArrays:
    """Unpickling a mapped ``SharedArrays``: the file mapped once a process (an owner gets its own back)."""
    known = _attached.get(path)
    if known is not None:
        return known
    shared = SharedArrays.__new__(SharedArrays)
    shared.layout, shared.size, shared.path = tuple(layout), int(size), path
    try:
        shared._arrays = _views(shared, path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: the dataset index this process was sent is gone; its file lives as "
                                f"long as the dataset in the process that made it (pid {_creator(path)})") from None
    _attached[path] = shared
    return shared


def _views(shared: SharedArrays, path: str) -> dict[str, np.ndarray]:
    """Each buffer of the file at ``path`` as a read-only ``MappedArray`` of one shared mapping."""
    with open(path, "rb") as f:
        whole = mmap.mmap(f.fileno(), shared.size, access=mmap.ACCESS_READ)  # the mapping outlives the file object
    views: dict[str, np.ndarray] = {}
    for name, dtype, shape, offset in shared.layout:
        count = int(np.prod(shape, dtype=np.int64))
        if count == 0:  # an empty buffer may lie past the file's end
            a = np.empty(shape, dtype=np.dtype(dtype))
            a.flags.writeable = False
            views[name] = a
            continue
        view = np.frombuffer(whole, dtype=np.dtype(dtype), count=count, offset=offset).reshape(shape)
        view = view.view(MappedArray)
        view._source = (shared, name)
        views[name] = view
    return views


def _create(arrays: dict[str, np.ndarray], layout: Layout, size: int, directory: str) -> tuple[str, int] | None:
    """(path, fd) of a new file in ``directory`` holding ``arrays`` as ``layout`` places them, locked
    while this process lives; None where it cannot be written (the arrays then stay in memory)."""
    if directory not in _swept:
        _swept.add(directory)
        remove_stale_files(directory, PREFIX, SUFFIX)
    try:
        fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", suffix=SUFFIX, dir=directory)
    except OSError as err:
        log.info("the dataset's index stays in each DataLoader worker's memory: no file in %s (%s)", directory, err)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held while this process lives (remove_stale_files)
        for (name, _, _, offset), a in zip(layout, arrays.values()):
            _write_all(fd, a.reshape(-1).view(np.uint8), offset)
        os.ftruncate(fd, size)
    except OSError as err:  # ENOSPC: the directory is full
        Path(path).unlink(missing_ok=True)
        os.close(fd)
        log.info("the dataset's index stays in each DataLoader worker's memory: cannot write %s (%s)", path, err)
        return None
    return path, fd


def _write_all(fd: int, data: np.ndarray, offset: int) -> None:
    """All of ``data`` at ``offset`` (one ``pwrite`` may write less than it was given)."""
    view = memoryview(data)
    while len(view):
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _remove(path: str, fd: int, pid: int) -> None:
    """The creator's clean-up (a forked worker that drops its copy of the index removes nothing)."""
    if os.getpid() != pid:
        return
    Path(path).unlink(missing_ok=True)  # already gone: a clean-up that ran first
    os.close(fd)


def _creator(path: str) -> str:
    return Path(path).name[len(PREFIX):].split("-", 1)[0]


def share_arrays(arrays: Mapping[str, np.ndarray]) -> SharedArrays:
    """``arrays`` as read-only buffers every DataLoader worker of this run shares (the module's
    docstring): mapped from one file in the temp directory, or in memory where they are small or no
    file can be written there. Index it by the same names."""
    return SharedArrays(arrays)


def mapped_file(array: np.ndarray) -> str | None:
    """The file ``array``'s buffer is mapped from (None: it is in this process's memory)."""
    source = getattr(array, "_source", None)
    return None if source is None else source[0].path


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_files(directory: str, prefix: str, suffix: str) -> list[str]:
    """Remove the files ``prefix<pid>-*suffix`` in ``directory`` whose creator has gone (a run killed
    with -9): its process no longer exists and nobody holds the file's lock. Another user's are left."""
    removed = []
    for path in glob.glob(os.path.join(glob.escape(directory), f"{prefix}*{suffix}")):
        pid = Path(path).name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or alive(int(pid)):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        # OSError: locked (a process of its run still holds it) or not ours to remove: left as it is
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
            removed.append(path)
        os.close(fd)
    return removed
