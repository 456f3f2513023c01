"""``visiontrain benchmark RECIPE [k=v ...]``: time N training steps of a recipe.

It runs the real trainer on the recipe's data (or, with ``--synthetic``, on its first batch
replayed every step, so data loading drops out), after a few warm-up steps. It reports samples/s,
how a step's time splits between waiting for the next batch and computing, and the peak memory
(device memory on a GPU, the process's peak resident memory on the CPU). Nothing is written: no
run dir, no evaluation, no checkpoint.

The steps are the run's first ones, as `fit` trains them: its schedules keep the recipe's run length,
so the lr warms up as in the run. A step's cost can depend on it: a detector trained at the full lr
from step 1 diverged within a few steps, and its R-CNN heads, given no sensible proposals, then
cost a third less than the run's (BENCHMARKS.md, "benchmark against fit"). What it leaves out of a
run: evaluations, checkpoints and the log points' writes (but for an epoch's end inside the window,
which logs as in `fit`).
"""
from __future__ import annotations

import contextlib
import resource
import time
from typing import Any

import torch

from visiontrain.core.config import Config
from visiontrain.engine.loop.trainer import Trainer, next_micro_batches
from visiontrain.engine.protocols.hooks import Hook
from visiontrain.engine.protocols.task import Task
from visiontrain.engine.step.accumulation import samples_per_step


class _Done(Exception):
    """Ends the run after the last timed step (no final evaluation or checkpoint)."""


class _StepTimer(Hook):
    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.last = warmup, warmup + steps
        self.t0 = self.t1 = 0.0
        self.data_s = 0.0
        self.timing = False

    def _sync(self) -> None:
        if self.trainer.device.type == "cuda":
            torch.cuda.synchronize(self.trainer.device)  # host sync: the window's two ends only

    def before_step(self) -> None:
        if self.trainer.step == self.warmup:
            self._sync()
            if self.trainer.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.trainer.device)
            self.t0, self.timing = time.perf_counter(), True

    def after_step(self) -> None:
        if self.trainer.step == self.last:
            self._sync()
            self.t1 = time.perf_counter()
            raise _Done


def run_benchmark(cfg: Config, task: Task, *, steps: int, warmup: int, synthetic: bool,
                  hooks: list[Hook] = (), init: str | None = None) -> dict[str, Any]:
    """``hooks``: more of the run's hooks (e.g. a profiler over chosen steps). ``init``: weights to
    start from (``fit --init``): a detector's step costs more once it is trained (its heads run on
    the proposals that match a box, few at initialisation)."""
    # no log point inside the window but an epoch's end
    cfg.trainer.log_every = max(cfg.trainer.log_every, warmup + steps)
    cfg.eval.every = cfg.checkpoint.every = 0
    cfg.eval.at_start = cfg.trainer.profile = False
    timer, first = _StepTimer(warmup, steps), []

    def timed_fetch(batches: Any, accum: int) -> list[Any]:
        if synthetic and first:
            return first[0]  # the first batch again: no loading
        t = time.perf_counter()
        micro = next_micro_batches(batches, accum)
        if timer.timing:
            timer.data_s += time.perf_counter() - t
        if synthetic:
            first.append(micro)
        return micro

    trainer = Trainer(cfg, task, None, hooks=[*hooks, timer], fetch=timed_fetch, init=init)  # the timer ends it
    with contextlib.suppress(_Done):  # the window's last step ends the run: no final evaluation
        trainer.fit()
        raise ValueError(f"the run has fewer than {warmup + steps} steps (--warmup + --steps): raise "
                         "trainer.epochs or trainer.max_steps")
    wall = timer.t1 - timer.t0
    t, d = cfg.trainer, cfg.data
    samples = steps * samples_per_step(cfg, trainer.dist.world_size)
    if trainer.device.type == "cuda":
        memory = {"peak_device_mib": torch.cuda.max_memory_allocated(trainer.device) / 2**20}
    else:
        memory = {"peak_host_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    return {"steps": steps, "warmup": warmup, "synthetic": synthetic, "device": str(trainer.device),
            "batch_size": d.batch_size, "accum_steps": t.accum_steps,
            "precision": trainer.run.precision.precision,
            "samples_per_s": samples / wall, "step_ms": 1e3 * wall / steps,
            "data_wait_ms": 1e3 * timer.data_s / steps, "compute_ms": 1e3 * (wall - timer.data_s) / steps,
            **{k: round(v, 1) for k, v in memory.items()}}


def format_report(recipe: str, r: dict[str, Any]) -> str:
    share = 100.0 * r["data_wait_ms"] / max(r["step_ms"], 1e-9)
    memory = ", ".join(f"{v:.0f} MiB {k.removeprefix('peak_').removesuffix('_mib').replace('_', ' ')}"
                       for k, v in r.items() if k.startswith("peak_"))
    return "\n".join([
        f"visiontrain benchmark {recipe}: {r['steps']} steps after {r['warmup']} warm-up, batch {r['batch_size']}"
        f" x {r['accum_steps']} accumulation, {r['precision']}, {r['device']}"
        f"{', synthetic data (the first batch replayed)' if r['synthetic'] else ''}",
        f"  samples/s    {r['samples_per_s']:.1f}",
        f"  step         {r['step_ms']:.2f} ms = data wait {r['data_wait_ms']:.2f} ms ({share:.0f} %)"
        f" + compute {r['compute_ms']:.2f} ms",
        f"  peak memory  {memory}",
    ])
