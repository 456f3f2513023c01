"""What `fit` does with its run dir before training (resume, start afresh, or refuse) and the one rule
for a command given a path that may be a run dir.

A run dir holds one run: its metrics.jsonl, TensorBoard events and config describe the checkpoints
beside them. Two runs must never share these files, so a new run is refused in a dir that already
holds one, with or without a checkpoint (an attempt that crashed before its first checkpoint leaves
logs but no last.pt). ``--resume auto``, what a scheduler's requeue runs, continues from last.pt;
when last.pt is missing or damaged, from the newest other checkpoint of the run that loads
(step-S.pt, best.pt...: each holds the whole state), keeping a damaged last.pt under another name.
With no checkpoint that loads it sets the attempt's files aside and starts afresh. Nothing is deleted.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from visiontrain.core.config import ConfigError, flatten
from visiontrain.engine.state.checkpoint import CheckpointError, read_checkpoint_file
from visiontrain.engine.state.files import damage_in
from visiontrain.engine.state.sharded import dcp_path
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.rundir.run_files import (BEST_CHECKPOINT, CHECKPOINTS_DIR, CONFIG_FILE, FINAL_WEIGHTS, LAST_CHECKPOINT,
                                          METRICS_FILE, MLFLOW_FILES, PLOTS_DIR, PROFILE_DIR, PROVENANCE_FILE,
                                          REPORT_FILE, SUMMARY_FILE, TENSORBOARD_DIR)
from visiontrain.rundir.run_lock import held
from visiontrain.rundir.write_failure import why_not_written

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


def previous_attempt(run_dir: Path, *, with_last: bool = False) -> list[str]:
    """The files (relative to ``run_dir``) of a run that wrote no last.pt: empty when there is one,
    unless ``with_last`` (a last.pt that does not load counts as none)."""
    checkpoints = run_dir / CHECKPOINTS_DIR
    if (checkpoints / LAST_CHECKPOINT).is_file() and not with_last:
        return []
    found = [name for name in RUN_FILES if (run_dir / name).exists()]
    return found + ([f"{CHECKPOINTS_DIR}/{p.name}" for p in sorted(checkpoints.iterdir())] if checkpoints.is_dir()
                    else [])


def resumable_step(path: Path, *, verify: bool = True) -> int:
    """The step of a checkpoint a run can continue from; a CheckpointError naming why not: damaged
    bytes (``verify`` checks every entry's CRC32: torch.load would take a damaged tensor as it is),
    no training checkpoint, or an FSDP run's directory of shards that is missing. Tensors are
    mapped, not read: without ``verify`` only the file's small pickle is read."""
    state = fmt.read(read_checkpoint_file(path, mmap=True, verify=verify), path)
    missing = fmt.missing_entries(state)
    record = fmt.sharded_record(state)
    if missing:
        raise CheckpointError(f"checkpoint {path} is no training checkpoint (no {missing[0]!r})")
    if record is not None:
        dcp_path(path.parent, record)
    elif fmt.strategy_of(state) == fmt.FSDP:
        raise CheckpointError(f"checkpoint {path} was consolidated from an FSDP run: a run cannot continue from it")
    try:
        return fmt.step_of(state)
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path} records no step: {err!r}") from None


def resumable_checkpoints(ckpt_dir: Path, skip: Path | None = None, limit: int = 1) -> list[tuple[int, Path]]:
    """The ``limit`` newest (highest step recorded inside) checkpoints of ``ckpt_dir`` but ``skip``
    that a run can continue from; a step-S.pt before a best.pt of the same step. Each file's pickle
    is read to know its step, and only the newest are read whole to check their bytes."""
    candidates = []
    for path in sorted(ckpt_dir.glob("*.pt")) if ckpt_dir.is_dir() else []:
        if path != skip and path.is_file():
            with contextlib.suppress(CheckpointError):
                candidates.append((resumable_step(path, verify=False), path))
    candidates.sort(key=lambda item: (-item[0], not item[1].name.startswith("step-"), item[1].name))
    found: list[tuple[int, Path]] = []
    for step, path in candidates:
        if len(found) < limit and damage_in(path) is None:
            found.append((step, path))
    return found


