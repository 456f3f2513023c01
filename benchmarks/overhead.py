"""Per-step overhead of the engine against a hand-written loop (and Lightning, if installed).

Same tiny MLP (64 -> 128 -> 10), same in-memory data, batch 32, fused AdamW, 1 thread, CPU; the
engine logs every 50 steps (the hand-written loop reads its loss every 50 steps too). Runs
alternate in one process (raw, raw-zero-after, engine, engine-skip, lightning, then the same
order rotated by one each repeat) so machine load hits all alike. A run's figure is the time per
step of its training loop only (set-up and the final evaluation excluded, data loading
included); each ratio is the median over repeats of that repeat's own ratio to the hand-written
loop.

    python benchmarks/overhead.py [--steps 3000] [--repeats 21]

prints one line per run and then `ratio engine/raw: X` (the default `trainer.nonfinite=raise`; in
brackets the ratio of the two runners' fastest runs, the least disturbed by other load), the
same with `nonfinite=skip` (which masks every update on the device), the hand-written loop with
its gradients cleared after the step (the engine's order) and the engine against that, and
`ratio lightning/raw: Y`; with --breakdown, also the engine's parts (its loader alone, the
trainer around a no-op step, and TrainStep called from a bare loop) to set against the raw
loop's time.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from visiontrain.core import config as C  # noqa: E402
from visiontrain.core._tv_compat import ensure_torchvision  # noqa: E402
from visiontrain.core.config import doc
from visiontrain.engine.loop.trainer import Trainer  # noqa: E402
from visiontrain.engine.protocols.hooks import Hook  # noqa: E402
from visiontrain.engine.protocols.task import Task, TaskData, register_task  # noqa: E402
from visiontrain.engine.protocols.task import TaskConfig
from visiontrain.engine.step.eval_loop import EvalData  # noqa: E402

BATCH, IN, HIDDEN, OUT, SAMPLES, LR = 32, 64, 128, 10, 3200, 1e-3


def make_data(seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(SAMPLES, IN, generator=g), torch.randint(0, OUT, (SAMPLES,), generator=g))


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def raw_loop(steps: int, zero_after_step: bool = False) -> float:
    """The loop as DETR's and most tutorials' is written: gradients cleared just before backward.
    ``zero_after_step`` clears them after the step instead, as the engine does."""
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    loader = DataLoader(make_data(), batch_size=BATCH, shuffle=True, drop_last=True)
    step, t0 = 0, time.perf_counter()
    while step < steps:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            if not zero_after_step:
                opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if zero_after_step:
                opt.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0:
                loss.item()  # the hand-written loop's log read
            if step == steps:
                break
    return (time.perf_counter() - t0) / steps


@dataclass
class MlpConfig(TaskConfig):
    name: str = doc("task name", "bench-mlp")


class MlpTask(Task):
    name = "bench-mlp"
    default_loss_weights = {"ce": 1.0}
    metric, mode = "", "max"

    def build_data(self) -> TaskData:
        return TaskData(make_data(), make_data(1), {}, random_transforms=False)

    def build_model(self, info: dict[str, Any]) -> nn.Module:
        return make_model()

    def losses(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        return {"ce": F.cross_entropy(model(x), y)}

    def evaluate(self, model: nn.Module, data: EvalData) -> dict[str, float]:
        return {}


register_task("bench-mlp", MlpTask, MlpConfig)


class LoopTimer(Hook):
    def before_train(self) -> None:
        self.t0 = time.perf_counter()

    def after_step(self) -> None:
        self.t1 = time.perf_counter()


def engine_loop(steps: int, nonfinite: str = "raise") -> float:
    cfg = C.config_from_dict({
        "task": {"name": "bench-mlp"}, "data": {"batch_size": BATCH},
        "optim": {"name": "adamw", "lr": LR, "no_decay_bias_norm": False},
        # summary off: the start-up's parameter and FLOP count, as Lightning's enable_model_summary=False
        "trainer": {"epochs": 10**6, "max_steps": steps, "log_every": 50, "progress": "plain",
                    "nonfinite": nonfinite, "summary": False,
                    # the hand-written loop is fp32; precision auto would pick bf16 on a CPU with native bf16
                    "precision": "fp32"},
        "eval": {"every": 0}, "checkpoint": {"every": 0}})
    torch.manual_seed(0)
    timer = LoopTimer()
    Trainer(cfg, MlpTask(cfg), None, hooks=[timer]).fit()
    return (timer.t1 - timer.t0) / steps


def lightning_loop(steps: int) -> float | None:
    try:
        import lightning as L
    except ImportError:
        return None

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = make_model()

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self.model(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR, fused=True)

    class Timer(L.Callback):
        def on_train_start(self, *a: Any) -> None:
            self.t0 = time.perf_counter()

        def on_train_end(self, *a: Any) -> None:
            self.t1 = time.perf_counter()

    torch.manual_seed(0)
    timer = Timer()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=50,
                        callbacks=[timer])
    loader = DataLoader(make_data(), batch_size=BATCH, shuffle=True, drop_last=True)
    trainer.fit(Module(), loader)
    return (timer.t1 - timer.t0) / steps


def engine_parts(steps: int) -> dict[str, float]:
    """Where the engine's cost goes (--breakdown), each µs/step: the engine's loader alone; the
    trainer around a step that does nothing; TrainStep called straight from a bare loop."""
    from visiontrain.engine.step.pipeline import TrainStep

    class NoopStep(TrainStep):
        def __call__(self, batches: Any, weights: Any) -> None:
            self.recorder.record(["total"], [self._one])

    def trainer(steps: int, hooks: list[Hook] = (), step_type: type[TrainStep] = TrainStep) -> Trainer:
        cfg = C.config_from_dict({
            "task": {"name": "bench-mlp"}, "data": {"batch_size": BATCH},
            "optim": {"name": "adamw", "lr": LR, "no_decay_bias_norm": False},
            "trainer": {"epochs": 10**6, "max_steps": steps, "log_every": 50, "progress": "plain", "summary": False},
            "eval": {"every": 0}, "checkpoint": {"every": 0}})
        torch.manual_seed(0)
        return Trainer(cfg, MlpTask(cfg), None, hooks=list(hooks), step_type=step_type)

    tr, t0, n = trainer(steps), time.perf_counter(), 0
    while n < steps:
        for _ in tr.run.source.batches(0):
            n += 1
            if n == steps:
                break
    parts = {"loader_only": (time.perf_counter() - t0) / steps}

    timer = LoopTimer()
    trainer(steps, [timer], NoopStep).fit()
    parts["trainer_with_noop_step"] = (timer.t1 - timer.t0) / steps

    tr = trainer(steps)
    t0, n, epoch = time.perf_counter(), 0, 0
    while n < steps:
        epoch += 1
        for batch in tr.run.source.batches(epoch - 1):
            tr.step_fn([batch], tr.loss_weights)
            n += 1
            if n % 50 == 0:
                tr.step_fn.recorder.read()
            if n == steps:
                break
    parts["bare_loop_calling_trainstep"] = (time.perf_counter() - t0) / steps
    return parts


def main() -> int:
    ensure_torchvision()  # Lightning imports torchmetrics, which imports torchvision
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument("--breakdown", action="store_true", help="also time the engine's parts (see engine_parts)")
    args = p.parse_args()
    torch.set_num_threads(1)
    runners = {"raw": raw_loop, "raw-zero-after": lambda n: raw_loop(n, zero_after_step=True), "engine": engine_loop,
               "engine-skip": lambda n: engine_loop(n, "skip"), "lightning": lightning_loop}
    for fn in runners.values():  # warm-up: first-call costs (imports, allocator) out of the figures
        fn(200)
    times: dict[str, list[float]] = {k: [] for k in runners}
    names = list(runners)
    for r in range(args.repeats):
        # the order rotates every repeat, so no runner always follows the same one (cache, clock)
        for name in names[r % len(names):] + names[:r % len(names)]:
            gc.collect()  # a full collection pending from set-up would land in one run's timing
            t = runners[name](args.steps)
            if t is not None:
                times[name].append(t)
                print(f"repeat {r} {name:<11} {t * 1e6:8.1f} us/step", flush=True)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    print(f"median us/step: " + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in med.items()))

    def paired(name: str) -> float:
        """The median over repeats of each repeat's own ratio: load that drifts between repeats
        cancels out of a ratio taken within one repeat."""
        return statistics.median(a / b for a, b in zip(times[name], times["raw"]))

    print(f"ratio engine/raw: {paired('engine'):.3f} (fastest runs: {min(times['engine']) / min(times['raw']):.3f})")
    print(f"ratio engine(nonfinite=skip)/raw: {paired('engine-skip'):.3f}")
    print(f"ratio raw(zero_grad after the step)/raw: {paired('raw-zero-after'):.3f}; "
          f"engine/that: {statistics.median(a / b for a, b in zip(times['engine'], times['raw-zero-after'])):.3f}")
    if "lightning" in med:
        print(f"ratio lightning/raw: {paired('lightning'):.3f}")
    else:
        print("lightning not installed: no lightning ratio")
    if args.breakdown:
        parts: dict[str, list[float]] = {}
        for _ in range(args.repeats):
            for k, v in engine_parts(args.steps).items():
                parts.setdefault(k, []).append(v)
        print("breakdown, median us/step: " + ", ".join(f"{k} {statistics.median(v) * 1e6:.1f}"
                                                        for k, v in parts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
