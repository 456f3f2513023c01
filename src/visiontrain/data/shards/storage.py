"""Where shards are read from: a local directory, or any fsspec URL (``s3://`` through s3fs,
``gs://`` through gcsfs, ``http(s)://``), with the credentials each file system reads from its usual
environment variables and configuration files.

A read is one byte range of one file. A local file is read with ``pread`` (the kernel's page cache
does the rest). A remote file is fetched in blocks of ``BLOCK`` bytes, one ranged GET each, and the
blocks kept, the most recently used, up to the store's ``cache_bytes``: a worker reads the samples of
its share of an epoch in their order in the shards, shuffled within a buffer of samples
(``sampler``), so its reads fall in a window of about that buffer's bytes, and a cache the size of
the window fetches each block once.

On object storage a request fails now and then (a dropped connection, a throttled request, a node
restarting): each read is tried ``RETRIES`` times, waiting ``FIRST_WAIT`` seconds after the first
failure and twice as long after each next one, at most ``MAX_WAIT``: about 30 s in all before an
outage is given up. What still fails is a ``ShardReadError`` naming the URL and the last error, which
the CLI prints as one line (exit 2). This is the only retry policy: the storage libraries' own
retries underneath (``SINGLE_TRY``) are set to one try.
"""
from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from typing import Any, Callable

from visiontrain.core.redact import redact_url, scrub

log = logging.getLogger("visiontrain")
RETRIES = 8
FIRST_WAIT = 0.5
MAX_WAIT = 8.0
BLOCK = 4 * 2**20  # a remote read fetches whole blocks of this many bytes
MIN_CACHE = 4 * BLOCK
OPEN_FILES = 8  # local files a process keeps open: the shards its share of an epoch is in
NOISY_LOGGERS = ("botocore", "aiobotocore", "s3fs", "fsspec", "gcsfs", "google")
#: Each storage library's own retries, set to one try: ``ShardStore._retried`` (RETRIES tries, waits
#: from FIRST_WAIT doubling) is the one policy, the one docs/data-at-scale.md states. Under it, s3fs's
#: five calls (its ``retries`` attribute), each botocore's five attempts (its client config), made an
#: outage take 150 s and 200 connections to give up instead of 5 connections in seconds.
SINGLE_TRY = {"s3": {"config_kwargs": {"retries": {"total_max_attempts": 1}}}}
SINGLE_TRY["s3a"] = SINGLE_TRY["s3"]


class ShardReadError(ValueError):
    """A shard file that cannot be read, after the retries; the message names the URL."""


def is_url(location: str) -> bool:
    return "://" in location and not location.startswith("file://")


def _local(location: str) -> str:
    return location[len("file://"):] if location.startswith("file://") else location


