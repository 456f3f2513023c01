"""Exact resume, checked: the weights (and EMA) of a run, compared bit for bit, and a run fitted
straight against the same run killed part-way and resumed from its last.pt."""
from __future__ import annotations

import pytest
import torch

from crashes import Crash, CrashAt
from visiontrain.core import config as C
from visiontrain.engine.loop.trainer import Trainer
from visiontrain.tasks import build_task


def state_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in trainer.raw_model.state_dict().items()}
    out.update({f"ema.{k}": v for k, v in trainer.ema.module.state_dict().items()} if trainer.ema else {})
    return out


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ after resume: {different[:5]}"


def fit_and_crash_resume(cfg: C.Config, base, crash_at: int, position: tuple[int, int, int] | None = None
                         ) -> tuple[Trainer, Trainer]:
    """(a run fitted to the end, a run killed at ``crash_at`` then resumed from its last.pt to the
    end); ``position``: the (step, epoch, step_in_epoch) the resumed run must start from."""
    full = Trainer(cfg, build_task(cfg), base / "full")
    full.fit()
    crashed = Trainer(cfg, build_task(cfg), base / "crashed", hooks=[CrashAt(crash_at)])
    with pytest.raises(Crash):
        crashed.fit()
    resumed = Trainer(cfg, build_task(cfg), base / "crashed", resume=str(base / "crashed" / "checkpoints" / "last.pt"))
    assert (resumed.step, resumed.epoch, resumed.step_in_epoch) == (position or (crash_at, resumed.epoch,
                                                                                resumed.step_in_epoch))
    resumed.fit()
    return full, resumed
