"""A resume on another number of processes: the global batch the checkpoint trained with is kept.

``data.batch_size`` is per process and ``trainer.accum_steps`` per optimizer step, so a run resumed
on 3 processes from a checkpoint written on 2 would, as configured, train on another global batch:
another learning rate (``optim.base_batch`` scales it), other steps per epoch, other samples in each
step. Instead, before anything is built from the batch size, :func:`keep_global_batch` chooses the
per-process batch and the accumulation that make the written global batch on this run's processes
(on the same number too: a resume that asks for a smaller per-process batch, to fit in memory, gets
the accumulation that keeps the global batch), and says so in one line ("resumed on 3 processes
(written on 1): data.batch_size 6 -> 4, trainer.accum_steps 2 -> 1: global batch 12 kept"). Where
no split keeps it, the resume is refused in one line that names the numbers of processes that would.

What may change depends on how the data source orders an epoch (its ``follows_world_size``, in the
checkpoint's data entry):
- ``any`` (the map-style sampler): one optimizer step trains on one contiguous piece of the epoch's
  permutation whatever the split, so the per-process batch and the accumulation may both change;
  the largest per-process batch not above the configured one is chosen (fewest micro-batches, no
  more memory than configured);
- ``accumulation`` (batches grouped by aspect ratio): a group's batches are cut at the per-process
  batch, so it stays and only the accumulation changes;
- ``canonical`` (shards: the epoch's order is cut for ``data.order_processes`` processes, in the
  checkpoint): the accumulation stays, and the processes must divide that number;
- ``none`` (shards grouped by aspect ratio: a group's batches are cut per process): nothing is
  planned; the source refuses another number of processes in its own words.

An FSDP checkpoint (sharded) resumes on any number of processes: torch's distributed checkpoint
reshards it as it loads (``engine.state.sharded``); on one process FSDP shards nothing, and its
checkpoints keep the sharded format, so the run can go back to several.

A run whose accumulation starts after an epoch (``trainer.accum_after_epoch``) has two global
batches; both are kept by keeping the accumulation and changing the per-process batch.
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import astuple, dataclass
from typing import Any

from visiontrain.core.config import Config, ConfigError
from visiontrain.data.samplers import follows_split
from visiontrain.rundir import checkpoint_format as fmt


@dataclass(frozen=True)
class BatchSplit:
    """How a global batch is made: per-process batch x processes x micro-batches per step."""
    batch_size: int
    world_size: int
    accum_steps: int

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size * self.accum_steps

    def words(self) -> str:
        return (f"data.batch_size={self.batch_size} on {_processes(self.world_size)} x "
                f"trainer.accum_steps={self.accum_steps}")


def _processes(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


@dataclass(frozen=True)
class Follows:
    """How a data source may follow another number of processes (``data.samplers.follows_split``):
    its ``follows_world_size``, and the processes a canonical (shards') order is cut for."""
    kind: str
    order_processes: int | None = None

    def allows(self, was: BatchSplit, now: BatchSplit) -> bool:
        return follows_split(self.kind, astuple(was), astuple(now), self.order_processes)


def written_split(checkpoint: dict[str, Any]) -> tuple[BatchSplit, Follows] | None:
    """The split a checkpoint was written with, and how its data source may follow another number of
    processes; None for a checkpoint whose source records no batch size (a task's own source)."""
    data = fmt.entry(checkpoint, fmt.DATA) or {}
    if "batch_size" not in data:
        return None
    trainer = (fmt.config_of(checkpoint) or {}).get("trainer") or {}
    accum = data.get("accum_steps") or trainer.get("accum_steps") or 1
    split = BatchSplit(int(data["batch_size"]), int(data.get("world_size") or 1), int(accum))
    return split, Follows(str(data.get("follows_world_size", "none")), data.get("order_processes"))


def keep_global_batch_on_resume(cfg: Config, source: str | None, world_size: int) -> tuple[Config, str | None]:
    """:func:`keep_global_batch` for the checkpoint at ``source`` (None: a fresh run, ``cfg`` as it is)."""
    if source is None:
        return cfg, None
    from visiontrain.engine.state.checkpoint import load_checkpoint

    return keep_global_batch(cfg, load_checkpoint(source, resolve_sharded=False, mmap=True), world_size)


def keep_global_batch(cfg: Config, checkpoint: dict[str, Any], world_size: int) -> tuple[Config, str | None]:
    """``cfg`` with the per-process batch and accumulation that keep the checkpoint's global batch on
    ``world_size`` processes, and the line that says what changed (None: nothing to say). Raises
    ConfigError, naming the process counts that would work, where no split keeps it."""
    written = written_split(checkpoint)
    if written is None:
        return cfg, None
    was, follows = written
    asked = BatchSplit(cfg.data.batch_size, world_size, cfg.trainer.accum_steps)
    if asked == was or follows.kind == "none" or not _same_data_and_task(cfg, checkpoint):
        return cfg, None  # shards, or another run's checkpoint: the checks that follow refuse in their own words
    where = f"resumed on {_processes(world_size)}" + \
        (f" (written on {was.world_size})" if world_size != was.world_size else "")
    two_phases = cfg.trainer.accum_after_epoch > 0
    if asked in _splits(was, world_size, follows, two_phases):
        return cfg, f"{where}: global batch {was.global_batch} kept ({asked.words()})"
    chosen = _choose(was, asked, follows, two_phases)
    if chosen is None:
        raise ConfigError(_refusal(was, world_size, follows, two_phases))
    new = copy.copy(cfg)
    new.data = dataclasses.replace(cfg.data, batch_size=chosen.batch_size)
    new.trainer = dataclasses.replace(cfg.trainer, accum_steps=chosen.accum_steps)
    changes = [f"{key} {before} -> {after}" for key, before, after in (
        ("data.batch_size", asked.batch_size, chosen.batch_size),
        ("trainer.accum_steps", asked.accum_steps, chosen.accum_steps)) if before != after]
    return new, f"{where}: {', '.join(changes)}: global batch {was.global_batch} kept"


def _same_data_and_task(cfg: Config, checkpoint: dict[str, Any]) -> bool:
    """Whether the checkpoint is of this task on this dataset: a split is only planned for the run
    it continues (another task or dataset is refused by the resume's own checks, naming what differs)."""
    theirs = fmt.config_of(checkpoint) or {}
    return all((theirs.get(section) or {}).get("name") == getattr(cfg, section).name for section in ("task", "data"))


def _splits(was: BatchSplit, world_size: int, follows: Follows, two_phases: bool) -> list[BatchSplit]:
    """Every (per-process batch, accumulation) that makes ``was``'s global batch on ``world_size``
    processes, as the data source and the accumulation schedule allow."""
    per_process, rest = divmod(was.global_batch, world_size)
    if rest:
        return []
    splits = [BatchSplit(b, world_size, per_process // b) for b in range(1, per_process + 1) if per_process % b == 0
              and follows.allows(was, BatchSplit(b, world_size, per_process // b))]
    if two_phases:  # before accumulation starts a step is one micro-batch: the accumulation stays
        splits = [s for s in splits if s.accum_steps == was.accum_steps]
    return splits


def _choose(was: BatchSplit, asked: BatchSplit, follows: Follows, two_phases: bool) -> BatchSplit | None:
    """The largest per-process batch not above the configured one; else the smallest above it."""
    splits = _splits(was, asked.world_size, follows, two_phases)
    fitting = [s for s in splits if s.batch_size <= asked.batch_size]
    if fitting:
        return max(fitting, key=lambda s: s.batch_size)
    return min(splits, key=lambda s: s.batch_size) if splits else None


def _refusal(was: BatchSplit, world_size: int, follows: Follows, two_phases: bool) -> str:
    workable = [w for w in range(1, was.global_batch + 1) if _splits(was, w, follows, two_phases)]
    why = {"accumulation": "its batches are grouped by aspect ratio, so the per-process batch stays "
                           f"{was.batch_size} and only trainer.accum_steps may change",
           "canonical": f"its shards' order is cut for {follows.order_processes} processes "
                        f"(data.order_processes), so the processes must divide it and trainer.accum_steps stays "
                        f"{was.accum_steps}"}.get(follows.kind, "")
    if two_phases:
        why = (why + "; " if why else "") + "trainer.accum_after_epoch is set, so trainer.accum_steps stays " \
                                             f"{was.accum_steps} and only data.batch_size may change"
    shown = ", ".join(map(str, workable[:12])) + (", ..." if len(workable) > 12 else "")
    return (f"resume on {_processes(world_size)}: the checkpoint trained with a global batch of {was.global_batch} "
            f"({was.words()}), which {_processes(world_size)} cannot make{': ' + why if why else ''}. Resume on "
            f"{shown} processes, or start a new run from its weights with --init")
