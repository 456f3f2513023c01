"""classify-fashion through the engine vs the same training written by hand, in one process.

Same SmallCNN, same Fashion-MNIST tensors, batch 256, AdamW (fused) lr 3e-3 wd 0.05 on the same
parameter groups, 0.3-epoch linear warmup from 3e-4 then cosine to 0 per step, channels_last, an
evaluation of the 10k test images after every epoch. The engine run writes its run dir (metrics,
TensorBoard, checkpoints every epoch); the hand-written loop writes nothing.

    python benchmarks/fashion_vs_raw.py [--epochs 4]

prints each run's test top-1 and wall time and `ratio engine/raw wall: X`.
"""
from __future__ import annotations

import argparse
import math
import tempfile
import time

import torch
import torch.nn.functional as F

from visiontrain import config as C
from visiontrain.engine.param_groups import build_param_groups
from visiontrain.engine.trainer import Trainer
from visiontrain.models import build_model
from visiontrain.tasks import build_task


def raw_run(epochs: int) -> tuple[float, float]:
    from visiontrain.data.datasets import build_classification_data

    torch.manual_seed(0)
    data = build_classification_data("fashion-mnist", root=None, image_size=None, augment="none")
    model = build_model("small_cnn", num_classes=10, in_channels=1, image_size=28, dropout=0.2)
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(build_param_groups(model, 0.05), lr=3e-3, fused=True)
    x_train = torch.stack([data.train[i][0] for i in range(len(data.train))])
    y_train = torch.tensor([data.train[i][1] for i in range(len(data.train))])
    x_val = torch.stack([data.val[i][0] for i in range(len(data.val))])
    y_val = torch.tensor([data.val[i][1] for i in range(len(data.val))])
    steps_per_epoch = len(x_train) // 256
    total, warmup = steps_per_epoch * epochs, int(0.3 * steps_per_epoch)

    def lr_at(step: int) -> float:
        if step < warmup:
            return 3e-4 + (3e-3 - 3e-4) * step / warmup
        return 0.5 * 3e-3 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))

    t0, step, top1 = time.perf_counter(), 0, 0.0
    for epoch in range(epochs):
        model.train()
        perm = torch.randperm(len(x_train))
        for b in range(steps_per_epoch):
            idx = perm[b * 256:(b + 1) * 256]
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            x = x_train[idx].contiguous(memory_format=torch.channels_last)
            loss = F.cross_entropy(model(x), y_train[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if step % 50 == 0:
                loss.item()
        model.eval()
        with torch.no_grad():
            hits = sum((model(x_val[i:i + 512].contiguous(memory_format=torch.channels_last)).argmax(-1)
                        == y_val[i:i + 512]).sum().item() for i in range(0, len(x_val), 512))
        top1 = 100.0 * hits / len(x_val)
        print(f"raw epoch {epoch}: top1 {top1:.2f}", flush=True)
    return top1, time.perf_counter() - t0


def engine_run(epochs: int) -> tuple[float, float]:
    cfg = C.load_config("classify-fashion", [f"trainer.epochs={epochs}", "trainer.progress=plain"])
    with tempfile.TemporaryDirectory() as run_dir:
        t0 = time.perf_counter()
        summary = Trainer(cfg, build_task(cfg), run_dir).fit()
        return summary["final"]["top1"], time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(2)
    raw_top1, raw_s = raw_run(args.epochs)
    eng_top1, eng_s = engine_run(args.epochs)
    print(f"raw:    top1 {raw_top1:.2f} %  wall {raw_s:.1f} s")
    print(f"engine: top1 {eng_top1:.2f} %  wall {eng_s:.1f} s (incl. set-up, checkpoints, TensorBoard)")
    print(f"ratio engine/raw wall: {eng_s / raw_s:.3f}")


if __name__ == "__main__":
    main()
