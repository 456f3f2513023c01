"""A run's checkpoints: the run dir, whole-or-sharded loads, the states of the weights and the RNGs,
best-k bookkeeping.

Every file goes through ``engine.state.files`` (atomic writes, weights_only reads) and is read in the
current format (``engine.state.checkpoint_format``).
"""
from __future__ import annotations

import contextlib
import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from visiontrain.engine.state.files import CheckpointError, atomic_save, give_usual_mode, read_checkpoint_file
from visiontrain.engine.state.sharded import ShardedCheckpoints, resolve_full
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.rundir.run_files import (BEST_CHECKPOINT, BEST_EMA_CHECKPOINT, CHECKPOINTS_DIR, CONFIG_FILE,
                                          LAST_CHECKPOINT)
from visiontrain.rundir.write_failure import why_not_written

__all__ = ["CheckpointError", "atomic_save", "give_usual_mode", "read_checkpoint_file", "load_checkpoint",
           "BestTracker", "ReplicatedWeights", "WeightsState", "RngState", "capture_rng", "restore_rng",
           "prepare_run_dir",
           "removed_if_set_up_fails", "write_run_file", "write_run_config", "remove_stale_temporaries"]


def _unwritable(run_dir: Path, err: OSError, where: Path | None = None) -> CheckpointError:
    """Which path, why, and what to do: a run that has a checkpoint can go on in another run dir."""
    where = where or Path(err.filename or run_dir)
    last = run_dir / CHECKPOINTS_DIR / LAST_CHECKPOINT
    todo = (f"make it writable, or continue its run in another: --run-dir NEW --resume {last}" if last.is_file()
            else "make it writable or choose another --run-dir")
    return CheckpointError(f"run dir {run_dir} cannot be written: {why_not_written(err, where)} ({where}); {todo}")


def prepare_run_dir(run_dir: Path) -> list[str]:
    """Create RUN_DIR/checkpoints and delete what interrupted writes left (returned, to be
    reported). An unwritable run dir (a read-only copy, a full disk) is an error that names it,
    before any training: a file is created in each directory and removed again to find out."""
    for directory in (run_dir, run_dir / CHECKPOINTS_DIR):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".write-check.", suffix=".tmp", dir=directory)
            os.close(fd)
            os.unlink(probe)
        except OSError as err:
            raise _unwritable(run_dir, err, directory) from err
    return remove_stale_temporaries(run_dir / CHECKPOINTS_DIR) + remove_stale_temporaries(run_dir)


@contextlib.contextmanager
def removed_if_set_up_fails(run_dir: Path | None) -> Any:
    """Around a run's set-up: if it fails (a dataset a worker cannot receive, a model that cannot be
    built), the directories this attempt created for the run are removed again, so a refused start
    writes nothing. Only empty directories go: anything an earlier run left stays as it was."""
    created: list[Path] = []
    if run_dir is not None:
        missing = run_dir.absolute()
        while not missing.exists():
            created.append(missing)
            missing = missing.parent
    try:
        yield
    except BaseException:
        for directory in [*(d / CHECKPOINTS_DIR for d in created[:1]), *created]:  # deepest first
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise


def write_run_file(run_dir: Path, name: str, text: str) -> None:
    """(Re)write RUN_DIR/name atomically (config.yaml, summary.json): a kill never leaves half a file."""
    try:
        tmp = run_dir / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, run_dir / name)
    except OSError as err:
        raise _unwritable(run_dir, err, run_dir / name) from err


def write_run_config(run_dir: Path, text: str, resumed_at: int | None = None) -> None:
    """RUN_DIR/config.yaml. A resumed run whose config differs keeps the earlier one as
    config-<step>.yaml: the config of the segment that ended at that step."""
    old = run_dir / CONFIG_FILE
    if resumed_at is not None and old.is_file() and old.read_text() != text:
        write_run_file(run_dir, f"config-{resumed_at}.yaml", old.read_text())
    write_run_file(run_dir, CONFIG_FILE, text)


def remove_stale_temporaries(directory: Path) -> list[str]:
    """Delete the temporary files a kill during a write left (``.NAME.*.tmp``, see atomic_save);
    the files they were to replace are complete. Returns their names."""
    stale = [p for p in directory.glob(".*.tmp") if p.is_file()]
    for p in stale:
        p.unlink(missing_ok=True)
    return [p.name for p in stale]


def load_checkpoint(path: str | os.PathLike, *, resolve_sharded: bool = True, mmap: bool = False) -> dict[str, Any]:
    """Load with weights_only=True onto the CPU, in the current format; every failure names the file
    and the reason.

    A checkpoint of an FSDP run names a directory of sharded tensors (``engine.fsdp``); it is
    returned whole, as a single-file checkpoint would be, unless ``resolve_sharded`` is False (the
    trainer then reads each rank's shards itself). ``mmap`` maps tensors instead of reading them."""
    obj = fmt.read(read_checkpoint_file(path, mmap=mmap), path)
    if resolve_sharded and fmt.sharded_record(obj) is not None:
        obj = resolve_full(obj, Path(path))
    return obj


