"""What the up-front image check found, kept between runs: a second run stats its files instead of
opening them.

The check (``data.image_check``) opens every file of both splits before the first step, on every
rank, and ``validate`` and ``preview`` do it again: about 2 minutes for ImageNet's 1.28 M files and
15-20 s for COCO's 123 k, at every start. A file's verdict (what is wrong with it, or nothing, and
its upright size, which the detection readers need) depends only on its bytes, so it is recorded
under the file's absolute path with its size and modification time (nanoseconds), and reused while
both are unchanged: a file replaced, rewritten or touched is opened again.

The verdicts are one SQLite file per machine in the data cache directory (``data.cache_dir``'s
``VISIONTRAIN_DATA_CACHE``, ``~/.cache/visiontrain/datasets``), not in the dataset's directory,
which may be read-only or shared by users whose runs must not write into it. Ranks of one run (and
runs started at once) take the file's lock around a split's check: the first checks and records,
the others wait and then find every verdict there. Where the file cannot be created or locked (a
read-only home), every check opens its files, as without this module.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from visiontrain.data.cache_dir import data_cache_dir

VERDICTS_FILE = "image-checks.sqlite"
#: Verdicts looked up or recorded per SQLite statement (its host-parameter limit is 32,766).
BATCH = 4096

Verdict = tuple[str | None, tuple[int, int] | None]  # (problem, upright (width, height)) as inspect_image gives


@dataclass(frozen=True)
class FileStamp:
    """What a verdict is valid for: the file's absolute path, size and modification time."""

    path: str
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: str) -> "FileStamp | None":
        """The file's stamp, or None for a file that cannot be stat'ed (missing: the check says so)."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        return cls(os.path.abspath(path), st.st_size, st.st_mtime_ns)


class VerdictStore:
    """The recorded verdicts (one SQLite file). ``None`` as the location: a store that holds nothing."""

    def __init__(self, location: Path | None) -> None:
        self.location = location

    @classmethod
    def default(cls) -> "VerdictStore":
        return cls(data_cache_dir() / VERDICTS_FILE)

    @contextlib.contextmanager
    def held(self) -> Iterator["VerdictStore"]:
        """The store, under an exclusive lock for the caller's check (ranks check one at a time);
        a store that cannot be created or locked holds nothing instead."""
        if self.location is None:
            yield self
            return
        try:
            self.location.parent.mkdir(parents=True, exist_ok=True)
            lock = open(self.location.with_suffix(".lock"), "a")
        except OSError:
            yield VerdictStore(None)
            return
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
            except OSError:
                yield VerdictStore(None)
                return
            yield self

    def _connect(self) -> sqlite3.Connection | None:
        if self.location is None:
            return None
        try:
            db = sqlite3.connect(self.location, timeout=60)
            db.execute("CREATE TABLE IF NOT EXISTS verdicts (path TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER, "
                       "problem TEXT, width INTEGER, height INTEGER)")
            return db
        except sqlite3.Error:
            return None

    def lookup(self, stamps: Sequence[FileStamp]) -> dict[str, Verdict]:
        """The recorded verdicts of those files whose size and modification time are the recorded ones."""
        db, found = self._connect(), {}
        if db is None:
            return found
        with contextlib.closing(db):
            for start in range(0, len(stamps), BATCH):
                chunk = {s.path: s for s in stamps[start:start + BATCH]}
                marks = ",".join("?" * len(chunk))
                try:
                    rows = db.execute(f"SELECT path, size, mtime_ns, problem, width, height FROM verdicts "
                                      f"WHERE path IN ({marks})", list(chunk)).fetchall()
                except sqlite3.Error:
                    return found
                for path, size, mtime_ns, problem, width, height in rows:
                    stamp = chunk[path]
                    if (size, mtime_ns) == (stamp.size, stamp.mtime_ns):
                        found[path] = (problem, None if width is None else (width, height))
        return found

    def record(self, verdicts: Sequence[tuple[FileStamp, Verdict]]) -> None:
        """Keep these verdicts (a failed write keeps nothing: the next run checks those files again)."""
        db = self._connect() if verdicts else None
        if db is None:
            return
        rows = [(s.path, s.size, s.mtime_ns, problem, *(size or (None, None))) for s, (problem, size) in verdicts]
        with contextlib.closing(db), contextlib.suppress(sqlite3.Error):
            with db:
                db.executemany("INSERT OR REPLACE INTO verdicts VALUES (?, ?, ?, ?, ?, ?)", rows)
