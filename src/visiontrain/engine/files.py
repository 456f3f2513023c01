"""Checkpoint files: atomic writes and weights_only reads, with errors that name the file.

A write goes to a temporary file in the same directory, is flushed and fsync'ed, then renamed over
the target with os.replace (atomic on POSIX) and the directory is fsync'ed: a crash at any moment
leaves either the old or the new file, both complete. Reads use ``torch.load(weights_only=True)``:
a checkpoint holds only tensors and plain containers, so nothing in it can run code. The lowest
layer of checkpointing: ``engine.fsdp`` (shards) and ``engine.checkpoint`` (a run's) build on it.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file."""


def give_usual_mode(path: str | os.PathLike) -> None:
    """The mode a plain ``open()`` would give (0666 less the umask), for files that tools create 0600."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _write_failure(path: Path, err: BaseException) -> CheckpointError:
    """torch.save reports a failed write (a full disk, a file-size limit) as a RuntimeError from its
    zip writer; say what happened in the terms of the filesystem instead."""
    reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err).strip().splitlines()[0][:200]
    with contextlib.suppress(OSError):
        reason += f"; {shutil.disk_usage(path.parent).free / 2**20:.0f} MiB free on that filesystem"
    return CheckpointError(f"could not write checkpoint {path}: {reason} (the previous file, if any, is intact)")


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise _write_failure(path, err) from err
    try:
        give_usual_mode(tmp)  # mkstemp makes 0600
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(err, (OSError, RuntimeError)):
            raise _write_failure(path, err) from err
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_checkpoint_file(path: str | os.PathLike, *, mmap: bool = False) -> dict[str, Any]:
    """The file as written, loaded with weights_only=True onto the CPU; every failure names the file
    and the reason. ``mmap`` maps tensors instead of reading them. (An FSDP run's file names its
    directory of shards: ``engine.checkpoint.load_checkpoint`` resolves that.)"""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        # torch's text advises weights_only=False, which is not for a file one does not trust: keep the reason
        reason = next((line.split("WeightsUnpickler error: ", 1)[1].split(" Please use", 1)[0]
                       for line in str(err).splitlines() if "WeightsUnpickler error: " in line), str(err)[:300])
        raise CheckpointError(f"checkpoint {path} holds objects other than tensors and plain containers and "
                              f"was refused (weights_only load; nothing in it was run): {reason}") from None
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as err:
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt: {err}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(obj).__name__}, expected a dict")
    return obj