def capture_rng() -> dict[str, Any]:
    """Python, NumPy, torch CPU and CUDA generator states, in weights_only-loadable form."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


class RngState:
    """The global random streams as a checkpoint entry (restored last: nothing may draw after it)."""

    def state_dict(self) -> dict[str, Any]:
        return capture_rng()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng(state)


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def link_over(source: Path, target: Path) -> bool:
    """Make ``target`` a hard link to ``source``, replacing it atomically (a link under a temporary
    name, then renamed over it). False where the file system has no hard links: write it then. A
    later write of either name replaces only that name's file (atomic_save renames a new file in),
    so the two never change together."""
    tmp = target.with_name(f".{target.name}.link.tmp")
    try:
        tmp.unlink(missing_ok=True)
        os.link(source, tmp)
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)
        return False
    return True


class BestTracker:
    """best.pt / best_ema.pt and, optionally, the k best as best-stepS.pt files."""

    def __init__(self, ckpt_dir: Path, mode: str, keep: int = 0) -> None:
        self.dir, self.mode, self.keep = ckpt_dir, mode, keep
        self.best: dict[str, float] = {}  # "model" / "ema" -> best value
        self.kept: list[tuple[float, str]] = []  # (value, file) of the k best

    def better(self, value: float, old: float | None) -> bool:
        if value != value:  # NaN is never best
            return False
        return old is None or (value > old if self.mode == "max" else value < old)

    def wants(self, which: str, value: float) -> bool:
        """Would ``update`` write anything for this value? (Lets the caller skip building a state.)"""
        if self.better(value, self.best.get(which)):
            return True
        return which == "model" and self.keep > 0 and value == value and (
            len(self.kept) < self.keep or self.better(value, self.kept[-1][0]))

    def update(self, which: str, value: float, state: dict[str, Any], step: int) -> bool:
        """Write best.pt (best_ema.pt) on a new record and keep best-stepS.pt for the k best. A record
        that is also kept is written once: best.pt is then a hard link to its best-stepS.pt."""
        record = self.better(value, self.best.get(which))
        kept = None
        if which == "model" and self.keep and self.wants("model", value):
            kept = self.dir / f"best-step{step}.pt"
            atomic_save(state, kept)
            self.kept.append((value, kept.name))
        if record:
            self.best[which] = value
            best = self.dir / (BEST_CHECKPOINT if which == "model" else BEST_EMA_CHECKPOINT)
            if kept is None or not link_over(kept, best):
                atomic_save(state, best)
        if kept is not None:
            self.kept.sort(key=lambda t: -t[0] if self.mode == "max" else t[0])
            for _, stale in self.kept[self.keep:]:
                (self.dir / stale).unlink(missing_ok=True)
            self.kept = self.kept[: self.keep]
        return record

    def state_dict(self) -> dict[str, Any]:
        return {"best": dict(self.best), "kept": [[v, n] for v, n in self.kept]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = {k: float(v) for k, v in state["best"].items()}
        self.kept = [(float(v), str(n)) for v, n in state["kept"]]


class ReplicatedWeights:
    """Model, optimizer and EMA as whole state dicts inside the ``.pt`` file (one process, DDP).
    ``engine.fsdp.ShardedCheckpoints`` is the same interface for sharded runs."""

    def save(self, step: int, model: Any, optimizer: Any, ema: Any) -> dict[str, Any]:
        return {fmt.MODEL: model.state_dict(), fmt.OPTIMIZER: optimizer.state_dict(),
                fmt.EMA: ema.state_dict() if ema is not None else None}

    def load(self, source: Path, state: dict[str, Any], model: Any, optimizer: Any, ema: Any) -> None:
        model.load_state_dict(state[fmt.MODEL])
        optimizer.load_state_dict(state[fmt.OPTIMIZER])
        if ema is not None and state[fmt.EMA] is not None:
            ema.load_state_dict(state[fmt.EMA])


class WeightsState:
    """The model, its optimizer and its EMA as one checkpoint entry: whole tensors in the file, or
    (FSDP) the name of the directory of shards every rank wrote. ``checkpoint_path`` is the file a
    resume reads, whose directory holds the shards."""

    def __init__(self, run: Any, progress: Any) -> None:
        self.run, self.progress = run, progress
        self.store: ReplicatedWeights | ShardedCheckpoints = run.sharded or ReplicatedWeights()
        self.checkpoint_path: Path | None = None

    def state_dict(self) -> dict[str, Any]:
        r = self.run
        return {**self.store.save(self.progress.step, r.raw_model, r.optimizer, r.ema),
                fmt.STRATEGY: fmt.FSDP if r.sharded is not None else fmt.REPLICATED}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        r = self.run
        self.store.load(self.checkpoint_path, state, r.raw_model, r.optimizer, r.ema)
