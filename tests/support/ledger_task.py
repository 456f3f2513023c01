"""A task that writes down what it trains on: the ledger of a run resumed on other numbers of processes.

Each training sample draws one random number, its augmentation (``draw``: it scales the sample's
input, so it moves the loss), from torch's RNG as the data loader seeds it. After every optimizer
step each process appends one line to ``task.ledger``/``<pid>.jsonl``: its launch, the step, the
epoch, its rank and the (sample index, draw) of every sample it trained on in that step, flushed at
once, so a process killed with SIGKILL leaves every step it finished written. ``read_ledger`` puts the files
of a chain of runs together, leaving out the steps a resume trained again.

A user would write this task the same way (``visiontrain --import ledger_task.py fit ...``): every
rank imports it.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from visiontrain.core.config import doc
from visiontrain.engine.protocols.hooks import Hook
from visiontrain.engine.protocols.task import Task, TaskConfig, TaskData, register_task
from visiontrain.engine.step.eval_loop import EvalData


@dataclass
class LedgerConfig(TaskConfig):
    name: str = doc("task name", "ledger")
    samples: int = doc("training samples", 48)
    ledger: str = doc("directory the ledger files go to", "ledger")
    step_sleep: float = doc("seconds each training micro-batch waits (so that a kill lands mid-run)", 0.0)


class Draws(Dataset):
    """``(x * (1 + draw), y, index, draw)``: a fixed regression problem with one random draw a sample."""

    def __init__(self, n: int, seed: int, augment: bool) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x @ torch.randn(8, 1, generator=g)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> Any:
        draw = torch.rand(()) if self.augment else torch.zeros(())
        return self.x[i] * (1 + draw), self.y[i], torch.tensor(i), draw


class LedgerTask(Task):
    name = "ledger"
    default_loss_weights = {"mse": 1.0}
    metric, mode = "mse", "min"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.pending: list[tuple[int, float]] = []

    def build_data(self) -> TaskData:
        t = self.cfg.task
        return TaskData(Draws(t.samples, 1, True), Draws(24, 2, False), {}, random_transforms=True)

    def build_model(self, info: dict[str, Any]) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def losses(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        x, y, index, draw = batch
        if torch.is_grad_enabled():  # a training micro-batch (the first look's FLOP count runs no_grad)
            self.pending += zip(index.tolist(), draw.tolist())
            time.sleep(self.cfg.task.step_sleep)
        return {"mse": F.mse_loss(model(x), y)}

    def evaluate(self, model: nn.Module, data: EvalData) -> dict[str, float]:
        total, n = torch.zeros(()), torch.zeros(())
        for (x, y, _, _), real in data:
            total += F.mse_loss(model(x)[real], y[real], reduction="sum")
            n += len(x[real])
        data.sum_(total, n)
        return {"mse": (total / n).item()}

    def hooks(self) -> list[Hook]:
        return [LedgerWriter(self)]


class LedgerWriter(Hook):
    """Appends the samples of each finished optimizer step to this process's ledger file."""

    def __init__(self, task: LedgerTask) -> None:
        self.task = task
        self.file = None

    def after_step(self) -> None:
        if self.file is None:
            folder = Path(self.task.cfg.task.ledger)
            folder.mkdir(parents=True, exist_ok=True)
            self.file = open(folder / f"{os.getpid()}.jsonl", "a", encoding="utf-8")
        t = self.trainer
        line = {"launch": LAUNCH, "time": time.time(), "step": t.step, "epoch": t.epoch, "rank": t.dist.rank,
                "world": t.dist.world_size, "samples": self.task.pending}
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()
        self.task.pending = []


register_task("ledger", LedgerTask, LedgerConfig)

#: What tells one launch of the run from the next: torchrun's run id and the round's store port (the
#: same for every rank of a round; an elastic run's agents restart their ranks under one run id), or
#: the process of a run without torchrun.
LAUNCH = f"{os.environ['TORCHELASTIC_RUN_ID']}:{os.environ.get('MASTER_PORT')}" \
    if "TORCHELASTIC_RUN_ID" in os.environ else f"pid-{os.getpid()}"


def read_ledger(folder: Path) -> list[dict[str, Any]]:
    """Every process's lines of every launch that wrote into ``folder``, as trained: a launch after a
    kill resumed from a checkpoint, and the steps the killed launch had trained past it (trained
    again by the resumed one) are left out. Launches ran one after the other; each one's first step
    tells where it resumed."""
    launches: dict[str, list[dict[str, Any]]] = {}
    for f in folder.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            if line.endswith("}"):  # a line a kill cut short is no step finished
                row = json.loads(line)
                launches.setdefault(row["launch"], []).append(row)
    ordered = sorted(launches.values(), key=lambda rows: min(r["time"] for r in rows))
    kept: list[dict[str, Any]] = []
    for k, rows in enumerate(ordered):
        resumed_at = min(r["step"] for r in ordered[k + 1]) - 1 if k + 1 < len(ordered) else None
        kept += [r for r in rows if resumed_at is None or r["step"] <= resumed_at]
    return kept
