"""Checkpoint files: atomic writes and weights_only reads, with errors that name the file.

A write goes to a temporary file in the same directory, is flushed and fsync'ed, then renamed over
the target with os.replace (atomic on POSIX) and the directory is fsync'ed: a crash at any moment
leaves either the old or the new file, both complete. Reads use ``torch.load(weights_only=True)``:
a checkpoint holds only tensors and plain containers, so nothing in it can run code. A file that is
no torch file at all (text, an HTML page, a git-LFS pointer) is named for what it is from its
first bytes, before torch reads it (torch's own error for it is a ``KeyError`` of its pickle). A
``torch.save`` file is a zip archive whose every entry carries a CRC32: torch.load does not check
them, so when it fails, the archive is checked entry by entry (:func:`damage_in`) to tell damaged
bytes from an intact file that holds an object a weights_only load refuses.
The lowest layer of checkpointing: ``engine.fsdp`` (shards) and ``engine.state.checkpoint`` (a run's)
build on it.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import IO, Any

import torch

from visiontrain.rundir.checkpoint_format import CheckpointError
from visiontrain.rundir.write_failure import why_not_written


def give_usual_mode(path: str | os.PathLike) -> None:
    """The mode a plain ``open()`` would give (0666 less the umask), for files that tools create 0600."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


class _RecordingWriter:
    """The file torch.save writes into, keeping the OSError of a failed write: torch's zip writer
    reports it as its own RuntimeError ("unexpected pos 563520 vs 563412"), which need not carry
    the OSError (a full disk) that caused it."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file, self.error = file, None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        try:
            self.file.flush()
        except OSError as err:
            self.error = self.error or err
            raise

    def fileno(self) -> int:
        return self.file.fileno()


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
    sink: _RecordingWriter | None = None
    try:
        give_usual_mode(tmp)  # mkstemp makes 0600
        with os.fdopen(fd, "wb") as f:
            sink = _RecordingWriter(f)
            torch.save(obj, sink)
            sink.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(err, (OSError, RuntimeError)):
            raise _write_failure(path, sink.error if sink is not None and sink.error else err) from err
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
        return "it is empty (0 bytes), truncated or never written"
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
        head = f.read(HEAD_BYTES)
    if head.startswith(TORCH_FILE_STARTS):
        return None  # torch.load tells a whole file from a truncated or corrupt one
    if head and not head.strip(b"\0"):
        return (f"it is corrupt: its first {len(head)} bytes are zero where torch.save writes a zip header (what "
                f"a crash or a full disk can leave of a file)")
    what = not_weights(path)
    return what or (f"it is corrupt, or in another format: it begins neither as the zip archive nor as the "
                    f"pickle that torch.save writes ({head[:8]!r})")


def damage_in(path: Path) -> str | None:
    """What is damaged in a ``torch.save`` zip archive: each entry is read and checked against the
    CRC32 the writer recorded, and the archive's directory against its entries. None when all is
    whole, or for a file in the legacy format (a bare pickle, no checksums). Reads the whole file,
    so it runs when a load failed, and before a resume (``engine.state.run_dir``)."""
    with open(path, "rb") as f:
        if not f.read(4).startswith(TORCH_FILE_STARTS[0]):
            return None
    try:
        with zipfile.ZipFile(path) as archive:
            bad_entry = archive.testzip()  # reads every entry, checking its CRC32 and local header
    except OSError as err:
        return f"it cannot be read: {err.strerror or err}"
    except zipfile.BadZipFile as err:
        if str(err) == "File is not a zip file":  # no end-of-archive record
            return "the end of its zip archive is missing (the file is cut short, or its end overwritten)"
        return f"its zip archive is damaged ({' '.join(str(err).split())[:200]})"
    except Exception as err:  # noqa: BLE001  (damaged headers: EOFError, ValueError, NotImplementedError...)
        return f"its zip archive is damaged ({type(err).__name__}: {' '.join(str(err).split())[:200]})"
    if bad_entry is not None:
        return f"its zip archive is damaged (entry {bad_entry!r} fails its CRC-32 or header check)"
    return None


def _torch_reason(err: BaseException) -> str:
    """torch's error in a few words: its first sentence, without the advice that follows it."""
    if isinstance(err, EOFError):
        return "the file ends before its data does"
    text = " ".join(str(err).split()) or type(err).__name__
    return text.split(". This is an internal", 1)[0][:300]


def _unpickling_reason(err: pickle.UnpicklingError) -> str:
    """The weights_only loader's own reason, without torch's advice to load with weights_only=False,
    which is not for a file one does not trust."""
    text = " ".join(str(err).split("WeightsUnpickler error:", 1)[-1].split("Please use", 1)[0].split())
    return text.split(" Check the documentation", 1)[0] or "unreadable pickle"


def _load_failure(path: Path, err: Exception) -> CheckpointError:
    """Why ``torch.load`` failed, in one line: damaged bytes (the archive's checksums say so; torch's
    words for them vary: "Unsupported operand 118", "pop from empty list", an unknown GLOBAL) or an
    intact file holding an object a weights_only load refuses."""
    damage = damage_in(path)
    if damage is not None:
        return CheckpointError(f"checkpoint {path} is truncated or corrupt: {damage}")
    if not isinstance(err, pickle.UnpicklingError):
        return CheckpointError(f"checkpoint {path} is truncated or corrupt: {_torch_reason(err)}")
    reason = _unpickling_reason(err)
    if not any(words in reason for words in OBJECT_REFUSALS):  # "Unsupported operand 118": damaged bytes
        return CheckpointError(f"checkpoint {path} is truncated or corrupt: {reason}")
    return CheckpointError(f"checkpoint {path} holds objects other than tensors and plain containers and was "
                           f"refused (weights_only load; nothing in it was run): {reason}")


def read_checkpoint_file(path: str | os.PathLike, *, mmap: bool = False, verify: bool = False) -> dict[str, Any]:
    """The file as written, loaded with weights_only=True onto the CPU; every failure names the file
    and the reason. ``mmap`` maps tensors instead of reading them (a zip archive's; a legacy file is
    read). ``verify`` also checks every entry's CRC32 when the load succeeds: torch.load does not, so
    bytes damaged inside a tensor load without complaint. (An FSDP run's file names its directory of
    shards: ``engine.state.checkpoint.load_checkpoint`` resolves that.)"""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        what = not_a_torch_file(path)
    except OSError as err:
        raise CheckpointError(f"checkpoint {path} cannot be read: {err.strerror or err}") from None
    if what is not None:
        raise CheckpointError(f"{path} is not a checkpoint: {what}")
    with warnings.catch_warnings(record=True) as said:  # damaged bytes make torch warn ("pickle protocol 56")
        warnings.simplefilter("always")
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and zipfile.is_zipfile(path))
        except MemoryError:
            raise
        except Exception as err:  # noqa: BLE001  (a damaged pickle raises KeyError, IndexError, EOFError...)
            raise _load_failure(path, err) from None
    for warning in said:  # the file loaded: what torch had to say about it is worth seeing
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    damage = damage_in(path) if verify else None
    if damage is not None:
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt: {damage}")
    if not isinstance(obj, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(obj).__name__}, expected a dict")
    return obj