def _set_aside(path: Path, run_dir: Path) -> Path:
    """``path`` renamed ``NAME.broken-<time>``: a damaged last.pt is kept, never deleted, and no
    longer stands in the way of the next one."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, k = path.with_name(f"{path.name}.broken-{stamp}"), 1
    while aside.exists():
        aside, k = path.with_name(f"{path.name}.broken-{stamp}-{k}"), k + 1
    try:
        os.replace(path, aside)
    except OSError as err:
        raise CheckpointError(f"run dir {run_dir} cannot be written: {why_not_written(err, run_dir)} "
                              f"({path}); --resume auto keeps a damaged {path.name} under another name: make it "
                              f"writable or choose another --run-dir") from err
    return aside


def _explicit(resume: str) -> str:
    """``--resume PATH`` (a checkpoint, or a run dir's last.pt), checked before anything is written; a
    damaged one is refused with the checkpoints beside it that a run can continue from."""
    path = checkpoint_in(resume, (LAST_CHECKPOINT,))
    try:
        read_checkpoint_file(path, mmap=True, verify=True)
    except CheckpointError as err:
        if path.parent.name != CHECKPOINTS_DIR:
            raise
        others = resumable_checkpoints(path.parent, skip=path, limit=3)
        listed = ", ".join(f"{p} (step {step})" for step, p in others)
        todo = f"the newest checkpoints of that run that load: {listed}: pass one to --resume" if others else \
            f"no other checkpoint in {path.parent} loads"
        raise CheckpointError(f"{err}; {todo}") from None
    return str(path)


def _continue_without_last(run_dir: Path, broken: CheckpointError | None,
                           is_main: bool) -> tuple[str | None, list[str]]:
    """``--resume auto`` when last.pt is missing or ``broken``: the newest checkpoint that loads.
    None when there is none."""
    last = run_dir / CHECKPOINTS_DIR / LAST_CHECKPOINT
    newest = resumable_checkpoints(run_dir / CHECKPOINTS_DIR, skip=last)
    if not newest:
        return None, []
    step, source = newest[0]
    if broken is None:
        what = f"{last} is missing"
    else:
        kept = _set_aside(last, run_dir) if is_main else last.with_name(f"{LAST_CHECKPOINT}.broken-<time>")
        what = f"{broken} (kept as {kept.name})"
    return str(source), [f"{what}; continuing from {source} (step {step}), the newest checkpoint that loads"]


def resolve_resume(run_dir: Path, resume: str | None, *, is_main: bool = True) -> tuple[str | None, list[str]]:
    """The checkpoint a `fit` continues from (None: a new run) and the lines to print about it.

    ``resume`` is the ``--resume`` argument: None, ``auto``, a checkpoint or a run dir (its last.pt).
    Only the main process (``is_main``) moves files; every rank decides the same way."""
    last = run_dir / CHECKPOINTS_DIR / LAST_CHECKPOINT
    if resume not in (None, "auto"):
        return _explicit(resume), []
    if last.is_file() and resume is None:
        raise ConfigError(f"run dir {run_dir} already holds a run ({last}); pass --resume auto to continue it, "
                          f"or --run-dir DIR for a new run (nothing was overwritten)")
    broken = None
    if last.is_file():
        try:
            resumable_step(last)
            return str(last), []
        except CheckpointError as err:
            broken = err
    elif resume is None:
        _refuse_earlier_attempt(run_dir)
        return None, []
    source, notes = _continue_without_last(run_dir, broken, is_main)
    if source is not None:
        return source, notes
    return None, _start_afresh(run_dir, broken, is_main)


def resume_source(run_dir: str | Path | None, resume: str | None) -> str | None:
    """The checkpoint a ``Trainer`` continues from, decided as ``fit`` decides it on the command line
    (one path for both, so a script keeps the CLI's guarantees): in a run dir, no ``resume`` refuses
    a dir that holds a run, and ``"auto"`` continues it (:func:`resolve_resume`); a checkpoint or a
    run dir given as ``resume`` is checked to load before anything is written. Rank 0 prints what it
    did, as the CLI does."""
    if run_dir is None:
        if resume == "auto":
            raise ConfigError("resume='auto' continues the run in a run dir, and this Trainer has none: pass run_dir")
        return _explicit(resume) if resume is not None else None
    is_main = os.environ.get("RANK", "0") == "0"
    checkpoint, notes = resolve_resume(Path(run_dir), resume, is_main=is_main)
    for note in notes if is_main else ():
        print(f"visiontrain: {note}", file=sys.stderr)
    return checkpoint


def _refuse_earlier_attempt(run_dir: Path) -> None:
    """A new run (no --resume) in a run dir an earlier attempt wrote into, without its last.pt."""
    leftovers = previous_attempt(run_dir)
    if not leftovers:
        return
    checkpoints = [name for name in leftovers if name.endswith(".pt")]
    what = (f"without {CHECKPOINTS_DIR}/{LAST_CHECKPOINT}, whose {', '.join(checkpoints)} --resume auto would "
            f"continue from if one loads" if checkpoints else "that wrote no checkpoint")
    raise ConfigError(f"run dir {run_dir} holds an earlier run {what} ({', '.join(leftovers)}): a new run there "
                      f"would mix its logs with that one's. Pass --run-dir DIR for a new run, or --resume auto to "
                      f"continue it, or, with no checkpoint that loads, set those files aside and start afresh "
                      f"(nothing was changed)")


def _start_afresh(run_dir: Path, broken: CheckpointError | None, is_main: bool) -> list[str]:
    """``--resume auto`` with no checkpoint that loads: the earlier attempt's files (a damaged last.pt
    among them) go into ``attempt-without-checkpoint-<time>/`` and a new run starts."""
    leftovers = previous_attempt(run_dir, with_last=broken is not None)
    why = f"{broken}, and no other checkpoint loads" if broken is not None else \
        f"no checkpoint in {run_dir / CHECKPOINTS_DIR}"
    if not leftovers:
        return [f"{why}: starting a new run"]
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
    return [f"{why}: starting a new run; the files of the earlier attempt ({', '.join(leftovers)}) are now in "
            f"{aside}"]


def config_changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """One line per key whose value differs between the checkpoint's config and this run's."""
    old, new = flatten(before), flatten(after)
    return [f"config changed since the checkpoint: {key}: {old.get(key, '(unset)')!r} -> {new.get(key, '(unset)')!r}"
            for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)]


def hold_run_dir(run_dir: str | Path | None) -> contextlib.ExitStack:
    """The run dir's lock (``rundir.run_lock``) for a training's rank 0, as a stack to close when the
    training ends: one writer per run dir from Python as from the CLI (whose own lock, held around
    the whole command, is the same one; ``held`` is re-entrant). Lines about the lock (one taken
    over from a dead holder, a file system that cannot lock) go to stderr. No run dir: nothing."""
    stack = contextlib.ExitStack()
    if run_dir is not None:
        lock = stack.enter_context(held(Path(run_dir), enabled=os.environ.get("RANK", "0") == "0"))
        for note in lock.notes:
            print(f"visiontrain: {note}", file=sys.stderr)
    return stack
