"""A tiny task for engine tests: an MLP (without batch norm unless asked) regressing random data.

It exercises the engine exactly like a real task does, and can poison a chosen step's loss with
NaN (``poison_step``) to test the non-finite policy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from visiontrain.core import config as C
from visiontrain.core.config import doc
from visiontrain.engine.loop.trainer import Trainer
from visiontrain.engine.protocols.task import Task, TaskConfig, TaskData, register_task
from visiontrain.engine.step.eval_loop import EvalData


@dataclass
class ToyConfig(TaskConfig):
    name: str = doc("task name", "toy")
    samples: int = doc("dataset size", 256)
    dim: int = doc("input dimension", 16)
    hidden: int = doc("hidden width", 32)
    noise: bool = doc("add random noise to each sample (a random transform)", False)
    dropout: float = doc("dropout in the MLP", 0.0)
    batchnorm: bool = doc("a BatchNorm1d after the hidden layer: a forward that depends on the whole batch", False)
    poison_step: int = doc("step index whose loss becomes NaN (-1 = never)", -1)
    poison_sample: int = doc("training sample whose input is NaN: a poisoned batch (-1 = none)", -1)
    scripted: list[float] = doc("evaluation: also report these values as `scripted`, one per evaluation "
                                "(the last repeats); a metric whose course a test chooses", factory=list)


class ToyData(Dataset):
    def __init__(self, n: int, dim: int, noise: bool, seed: int, poison: int = -1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x @ torch.randn(dim, 1, generator=g) + 0.1
        if poison >= 0:
            self.x[poison] = float("nan")
        self.noise = noise

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        x = self.x[i]
        if self.noise:
            x = x + 0.01 * torch.randn_like(x)
        return x, self.y[i], torch.tensor(i)


class ToyTask(Task):
    name = "toy"
    default_loss_weights = {"mse": 1.0, "l1": 0.5}
    metric, mode = "mse", "min"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.calls = 0
        self.evaluations = 0  # task state: a resumed run goes on with the script where it was

    def build_data(self) -> TaskData:
        t = self.cfg.task
        return TaskData(ToyData(t.samples, t.dim, t.noise, 1, t.poison_sample), ToyData(64, t.dim, False, 2),
                        {"dim": t.dim},
                        random_transforms=t.noise)

    def build_model(self, info: dict[str, Any]) -> nn.Module:
        t = self.cfg.task
        norm = [nn.BatchNorm1d(t.hidden)] if t.batchnorm else []
        return nn.Sequential(nn.Linear(info["dim"], t.hidden), *norm, nn.ReLU(), nn.Dropout(t.dropout),
                             nn.Linear(t.hidden, 1))

    def losses(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        x, y, _ = batch
        out = model(x).float()
        mse = F.mse_loss(out, y)
        if self.calls == self.cfg.task.poison_step:
            mse = mse * float("nan")
        self.calls += torch.is_grad_enabled()  # training steps only (the first look's FLOP count runs no_grad)
        return {"mse": mse, "l1": F.l1_loss(out, y), "mean_out": out.detach().mean()}

    def evaluate(self, model: nn.Module, data: EvalData) -> dict[str, float]:
        total, n = torch.zeros((), device=data.device), 0
        for (x, y, _), _real in data:  # this rank's batches as they come, padding repeats included
            total += F.mse_loss(model(x).float(), y, reduction="sum")
            n += len(x)
        metrics = {"mse": total.item() / n}  # host sync (end of evaluation)
        script = self.cfg.task.scripted
        if script:
            metrics["scripted"] = script[min(self.evaluations, len(script) - 1)]
        self.evaluations += 1
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {"evaluations": self.evaluations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.evaluations = state["evaluations"]


register_task("toy", ToyTask, ToyConfig)


def toy_config(**overrides: Any) -> C.Config:
    tree: dict = {"task": {"name": "toy"}, "data": {"batch_size": 32},
                  "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
                  # fp32, not auto: the engine's tests compute the same on a CPU with native bf16 and without.
                  # No plots: drawing them costs about 2 s of CPU a run; the tests of plots ask for them.
                  "trainer": {"epochs": 2, "log_every": 4, "progress": "plain", "precision": "fp32",
                              "plots": False},
                  "eval": {"every": 1}, "checkpoint": {"every": 1}}
    for key, value in overrides.items():
        C._set_dotted(tree, key.replace("__", "."), value)
    return C.config_from_dict(tree)


def train(cfg: C.Config, run_dir: Any = None, **kwargs: Any) -> Trainer:
    trainer = Trainer(cfg, ToyTask(cfg), run_dir, **kwargs)
    trainer.fit()
    return trainer
