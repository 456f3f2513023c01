"""Checkpoint files: atomic writes and weights_only reads, with errors that name the file.

A write goes to a temporary file in the same directory, is flushed and fsync'ed, then renamed over
the target with os.replace (atomic on POSIX) and the directory is fsync'ed: a crash at any moment
leaves either the old or the new file, both complete. Reads use ``torch.load(weights_only=True)``:
a checkpoint holds only tensors and plain containers, so nothing in it can run code. A file that is
no torch file at all (text, an HTML page, a git-LFS pointer) is named for what it is from its
first bytes, before torch reads it (torch's own error for it is a ``KeyError`` of its pickle).
The lowest layer of checkpointing: ``engine.fsdp`` (shards) and ``engine.state.checkpoint`` (a run's)
build on it.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch

from visiontrain.engine.state.checkpoint_format import CheckpointError
from visiontrain.engine.state.write_failure import why_not_written


def give_usual_mode(path: str | os.PathLike) -> None:
    """The mode a plain ``open()`` would give (0666 less the umask), for files that tools create 0600."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _write_failure(path: Path, err: BaseException) -> CheckpointError:
    """Which file, why in plain words (torch.save reports a full disk as its zip writer's
    RuntimeError: ``why_not_written`` finds the OSError behind it), and what is left."""
    others = sorted(p.name for p in path.parent.glob("*.pt") if p != path) if path.parent.is_dir() else []
    if path.is_file():
        kept = f"the previous {path.name} is intact"
    elif others:
        listed = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        kept = f"the checkpoints already there ({listed}) are intact"
    else:
        kept = "no checkpoint was there before"
    return CheckpointError(f"could not write checkpoint {path}: {why_not_written(err, path.parent)}; {kept}, and "
                           f"nothing of this write was left behind")


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


#: How a ``torch.save`` file begins: a zip archive (the format since torch 1.6) or a pickle (the legacy one).
TORCH_FILE_STARTS = (b"PK\x03\x04", b"\x80")
#: Bytes read to tell what a file is: enough for a git-LFS pointer or the head of a web page.
HEAD_BYTES = 1024
#: How torch's weights_only loader words a refused object (a class, a function); its other errors
#: ("Unsupported operand 118", "String is too long") are damaged bytes.
OBJECT_REFUSALS = ("GLOBAL", "allowlisted", "must be imported")


def _looks_like_text(head: bytes) -> bool:
    """No NUL byte and valid UTF-8 (a character cut by the end of ``head`` aside)."""
    if b"\0" in head:
        return False
    for cut in range(4):
        try:
            head[:len(head) - cut].decode("utf-8")
            return True
        except UnicodeDecodeError:
            continue
    return False


def not_weights(path: Path) -> str | None:
    """What the file is when its first bytes show it holds no weights in any format (an empty file, a
    git-LFS pointer, a web page, text), said for the user; None when it may hold some. A mistake
    common enough to deserve its own words: a pointer cloned without ``git lfs``, or the sign-in
    page a download saved in place of the file."""
    with open(path, "rb") as f:
        head = f.read(HEAD_BYTES)
    if not head:
        return "it is empty (0 bytes)"
    if head.startswith(b"version https://git-lfs.github.com/spec/"):
        return ("it is a git-LFS pointer, a small text file that stands for the real one: fetch the file itself "
                "with `git lfs pull` in the repository it came from")
    if not _looks_like_text(head):
        return None
    text = head.decode("utf-8", errors="ignore").lstrip("\ufeff \t\r\n")
    if text.lower().startswith(("<!doctype html", "<html")) or "<html" in text.lower():
        return ("it is an HTML page: a web page (a sign-in, error or download page) was saved in place of "
                "the file; download the file itself")
    first = text.splitlines()[0][:60] if text.strip() else ""
    return f"it looks like text, not a binary weights file (it begins {first!r})"


def not_a_torch_file(path: Path) -> str | None:
    """``not_weights``, and a binary file that does not begin as ``torch.save`` files do."""
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith(TORCH_FILE_STARTS):
        return None  # torch.load tells a whole file from a truncated or corrupt one
    what = not_weights(path)
    return what or f"it is neither the zip archive nor the pickle that torch.save writes (it begins {head!r})"


def _torch_reason(err: BaseException) -> str:
    """torch's error in a few words: its first sentence, without the advice that follows it."""
    if isinstance(err, EOFError):
        return "the file ends before its data does"
    text = " ".join(str(err).split()) or type(err).__name__
    return text.split(". This is an internal", 1)[0][:300]


def read_checkpoint_file(path: str | os.PathLike, *, mmap: bool = False) -> dict[str, Any]:
    """The file as written, loaded with weights_only=True onto the CPU; every failure names the file
    and the reason. ``mmap`` maps tensors instead of reading them. (An FSDP run's file names its
    directory of shards: ``engine.state.checkpoint.load_checkpoint`` resolves that.)"""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        what = not_a_torch_file(path)
    except OSError as err:
        raise CheckpointError(f"checkpoint {path} cannot be read: {err.strerror or err}") from None
    if what is not None:
        raise CheckpointError(f"{path} is not a checkpoint: {what}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        # torch's text advises weights_only=False, which is not for a file one does not trust: keep the reason
        reason = " ".join(str(err).split("WeightsUnpickler error:", 1)[-1].split("Please use", 1)[0].split()
                          ).split(" Check the documentation", 1)[0]
        if not any(words in reason for words in OBJECT_REFUSALS):  # "Unsupported operand 118": damaged bytes
            raise CheckpointError(f"checkpoint {path} is truncated or corrupt: {reason or 'unreadable pickle'}") \
                from None
        raise CheckpointError(f"checkpoint {path} holds objects other than tensors and plain containers and "
                              f"was refused (weights_only load; nothing in it was run): {reason}") from None
    except MemoryError:
        raise
    except Exception as err:  # noqa: BLE001  (a damaged pickle raises KeyError, ValueError, EOFError...)
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt: {_torch_reason(err)}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(obj).__name__}, expected a dict")
    return obj
