"""The decoded-image cache (``data.cache=ram``): each image decoded once per run, its uint8 pixels
shared by the training process and every DataLoader worker.

Decoding is more than half of a detection sample's CPU time (BENCHMARKS.md), and without a cache
every epoch decodes every image again. With it, a split's images live in one file in a RAM-backed
directory (``/dev/shm`` by default): a byte per image saying whether it is filled, then each image's
bytes at an offset fixed by its shape, which the annotations give (3 x height x width) without
decoding. So the size is known and checked against the budget before anything is written.

Filled lazily, by whichever process loads an image first: it writes the pixels, then the image's
byte. Any process that later finds the byte set reads the pixels instead of decoding. The first
epoch thus decodes in the workers, in parallel, as it would without the cache; filling up front
would decode every image on one core before the first step (2,000 fashion-mosaic images, about
3 s; Pascal VOC's 16,551, more than a minute), also for a short run that never reads most of them.
Two processes that decode the same image write the same bytes, so no lock is needed.

Read and written with ``pread`` / ``pwrite``, not through a shared mapping: POSIX orders a read after
a completed write, so the filled byte (written after the pixels) is never seen before them, whatever
the CPU's memory ordering; a full directory makes a write fail (that image is decoded each time,
with one warning), where a store into a mapping would kill the worker with SIGBUS; and a sample needs
a tensor of its own anyway (a transform must never write into the shared pixels), so there is one
copy either way. Workers receive a small handle (the file's path and the images' shapes) and open
the file on first use; nothing of the pixels is pickled.

Clean-up: the process that created a file removes it when its cache is garbage-collected or the
interpreter exits (an exception, SIGTERM, Ctrl-C included). It also holds an ``flock`` on the file
while it lives, so after a kill -9 the next run that opens a cache removes every cache file whose
creator has gone. A file is created under a fresh name, so a leftover never collides with a new run.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import weakref
from pathlib import Path

import numpy as np
import torch

from visiontrain.core.config import ConfigError
from visiontrain.data.shared_arrays import remove_stale_files

log = logging.getLogger("visiontrain")

PREFIX, SUFFIX = "visiontrain-cache-", ".u8"  # PREFIX + "<pid of the creator>-<random>" + SUFFIX
_FILLED = 1
_ALIGN = 4096  # the pixels start on a page boundary after the filled bytes
GIB = 2 ** 30


def default_directories() -> list[str]:
    """Where a cache may go when ``data.cache_dir`` is unset, best first: ``/dev/shm`` (RAM-backed on
    Linux) where it exists and is writable, then the temp directory, whose files the kernel's page
    cache keeps in memory while it can (a container's ``/dev/shm`` is often only 64 MiB)."""
    shm = "/dev/shm"
    usable = os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK)
    return [shm, tempfile.gettempdir()] if usable else [tempfile.gettempdir()]


def size_text(n: float) -> str:
    """Bytes in the unit a reader compares with ``free -h``: MiB below a GiB, else GiB."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2 ** 20:.1f} MiB"


def layout(shapes: np.ndarray) -> tuple[np.ndarray, int]:
    """(each image's offset, the file's size) for images of ``shapes`` (int [N, 3]): N filled bytes,
    then the images one after another from the next page boundary."""
    sizes = np.asarray(shapes, dtype=np.int64).reshape(-1, 3).prod(1)
    start = -(-len(sizes) // _ALIGN) * _ALIGN
    return start + np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64), int(start + sizes.sum())


class ImageCache:
    """One split's decoded images in one file. ``shapes``: int [N, 3], each image's (C, H, W).

    Picklable as its path and shapes: a forkserver or spawned worker opens the file itself; a forked
    one uses the file descriptor it inherited."""

    def __init__(self, path: str, shapes: np.ndarray) -> None:
        self.path = path
        self.shapes = np.asarray(shapes, dtype=np.int64).reshape(-1, 3)
        self.offsets, self.nbytes = layout(self.shapes)
        self._fd: int | None = None
        self._failed = False  # the file could not be opened or written here: decode, say it once

    @classmethod
    def create(cls, directory: str, shapes: np.ndarray) -> "ImageCache":
        """A new, empty file (sparse: memory is taken as images are written), removed when this
        process drops the cache or exits."""
        fd, path = tempfile.mkstemp(prefix=f"{PREFIX}{os.getpid()}-", suffix=SUFFIX, dir=directory)
        fcntl.flock(fd, fcntl.LOCK_EX)  # held while this process lives (remove_stale)
        cache = cls(path, shapes)
        os.ftruncate(fd, cache.nbytes)
        cache._fd = fd
        weakref.finalize(cache, _remove, path, fd, os.getpid())
        return cache

    def __len__(self) -> int:
        return len(self.shapes)

    def __getstate__(self) -> dict:
        return {"path": self.path, "shapes": self.shapes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["shapes"])

    def _file(self) -> int | None:
        if self._fd is None and not self._failed:
            try:
                self._fd = os.open(self.path, os.O_RDWR)
            except OSError as err:
                self._give_up(f"cannot open it ({err})")
            else:
                weakref.finalize(self, os.close, self._fd)
        return self._fd

    def _give_up(self, why: str) -> None:
        self._failed = True
        log.warning("data.cache=ram: %s: %s; the images it lacks are decoded each time (pid %d)",
                    self.path, why, os.getpid())

    def get(self, index: int) -> torch.Tensor | None:
        """Image ``index`` as a new uint8 tensor, or None while no process has filled it."""
        fd = self._file()
        if fd is None or os.pread(fd, 1, index) != bytes([_FILLED]):
            return None
        image = torch.empty(tuple(int(s) for s in self.shapes[index]), dtype=torch.uint8)
        if os.preadv(fd, [image.numpy()], int(self.offsets[index])) != image.numel():
            return None
        return image

    def put(self, index: int, image: torch.Tensor) -> None:
        """Keep a decoded image for every process: the pixels, then its filled byte. An image whose
        shape is not the one the annotations gave is left out (it is decoded each time)."""
        fd = self._file()
        if fd is None or image.dtype != torch.uint8 or tuple(image.shape) != tuple(self.shapes[index]):
            return
        pixels = image.contiguous().numpy()
        try:
            if os.pwrite(fd, pixels, int(self.offsets[index])) == pixels.nbytes:
                os.pwrite(fd, bytes([_FILLED]), index)
        except OSError as err:  # ENOSPC: the directory filled up since the start
            if not self._failed:
                self._give_up(f"cannot write image {index} ({err})")

    def filled(self) -> int:
        """How many images some process has filled."""
        fd = self._file()
        flags = os.pread(fd, len(self), 0) if fd is not None else b""
        return int(np.count_nonzero(np.frombuffer(flags, dtype=np.uint8) == _FILLED))


def _remove(path: str, fd: int, pid: int) -> None:
    """The creator's clean-up (a forked worker that drops its copy of the cache removes nothing)."""
    if os.getpid() != pid:
        return
    Path(path).unlink(missing_ok=True)  # already gone: a clean-up that ran first
    os.close(fd)


