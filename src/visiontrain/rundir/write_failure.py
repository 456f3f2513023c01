"""A file of a run that could not be written, said in plain words: which file, why (the disk is full,
the file system is read-only, no permission), and what is needed. The checkpoint writer
(``engine.state.files``), the run dir's own files (``engine.state.checkpoint``), the metrics writer
(``engine.records.run_log``) and the report all word it here, once. Torch-free, as ``engine.records.run_log`` is.
"""
from __future__ import annotations

import contextlib
import errno
import shutil
from pathlib import Path

#: The failures a user can act on, in their words; any other keeps the system's own text.
PLAIN_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EFBIG: "the file would exceed the file-size limit (ulimit -f)",
}
#: Failures about space, after which the free space is worth saying.
SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class WriteError(RuntimeError):
    """A run's file could not be written; the message names it, says why and what was kept."""


def os_error_in(err: BaseException) -> OSError | None:
    """The OSError behind ``err``: torch.save reports a failed write as its zip writer's RuntimeError
    ("unexpected pos 704 vs 598"), raised while handling the OSError of the write itself."""
    seen: BaseException | None = err
    for _ in range(5):
        if seen is None:
            return None
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def free_space(directory: Path) -> str:
    """'N MiB free on that file system', or '' when it cannot be known."""
    with contextlib.suppress(OSError):
        return f"{shutil.disk_usage(directory).free / 2**20:.0f} MiB free on that file system"
    return ""


def why_not_written(err: BaseException, directory: Path) -> str:
    """Why a file in ``directory`` could not be written, in plain words; about space, with the system's
    own words, which a user searches for, and the free space ("the disk is full (No space left on
    device; 0 MiB free on that file system)"); the system's own text where it has no plainer one."""
    cause = os_error_in(err)
    if cause is not None and cause.errno in PLAIN_REASONS:
        reason = PLAIN_REASONS[cause.errno]
    elif cause is not None:
        reason = cause.strerror or str(cause)
    else:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    if cause is None or cause.errno in SPACE:
        words = [cause.strerror] if cause is not None and cause.strerror else []
        words += [free_space(directory)]
        reason += f" ({'; '.join(filter(None, words))})" if any(words) else ""
    return reason
