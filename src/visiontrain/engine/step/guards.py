"""What the engine does when training goes wrong: non-finite values, and running out of memory.

The step never reads a device value (``engine.step.pipeline``); the trainer reads each step's recorded row
at the next log point, evaluation or checkpoint and hands the rows here. Before anything is
written the weights themselves are checked too: a NaN that reached the weights through a finite
loss and an unchecked gradient (``raise`` computes no gradient norm) still never lands in a
checkpoint.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from visiontrain.engine.parallel.fsdp import local
from visiontrain.engine.step.metrics import Rows
from visiontrain.rundir.run_files import LAST_CHECKPOINT


class NonFiniteLossError(FloatingPointError):
    """A loss, gradient or weight became NaN/Inf under ``trainer.nonfinite=raise``."""


class OutOfMemory(RuntimeError):
    """The device (or host) ran out of memory; the message says which setting to lower."""


ADVICE = ("Lower optim.lr, enable trainer.clip_grad, or set trainer.nonfinite=skip to skip such "
          "steps and go on.")


def saved_before(ckpt_dir: Path | None) -> str:
    """What the run dir holds from before a bad step, true in every case: nothing is ever written
    after one (the rows and the weights are checked before each write), but a run stopped before
    its first checkpoint has none to go back to."""
    if ckpt_dir is None:
        return "nor before it: this run has no run dir"
    if not (ckpt_dir / LAST_CHECKPOINT).exists():
        return "nor before it: there is no checkpoints/last.pt yet"
    return "checkpoints/last.pt is from before it"


def check_rows(read: Rows, first_step: int, *, policy: str, fp16: bool,
               epoch_of: Callable[[int], int], ckpt_dir: Path | None = None) -> tuple[int, int]:
    """(skipped, fp16-overflow) counts of the read rows (steps first_step, first_step + 1, ...).
    Under ``raise`` the first bad row raises, naming the step, the epoch, every logged term and
    what ``ckpt_dir`` holds to go back to."""
    if not read.rows:
        return 0, 0
    total_at = read.names.index("total")
    norm_at = read.names.index("grad_norm") if "grad_norm" in read.names else None
    skipped = overflow = 0
    isfinite = math.isfinite
    for i, (row, flag) in enumerate(zip(read.rows, read.flags)):
        flagged = flag != 0.0  # set on the device when `skip` (or fp16) skipped the step
        loss_ok = isfinite(row[total_at])
        grads_ok = (norm_at is None or isfinite(row[norm_at])) and not (flagged and loss_ok)
        if loss_ok and grads_ok:
            continue
        if loss_ok and fp16:
            overflow += 1  # fp16 overflow: skipped on the device, the scaler lowers its scale
            continue
        skipped += 1
        if policy == "raise":
            step = first_step + i
            what = "loss" if not loss_ok else "gradient norm"
            named = dict(zip(read.names, row))
            bad = [k for k, v in named.items() if not isfinite(v)]
            detail = ", ".join(f"{k}={v:.6g}" for k, v in named.items())
            raise NonFiniteLossError(
                f"non-finite {what} at step {step} (epoch {epoch_of(step - 1)}) in {', '.join(bad)}: {detail}. "
                f"No checkpoint was written after that step ({saved_before(ckpt_dir)}). {ADVICE}")
    return skipped, overflow


@torch.no_grad()
def check_weights(modules: list[nn.Module], step: int, last_checked: int, *, reduce: bool = False,
                  ckpt_dir: Path | None = None) -> None:
    """Raise if any parameter or buffer is NaN/Inf. One pass over the weights and one host read:
    paid at checkpoints only. ``reduce``: FSDP, where each rank holds a shard of every weight."""
    tensors = [local(t) for m in modules for t in (*m.parameters(), *m.buffers()) if t.is_floating_point()]
    if not tensors:
        return
    bad = torch.stack([torch.logical_not(torch.isfinite(n)) for n in torch._foreach_norm(tensors)]).any().float()
    if reduce:
        dist.all_reduce(bad)
    if bad.item():  # host sync (checkpoint)
        names = [n for m in modules for n, t in (*m.named_parameters(), *m.named_buffers())
                 if t.is_floating_point() and not bool(torch.isfinite(local(t)).all())]
        raise NonFiniteLossError(
            f"the weights became non-finite between step {last_checked} and step {step} although every "
            f"logged loss was finite ({', '.join(names[:5]) or 'on another rank'}); nothing was written at "
            f"step {step} ({saved_before(ckpt_dir)}). {ADVICE}")


def is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(err, RuntimeError) and "can't allocate memory" in str(err))


def out_of_memory_message(err: BaseException, *, phase: str, run: Any, step: int) -> str:
    """Names the batch size in use and what to lower, in the order that usually helps most. ``run``:
    the run's ``cfg``, ``device``, resolved ``precision`` and ``ckpt_dir`` (``engine.setup.training``)."""
    cfg, device = run.cfg, run.device
    d, t = cfg.data, cfg.trainer
    first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
    if phase == "evaluation":
        size = d.eval_batch()
        todo = f"lower data.eval_batch_size (now {size} per process)"
    else:
        todo = (f"lower data.batch_size (now {d.batch_size} per process) and raise trainer.accum_steps "
                f"(now {t.accum_steps}) by the same factor to keep the global batch and the lr")
        if lower := run.precision.lower_to_try():  # what the run computes in, not what it asked for
            todo += f", or set trainer.precision={lower}"
        if getattr(cfg.distributed, "strategy", "ddp") == "ddp":
            todo += ", or with several GPUs shard the model (distributed.strategy=fsdp)"
    last = run.ckpt_dir / LAST_CHECKPOINT if run.ckpt_dir is not None else None
    saved = f"The last checkpoint, {last}, is intact; continue with --resume auto." \
        if last is not None and last.is_file() else "No checkpoint was written yet."
    return f"out of memory on {device} during {phase} at step {step}: {first}. To fit, {todo}. {saved}"
