"""What `fit` does with its run dir before training (resume, start afresh, or refuse) and the one rule
for a command given a path that may be a run dir.

A run dir holds one run: its metrics.jsonl, TensorBoard events and config describe the checkpoints
beside them. Two runs must never share these files, so a new run is refused in a dir that already
holds one, with or without a checkpoint (an attempt that crashed before its first checkpoint leaves
logs but no last.pt). ``--resume auto``, what a scheduler's requeue runs, instead sets such an
attempt's logs aside and starts afresh: nothing of it can be resumed, and nothing is deleted.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from visiontrain.config import ConfigError, flatten
from visiontrain.engine.state.checkpoint import CheckpointError
from visiontrain.engine.state.run_files import (BEST_CHECKPOINT, CHECKPOINTS_DIR, CONFIG_FILE, FINAL_WEIGHTS,
                                                LAST_CHECKPOINT, METRICS_FILE, MLFLOW_FILES, PLOTS_DIR, PROFILE_DIR,
                                                PROVENANCE_FILE, REPORT_FILE, SUMMARY_FILE, TENSORBOARD_DIR)
from visiontrain.engine.state.write_failure import why_not_written

#: What a run writes beside its checkpoints (engine.state.run_files names each).
RUN_FILES = (CONFIG_FILE, METRICS_FILE, TENSORBOARD_DIR, PLOTS_DIR, SUMMARY_FILE, REPORT_FILE, *FINAL_WEIGHTS,
             PROFILE_DIR, PROVENANCE_FILE, *MLFLOW_FILES)


def checkpoint_in(target: str | os.PathLike, names: tuple[str, ...] = (BEST_CHECKPOINT, LAST_CHECKPOINT)) -> Path:
    """``target`` if it is a checkpoint file; for a run dir, the first of its ``checkpoints/<names>``
    that exists. validate, predict, export and --init read best.pt, else last.pt; --resume last.pt."""
    path = Path(target)
    if path.is_dir():
        found = next((path / CHECKPOINTS_DIR / n for n in names if (path / CHECKPOINTS_DIR / n).is_file()), None)
        if found is None:
            wanted = " or ".join(f"{CHECKPOINTS_DIR}/{n}" for n in names)
            raise CheckpointError(f"{path}: a directory without {wanted}; give a run dir of `visiontrain fit` "
                                  f"or a checkpoint file")
        return found
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; give a checkpoint file or a run dir")
    return path


def previous_attempt(run_dir: Path) -> list[str]:
    """The files (relative to ``run_dir``) of a run that wrote no last.pt: empty when there is one."""
    checkpoints = run_dir / CHECKPOINTS_DIR
    if (checkpoints / LAST_CHECKPOINT).is_file():
        return []
    found = [name for name in RUN_FILES if (run_dir / name).exists()]
    return found + ([f"{CHECKPOINTS_DIR}/{p.name}" for p in sorted(checkpoints.iterdir())] if checkpoints.is_dir()
                    else [])


def resolve_resume(run_dir: Path, resume: str | None, *, is_main: bool = True) -> tuple[str | None, list[str]]:
    """The checkpoint a `fit` continues from (None: a new run) and the lines to print about it.

    ``resume`` is the ``--resume`` argument: None, ``auto``, a checkpoint or a run dir (its last.pt).
    Only the main process (``is_main``) moves files; every rank decides the same way."""
    last = run_dir / CHECKPOINTS_DIR / LAST_CHECKPOINT
    if resume not in (None, "auto"):
        return str(checkpoint_in(resume, (LAST_CHECKPOINT,))), []
    if last.is_file():
        if resume == "auto":
            return str(last), []
        raise ConfigError(f"run dir {run_dir} already holds a run ({last}); pass --resume auto to continue it, "
                          f"or --run-dir DIR for a new run (nothing was overwritten)")
    leftovers = previous_attempt(run_dir)
    if leftovers and resume is None:
        raise ConfigError(f"run dir {run_dir} holds an earlier run that wrote no checkpoint "
                          f"({', '.join(leftovers)}): a new run there would mix its logs with that one's. Pass "
                          f"--run-dir DIR for a new run, or --resume auto to set those files aside and start "
                          f"afresh (nothing was changed)")
    if resume is None:
        return None, []
    if not leftovers:
        return None, [f"no checkpoint in {run_dir / CHECKPOINTS_DIR}: starting a new run"]
    aside = run_dir / f"attempt-without-checkpoint-{time.strftime('%Y%m%d-%H%M%S')}"
    if is_main:
        try:
            (aside / CHECKPOINTS_DIR).mkdir(parents=True)
            for name in leftovers:
                os.replace(run_dir / name, aside / name)
        except OSError as err:
            raise CheckpointError(f"run dir {run_dir} cannot be written: {why_not_written(err, run_dir)} "
                                  f"({err.filename or run_dir}); --resume auto starts afresh there and sets the "
                                  f"earlier attempt's files aside: make it writable or choose another --run-dir"
                                  ) from err
    return None, [f"no checkpoint in {run_dir / CHECKPOINTS_DIR}: starting a new run; the files of the earlier "
                  f"attempt ({', '.join(leftovers)}) are now in {aside}"]


def config_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """One line per key whose value differs between the checkpoint's config and this run's."""
    old, new = flatten(before), flatten(after)
    return [f"config changed since the checkpoint: {key}: {old.get(key, '(unset)')!r} -> {new.get(key, '(unset)')!r}"
            for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)]
