"""A run interrupted mid-epoch under checkpoint format 1 (commit 22eb1c6), kept as a fixture.

``tests/fixtures/format1/`` holds what this script wrote when it ran on that commit's source:
``last.pt``, the checkpoint the interrupted run left at step ``CHECKPOINT_AT`` (mid-epoch 1), and
``final.pt``, the uninterrupted run's final model and EMA weights, both made on a CPU with AVX-512.
``tests/rundir/test_checkpoint_format.py`` resumes the first with today's code and compares its end with the
second within float rounding (today's run computes on whatever CPU runs the suite). Its bit-exact check
makes the same two runs now, on the machine that runs it, and resumes a format-1 copy of the cut run's
checkpoint (:func:`straight_and_cut`).

The toy task with every kind of state a checkpoint holds: AdamW moments, an EMA, a cosine lr with
warmup, dropout and random noise in the data (the RNG streams and the batch seeds), a task state
(the scripted metric's count), the log point's unread rows and epoch means, best-k records and an
early-stopping record. To make it again, from a checkout of the commit that writes format 1::

    OMP_NUM_THREADS=1 PYTHONPATH=OLD_CHECKOUT/src python tests/support/format1_run.py tests/fixtures/format1
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

#: The run: 256 samples in batches of 16 = 16 steps an epoch, 3 epochs; last.pt every 6 steps.
OVERRIDES: dict[str, Any] = dict(
    data__batch_size=16, trainer__epochs=3, trainer__log_every=5, optim__name="adamw", optim__lr=0.01,
    schedules__lr={"shape": "cosine", "warmup": 4}, ema__enabled=True, ema__decay=0.9, task__noise=True,
    task__dropout=0.2, task__scripted=[3.0, 2.0, 2.5], eval__patience=5, checkpoint__every=6,
    checkpoint__unit="steps", checkpoint__keep_best=2)
#: The interrupted run dies as step 27 starts; its last.pt is the one of step 24 (epoch 1, its 9th step).
CRASH_AT, CHECKPOINT_AT = 27, 24
TOTAL_STEPS = 48


def final_weights(trainer: Any) -> dict[str, dict[str, torch.Tensor]]:
    return {"model": trainer.raw_model.state_dict(), "ema": trainer.ema.module.state_dict()}


def straight_and_cut(tmp: Path) -> tuple[dict[str, dict[str, torch.Tensor]], Path]:
    """The run made twice under the code imported: straight through (its final weights), and killed
    as step ``CRASH_AT`` starts (the path of the last.pt it left, that of step ``CHECKPOINT_AT``)."""
    from toy_task import ToyTask, toy_config
    from visiontrain.engine.loop.trainer import Trainer
    from visiontrain.engine.protocols.hooks import Hook

    class Crash(Exception):
        pass

    class CrashAt(Hook):
        def before_step(self) -> None:
            if self.trainer.step == CRASH_AT:
                raise Crash()

    torch.set_num_threads(1)
    cfg = toy_config(**OVERRIDES)
    full = Trainer(cfg, ToyTask(cfg), tmp / "full")
    full.fit()
    assert full.step == TOTAL_STEPS
    cut = Trainer(cfg, ToyTask(cfg), tmp / "cut", hooks=[CrashAt()])
    try:
        cut.fit()
    except Crash:
        pass
    return final_weights(full), tmp / "cut" / "checkpoints" / "last.pt"


def make(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        final, last = straight_and_cut(Path(tmp))
        torch.save(final, out / "final.pt")
        shutil.copy(last, out / "last.pt")
    assert torch.load(out / "last.pt", weights_only=True)["progress"]["step"] == CHECKPOINT_AT


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    make(Path(sys.argv[1]))