class ShardStore:
    """The files of one shard directory (local or a URL), read by name and byte range.

    Picklable: a DataLoader worker gets the location and opens its own files and connections."""

    def __init__(self, location: str, *, cache_bytes: int = MIN_CACHE, retries: int = RETRIES,
                 first_wait: float = FIRST_WAIT) -> None:
        self.location = location.rstrip("/")
        self.remote = is_url(self.location)
        self.cache_bytes, self.retries, self.first_wait = max(int(cache_bytes), MIN_CACHE), retries, first_wait
        self._files: OrderedDict[str, int] = OrderedDict()  # local: open descriptors
        self._blocks: OrderedDict[tuple[str, int], bytes] = OrderedDict()  # remote: fetched blocks
        self._cached = 0
        self._fs: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_files": OrderedDict(), "_blocks": OrderedDict(), "_cached": 0, "_fs": None}

    def url(self, name: str) -> str:
        return f"{self.location}/{name}" if self.remote else os.path.join(_local(self.location), name)

    def shown(self, name: str) -> str:
        """``url(name)`` as messages print it: without a token or password the URL holds."""
        return redact_url(self.url(name))

    def _filesystem(self) -> Any:
        if self._fs is None:
            import fsspec

            for noisy in NOISY_LOGGERS:  # a line per credential lookup and endpoint at INFO
                logging.getLogger(noisy).setLevel(logging.WARNING)
            try:
                protocol = self.location.split("://", 1)[0]
                self._fs, _ = fsspec.core.url_to_fs(self.location, **SINGLE_TRY.get(protocol, {}))
                if protocol in SINGLE_TRY:
                    self._fs.retries = 1  # s3fs's own loop around each call
            except ImportError as err:  # s3fs, gcsfs: installed by the user for the storage they use
                raise ShardReadError(f"{redact_url(self.location)}: {scrub(str(err), self.location)}") from None
        return self._fs

    def read(self, name: str) -> bytes:
        """A whole (small) file: the index, a samples file."""
        return self._retried(name, lambda: self._read_whole(name))

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of a file."""
        if not self.remote:
            return self._retried(name, lambda: self._pread(name, start, end))
        first, last = start // BLOCK, (end - 1) // BLOCK
        data = b"".join(self._retried(name, lambda b=b: self._block(name, b)) for b in range(first, last + 1))
        return self._checked(name, start, end, data[start - first * BLOCK:end - first * BLOCK])

    def exists(self, name: str) -> bool:
        if not self.remote:
            return os.path.exists(self.url(name))
        return bool(self._retried(name, lambda: self._filesystem().exists(self.url(name))))

    def put(self, local: str, name: str) -> None:
        """Upload the local file ``local`` as ``name`` (``shard --out URL``), retried as a read is."""
        self._retried(name, lambda: self._filesystem().put_file(local, self.url(name)))

    def _read_whole(self, name: str) -> bytes:
        if not self.remote:
            with open(self.url(name), "rb") as f:
                return f.read()
        return self._filesystem().cat_file(self.url(name))

    def _pread(self, name: str, start: int, end: int) -> bytes:
        fd = self._files.pop(name, None)
        if fd is None:
            fd = os.open(self.url(name), os.O_RDONLY)
            while len(self._files) >= OPEN_FILES:
                os.close(self._files.popitem(last=False)[1])
        self._files[name] = fd
        return self._checked(name, start, end, os.pread(fd, end - start, start))

    def _checked(self, name: str, start: int, end: int, data: bytes) -> bytes:
        """``data``, read as bytes ``[start, end)``, unless the file ended before ``end``."""
        if len(data) != end - start:
            raise ShardReadError(f"{self.shown(name)}: bytes {start}-{end} asked, {len(data)} there (the file is "
                                 f"shorter than its samples file says)")
        return data

    def _block(self, name: str, number: int) -> bytes:
        """Block ``number`` of a remote file (the last one may be short), from the cache or fetched."""
        key = (name, number)
        data = self._blocks.pop(key, None)
        if data is None:
            data = self._filesystem().cat_file(self.url(name), start=number * BLOCK, end=(number + 1) * BLOCK)
            self._cached += len(data)
            while self._blocks and self._cached > self.cache_bytes:
                self._cached -= len(self._blocks.popitem(last=False)[1])
        self._blocks[key] = data
        return data

    def _not_found(self, name: str, err: FileNotFoundError) -> ShardReadError:
        """A missing file, or a missing bucket: S3 (and s3fs) answer NoSuchBucket with the same
        exception, and a write or read then names its file as if the bucket were there."""
        if "bucket does not exist" in str(err).lower() or "NoSuchBucket" in str(err):
            scheme, rest = self.location.split("://", 1)
            bucket = redact_url(f"{scheme}://{rest.split('/', 1)[0]}")
            return ShardReadError(f"{self.shown(name)}: the bucket {bucket} does not exist (the storage answered "
                                  f"NoSuchBucket); create it first: `visiontrain shard --out` writes into an "
                                  f"existing bucket and data.shards reads from one")
        return ShardReadError(f"{self.shown(name)}: no such file")

    def _retried(self, name: str, read: Callable[[], Any]) -> Any:
        wait = self.first_wait
        for attempt in range(1, self.retries + 1):
            try:
                return read()
            except ShardReadError:
                raise
            except FileNotFoundError as err:
                raise self._not_found(name, err) from None
            except Exception as err:  # noqa: BLE001  (each file system raises its own transient errors)
                if attempt == self.retries:
                    raise ShardReadError(f"{self.shown(name)}: cannot be read or written after {self.retries} tries: "
                                         f"{type(err).__name__}: {scrub(str(err), self.location)}") from None
                log.warning("%s: %s: %s; trying again in %.1f s (try %d of %d)", self.shown(name),
                            type(err).__name__, scrub(str(err), self.location), wait, attempt + 1, self.retries)
                time.sleep(wait)
                wait = min(2 * wait, MAX_WAIT)
        raise ShardReadError(f"{self.shown(name)}: no tries (retries={self.retries})")
