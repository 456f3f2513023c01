"""The rules of accumulation and the step clock: how many micro-batches an optimizer step takes in
an epoch, how many samples it trains on, and how many steps the run has."""
from __future__ import annotations

from visiontrain.core.config import Config
from visiontrain.engine.optim.schedules import StepClock
from visiontrain.engine.step.trainer_config import TrainerConfig


def accum_steps_at(t: TrainerConfig, epoch: int) -> int:
    """Micro-batches per optimizer step in ``epoch``: ``trainer.accum_steps`` from
    ``trainer.accum_after_epoch`` on (0: from the start), one before."""
    return t.accum_steps if epoch >= t.accum_after_epoch else 1


def samples_per_step(cfg: Config, world_size: int, epoch: int | None = None) -> int:
    """The samples one optimizer step trains on, over every process (the global batch): in ``epoch``,
    or (None) once accumulation is on."""
    accum = cfg.trainer.accum_steps if epoch is None else accum_steps_at(cfg.trainer, epoch)
    return cfg.data.batch_size * world_size * accum


def make_clock(cfg: Config, batches_per_epoch: int) -> StepClock:
    """Optimizer steps per epoch (before / after accumulation switches on) and the run's total."""
    t = cfg.trainer
    accum_from = t.accum_after_epoch if t.accum_steps > 1 and t.accum_after_epoch > 0 else 0
    first = batches_per_epoch // accum_steps_at(t, 0)
    after = batches_per_epoch // t.accum_steps
    if after == 0:
        raise ValueError(f"trainer.accum_steps={t.accum_steps} exceeds the {batches_per_epoch} "
                         f"batches of an epoch")
    total = first * min(accum_from, t.epochs) + after * max(0, t.epochs - accum_from) if accum_from \
        else first * t.epochs
    if t.max_steps is not None:
        total = min(total, t.max_steps)
    if accum_from and accum_from < t.epochs:
        return StepClock(first, total, change_epoch=accum_from, steps_per_epoch_after=after)
    return StepClock(first, total)
