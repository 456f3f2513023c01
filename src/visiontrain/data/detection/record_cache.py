"""A split's records as a reader made them, kept between runs: a re-run loads them instead of
parsing its annotations again.

Once every image's verdict is recorded (``data.image_verdicts``), most of what is left of a COCO
re-run's start is reading the annotation file into records: parsing 450 MB of JSON, converting
860,000 boxes image by image and packing them (BENCHMARKS.md, "the time to the first batch"). What
a reader makes depends only on its input files (the annotation file and every image file it
probed) and its options, so the packed records (``RecordIndex.saved``) and what the reader kept
beside them (the classes, what was skipped) are kept under a key of the options, the annotation
file's absolute path and the image directory, with the size and modification time (ns) of each
input file when it was read. They are reused while every input file has the same size and
modification time (a missing one is still missing): the test ``data.check_images=changed`` makes
of each image, so an image replaced, truncated or touched, or an annotation file edited, is read
again as without this cache (the unchanged images' verdicts still coming from their record).

One ``.npz`` a split in ``data_cache_dir()/split-records/``, not beside the data (which may be
read-only or shared), written whole under a temporary name and renamed; loaded with
``allow_pickle=False`` (zip's CRC checks each buffer), its metadata (JSON) compared with what is
expected and its buffers with each other (``RecordIndex.restored``): a file that fails any of that
is ignored, and the split read and written anew. Where nothing can be written there, every run
reads the annotations, as before this module. At most ``MAX_ENTRIES`` files are kept: the least
recently used go first.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from visiontrain.core.cores import usable_cores
from visiontrain.data.cache_dir import data_cache_dir
from visiontrain.data.detection.record_index import RecordIndex
from visiontrain.data.packed import PackedStrings

__all__ = ["FORMAT", "MAX_ENTRIES", "MIN_BYTES", "KeptSplit", "RecordCache", "file_stamps"]

log = logging.getLogger("visiontrain")

#: Bumped whenever what a reader makes of the same files changes: a file of another format is not read.
FORMAT = 1
DIRECTORY = "split-records"
#: Annotation files smaller than this are parsed at each run: the time saved would be tens of milliseconds,
#: not worth a file in the cache directory (tests lower it).
MIN_BYTES = 8 * 2 ** 20
#: Kept splits at most (COCO train's is 39 MB).
MAX_ENTRIES = 16
#: A temporary file this old is a write that was killed part-way, removed by the next write.
STALE_TEMP_S = 3600
#: Files stat'ed per task of ``file_stamps``' thread pool.
STAT_CHUNK = 4096
#: What reading a damaged, cut or foreign file raises: ``np.load`` (a pickle refused, a bad zip, a CRC
#: that does not match), the metadata's JSON, and the buffers' checks (``RecordIndex.restored``).
DAMAGED = (OSError, ValueError, KeyError, TypeError, AttributeError, EOFError, zipfile.BadZipFile)


def _stamps_of(paths: Sequence[str]) -> list[tuple[int, int]]:
    """``file_stamps`` of one chunk, on one thread."""
    stamps = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            stamps.append((-1, -1))  # missing or not ours to read: the check says which, and it counts as a stamp
            continue
        stamps.append((st.st_size, st.st_mtime_ns))
    return stamps


def file_stamps(paths: Sequence[str], workers: int | None = None) -> np.ndarray:
    """int64 [N, 2]: each file's size and modification time (ns), ``(-1, -1)`` where it cannot be
    stat'ed. The stats run by chunks on a thread a core (at most 8): on a network file system each
    waits on the server. More threads than cores only contend for the GIL between the stats (COCO's
    118,287 local files on 2 cores: 0.32 s on one thread, 0.35 s on two, 0.72 s on eight);
    ``os.scandir`` would not save the stats, since on Linux its entries carry no size or time."""
    workers = workers or min(8, usable_cores())
    chunks = [paths[start:start + STAT_CHUNK] for start in range(0, len(paths), STAT_CHUNK)]
    if len(chunks) > 1 and workers > 1:
        with ThreadPoolExecutor(max_workers=min(workers, len(chunks))) as pool:
            parts = list(pool.map(_stamps_of, chunks))
    else:
        parts = [_stamps_of(c) for c in chunks]
    return np.array([s for part in parts for s in part], dtype=np.int64).reshape(-1, 2)


@dataclass
class KeptSplit:
    """A split as a reader read it on an earlier run: its records and what the reader kept beside them."""

    records: RecordIndex
    extra: dict[str, Any]


class RecordCache:
    """The kept copy of one split (``None`` as the location: a cache that holds nothing). ``key``:
    JSON-able, everything the records depend on besides their input files' contents."""

    def __init__(self, location: Path | None, key: dict[str, Any]) -> None:
        self.location = location
        self.key = json.loads(json.dumps(key))  # as it reads back from a file (tuples as lists)

    @classmethod
    def for_split(cls, key: dict[str, Any]) -> RecordCache:
        """The cache of the split ``key`` names, in the data cache directory."""
        name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
        return cls(data_cache_dir() / DIRECTORY / f"{name}.npz", key)

    def load(self) -> KeptSplit | None:
        """The kept split, where there is one for this key whose input files are all unchanged;
        else None (nothing kept, another key's or format's, damaged, or an input file changed)."""
        if self.location is None or not self.location.is_file():
            return None
        try:
            with np.load(self.location, allow_pickle=False) as npz:
                arrays = {name: npz[name] for name in npz.files}
            meta = json.loads(arrays.pop("meta").tobytes())
            if meta.get("format") != FORMAT or meta.get("key") != self.key:
                return None
            inputs, stamps = PackedStrings.restored(arrays, "inputs"), arrays["inputs.stamps"]
            if stamps.dtype != np.int64 or stamps.shape != (len(inputs), 2):
                raise ValueError("inputs.stamps: one (size, mtime) an input file expected")
            if not np.array_equal(file_stamps(list(inputs)), stamps):
                log.debug("%s: an input file changed since the split was kept; reading it again", self.location)
                return None
            prefix = "records."
            records = RecordIndex.restored({k[len(prefix):]: a for k, a in arrays.items() if k.startswith(prefix)})
            extra = meta["extra"]
        except DAMAGED as err:
            log.info("ignoring %s, which cannot be read as a kept split (%s): reading the annotations again",
                     self.location, err)
            return None
        with contextlib.suppress(OSError):
            os.utime(self.location)  # used: the last to be removed (``_evict``)
        return KeptSplit(records, extra)

    def save(self, records: RecordIndex, inputs: Sequence[str], stamps: np.ndarray, extra: dict[str, Any]) -> None:
        """Keep ``records`` and ``extra`` (JSON-able), valid while each of ``inputs`` has its stamp
        (``file_stamps``, taken before the files were read: a file changed while they were read is
        read again next time). A failed write keeps nothing."""
        if self.location is None:
            return
        meta = {"format": FORMAT, "key": self.key, "extra": extra}
        arrays = {**{f"records.{k}": np.asarray(a) for k, a in records.saved().items()},
                  **PackedStrings(inputs).saved("inputs"), "inputs.stamps": np.asarray(stamps, dtype=np.int64),
                  "meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
        temp = self.location.with_name(f"{self.location.stem}.{os.getpid()}.tmp")
        try:
            self.location.parent.mkdir(parents=True, exist_ok=True)
            with open(temp, "wb") as f:
                np.savez(f, **arrays)
            os.replace(temp, self.location)
        except OSError as err:
            temp.unlink(missing_ok=True)
            log.info("the split's records are not kept for the next run: cannot write %s (%s)", self.location, err)
            return
        _evict(self.location.parent)


def _evict(directory: Path) -> None:
    """Remove all but the ``MAX_ENTRIES`` kept splits last used, and temporary files left by killed writes."""
    with contextlib.suppress(OSError):  # one removed by another process meanwhile: the next write tidies up
        kept = sorted(directory.glob("*.npz"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        temps = [p for p in directory.glob("*.tmp") if time.time() - p.stat().st_mtime > STALE_TEMP_S]
        for path in [*kept[MAX_ENTRIES:], *temps]:
            path.unlink(missing_ok=True)
