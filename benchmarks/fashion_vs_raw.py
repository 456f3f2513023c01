"""classify-fashion through the engine against the same training written by hand, side by side.

The hand-written loop is the plain one a user would write (and the one the engine's default recipe
is held to): 3 blocks of conv3x3 (no bias) + BN + ReLU + 2x2 max-pool, widths 32-64-128, flatten
(128 x 3 x 3), dropout 0.2, a linear head (104k parameters); AdamW weight decay 0.05 on every
parameter; torch's OneCycleLR (max 3e-3) over the whole run; batch 256; no augmentation; inputs
normalised once with the dataset's mean/std; channels_last; the whole set as in-memory tensors
indexed by a random permutation each epoch; 2 threads; one evaluation of the 10k test images at
the end. It writes nothing.

The engine runs `classify-fashion` as shipped (or with the pair's overrides): its
evaluation after every epoch, checkpoints, metrics.jsonl, TensorBoard, plots, and the report
`visiontrain fit` writes at the end, all inside its wall time.

Both runners in one process, alternating (the order swaps every repeat, so machine load falls on
both alike); each figure is the median over repeats.

    python benchmarks/fashion_vs_raw.py [--pair 11] [--pair 4 trainer.epochs=4] [--repeats 3]

Each ``--pair`` is the loop's epoch count and the engine's overrides of the recipe (none: the
recipe as shipped). It prints one line per run, then per pair the median test top-1 and wall time
of each runner and `ratio engine/raw wall: X`.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from visiontrain.core import config as C
from visiontrain.engine.loop.trainer import Trainer
from visiontrain.tasks import build_task

BATCH, LR, WD = 256, 3e-3, 0.05


def hand_written_model() -> nn.Module:
    def block(c_in: int, c_out: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True),
                nn.MaxPool2d(2)]

    return nn.Sequential(*block(1, 32), *block(32, 64), *block(64, 128), nn.Flatten(), nn.Dropout(0.2),
                         nn.Linear(128 * 3 * 3, 10))


def fashion_tensors() -> tuple[torch.Tensor, ...]:
    """Train and test images as float tensors normalised with the train set's mean/std, and labels."""
    from visiontrain.data.datasets.fashion_mnist import load_fashion_mnist

    (x_train, y_train), (x_test, y_test) = load_fashion_mnist(root=None, download=False)
    x_train, x_test = torch.as_tensor(x_train).float() / 255, torch.as_tensor(x_test).float() / 255
    mean, std = x_train.mean(), x_train.std()
    return ((x_train - mean) / std, torch.as_tensor(y_train).long(), (x_test - mean) / std,
            torch.as_tensor(y_test).long())


def raw_run(epochs: int, seed: int = 0) -> tuple[float, float]:
    """The hand-written loop: (test top-1 in %, wall seconds from the model's creation to the result)."""
    x_train, y_train, x_test, y_test = fashion_tensors()
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    model = hand_written_model().to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    steps_per_epoch = len(x_train) // BATCH
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, epochs=epochs, steps_per_epoch=steps_per_epoch)
    for _ in range(epochs):
        model.train()
        perm = torch.randperm(len(x_train))
        for b in range(steps_per_epoch):
            idx = perm[b * BATCH:(b + 1) * BATCH]
            loss = F.cross_entropy(model(x_train[idx].contiguous(memory_format=torch.channels_last)), y_train[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    model.eval()
    with torch.no_grad():
        hits = sum(int((model(x_test[i:i + 1000].contiguous(memory_format=torch.channels_last)).argmax(-1)
                        == y_test[i:i + 1000]).sum()) for i in range(0, len(x_test), 1000))
    return 100.0 * hits / len(x_test), time.perf_counter() - t0


def engine_run(overrides: list[str]) -> tuple[float, float]:
    """classify-fashion as shipped, with ``overrides``: (final test top-1, wall seconds of fit + report)."""
    from visiontrain.report.page import write_report

    cfg = C.load_config("classify-fashion", [*overrides, "trainer.progress=plain"])
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        t0 = time.perf_counter()
        summary = Trainer(cfg, build_task(cfg), run_dir).fit()
        write_report(run_dir)
        return summary["final"]["top1"], time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", nargs="+", action="append", metavar=("RAW_EPOCHS", "OVERRIDE"),
                   help="the loop's epoch count, then the engine's overrides of the recipe (none: as shipped); "
                        "default: --pair 11 --pair 4 trainer.epochs=4")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    pairs = [(int(p[0]), p[1:]) for p in (args.pair or [["11"], ["4", "trainer.epochs=4"]])]
    torch.set_num_threads(2)
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for repeat in range(args.repeats):
        for n, (raw_epochs, overrides) in enumerate(pairs):
            runners = {"raw": lambda: raw_run(raw_epochs), "engine": lambda: engine_run(overrides)}
            for name in (list(runners) if repeat % 2 == 0 else list(reversed(runners))):
                top1, wall = runners[name]()
                results.setdefault((name, n), []).append((top1, wall))
                label = f"{raw_epochs} epochs" if name == "raw" else " ".join(overrides) or "as shipped"
                print(f"repeat {repeat} {name:<6} {label:<22} top1 {top1:.2f} %  wall {wall:.1f} s", flush=True)
    for n, (raw_epochs, overrides) in enumerate(pairs):
        med = {name: (statistics.median(t for t, _ in results[(name, n)]),
                      statistics.median(w for _, w in results[(name, n)])) for name in ("raw", "engine")}
        engine_label = " ".join(overrides) or "as shipped"
        print(f"raw {raw_epochs} epochs: median top1 {med['raw'][0]:.2f} %, median wall {med['raw'][1]:.1f} s; "
              f"engine {engine_label}: median top1 {med['engine'][0]:.2f} %, median wall {med['engine'][1]:.1f} s; "
              f"ratio engine/raw wall: {med['engine'][1] / med['raw'][1]:.3f}")


if __name__ == "__main__":
    main()