def remove_stale(directory: str) -> list[str]:
    """Remove the cache files in ``directory`` whose creator has gone (a run killed with -9): its
    process no longer exists and nobody holds the file's lock. Another user's files are left."""
    return remove_stale_files(directory, PREFIX, SUFFIX)


def free_bytes(directory: str) -> int:
    """What ``directory``'s file system has left (for tmpfs: its size limit less what it holds)."""
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize


def available_memory() -> int:
    """Bytes of memory this process may still take: the kernel's MemAvailable, lowered to what the
    container's cgroup limit leaves; the physical memory where neither can be read."""
    sizes = []
    with contextlib.suppress(OSError):  # no /proc (not Linux): the limits below, or the physical memory
        with open("/proc/meminfo") as f:
            sizes += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    for group, limit, usage in (("/sys/fs/cgroup", "memory.max", "memory.current"),  # cgroup v2, then v1
                                ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes")):
        try:
            sizes.append(int(Path(group, limit).read_text()) - int(Path(group, usage).read_text()))
        except (OSError, ValueError):  # absent, or "max" (no limit)
            continue
    return max(0, min(sizes)) if sizes else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def budget(budget_gb: float | None) -> tuple[int, str]:
    """(bytes, how they were chosen): ``data.cache_gb``, else half of the memory available now,
    shared among the processes torchrun started on this machine (each caches its own images)."""
    if budget_gb is not None:
        return int(budget_gb * GIB), f"data.cache_gb={budget_gb:g}"
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    free = available_memory()
    per = f", over {local} processes on this machine" if local > 1 else ""
    return free // 2 // local, f"half of the {size_text(free)} of memory available{per}; data.cache_gb unset"


def open_caches(splits: dict[str, np.ndarray], *, budget_gb: float | None, directory: str | None
                ) -> dict[str, ImageCache]:
    """An empty cache per split (name -> image shapes [N, 3]). Refused before anything is written
    when the images need more than the budget or than the directory has free (unset: the first of
    ``default_directories`` with room): a ``ConfigError`` naming the key, the bytes needed and the budget."""
    need = {name: layout(shapes)[1] for name, shapes in splits.items()}
    total = sum(need.values())
    parts = ", ".join(f"{name}: {len(splits[name]):,} images, {size_text(n)}" for name, n in need.items())
    needs = f"data.cache=ram: the decoded images need {total:,} bytes ({size_text(total)}; {parts})"
    allowed, why = budget(budget_gb)
    if total > allowed:
        raise ConfigError(f"{needs}, more than the budget of {allowed:,} bytes ({size_text(allowed)}; {why}); "
                          f"raise data.cache_gb if the memory is there, or set data.cache=none to decode every "
                          f"image each time")
    if directory is not None and not os.path.isdir(directory):
        raise ConfigError(f"data.cache_dir={directory} is not a directory")
    candidates = [directory] if directory is not None else default_directories()
    room = {place: (remove_stale(place), free_bytes(place)) for place in candidates}
    directory = next((place for place, (_, free) in room.items() if free >= total), None)
    if directory is None:
        has = " and ".join(f"{place} has {free:,} bytes free ({size_text(free)})" for place, (_, free) in room.items())
        raise ConfigError(f"{needs}, and {has}; give it room (in a container: docker run --shm-size), set "
                          f"data.cache_dir to a directory with room, or data.cache=none")
    removed = [path for stale, _ in room.values() for path in stale]
    caches = {name: ImageCache.create(directory, shapes) for name, shapes in splits.items()}
    log.info("%s, kept in %s as they are first decoded (budget %s: %s)%s", needs, directory, size_text(allowed),
             why, f"; removed {len(removed)} cache files of runs that were killed" if removed else "")
    return caches
