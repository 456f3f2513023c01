"""Images/s of visiontrain against a hand-written loop with the same settings, in one process, and MFU.

    python benchmarks/throughput.py            # GPU: ResNet-50, ViT-B/16 (224 px), DETR-R50 (800 px), bf16
    python benchmarks/throughput.py --compile  # the same, each model torch.compile'd in both runners
    python benchmarks/throughput.py --smoke    # CPU: ResNet-18, ViT-Ti (64 px), the small DETR recipe

Both runners train the same model on the same batch, replayed every step so that neither waits for
data (visiontrain through `visiontrain benchmark --synthetic`'s code path, the real trainer and
step): bf16 autocast (fp32 on the CPU smoke run), channels_last, fused AdamW. Classification: a
timm model and cross-entropy. DETR: the recipe's model and set criterion (Hungarian matching on the
host every step, in both), its loss weights, gradient clipping at 0.1, as DETR's own loop. The
hand-written loop reads its loss every 50 steps, as the engine logs. With ``--compile`` the loop
compiles its model with ``torch.compile`` and the engine runs with ``trainer.compile=true``; the
FLOPs are counted on the eager model (compiling changes no FLOP of the step). Runs
alternate (raw, engine, raw, engine, ...) so machine load hits both alike; the figure is the median
over repeats. MFU = achieved FLOP/s over the device's dense bf16 peak, the FLOPs of one step
(forward + backward) counted by torch.utils.flop_counter.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from visiontrain.core._tv_compat import ensure_torchvision

ensure_torchvision()
from visiontrain.core import config as C  # noqa: E402
from visiontrain.app.benchmark import run_benchmark  # noqa: E402
from visiontrain.engine.setup.loaders import loaders  # noqa: E402
from visiontrain.engine.parallel.distributed import DistInfo  # noqa: E402
from visiontrain.engine.step.pipeline import to_device  # noqa: E402
from visiontrain.models import build_model  # noqa: E402
from visiontrain.tasks import build_task  # noqa: E402

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}
GPU_CASES = [("resnet50", 224, 128), ("vit_base_patch16_224", 224, 128), ("detr_r50", 800, 8)]
SMOKE_CASES = [("resnet18", 64, 16), ("vit_tiny_patch16_224", 64, 16), ("detr_small", 160, 8)]
# DETR-R50 as in the paper (detect-detr-r50-coco) on the embedded fashion-mosaic images scaled to 800
# px; the small one is the CPU recipe's model (detect-detr) with its fast options off: the paper's DETR,
# as when BENCHMARKS.md's figure was taken.
PAPER_DETR = ["task.class_loss=ce", "task.cost_class=1", "task.box_refine=false", "task.two_stage=false",
              "task.query_groups=1", "task.dn_groups=0", "task.deformable_levels=0"]
DETR = {"detr_r50": ("detect-detr-r50-coco", ["data.name=fashion-mosaic", "data.root=null", "data.train_split=train",
                                              "data.val_split=val", "task.train_scales=[800]", "task.max_size=1333",
                                              "task.pretrained_backbone=false"]),  # (no download on the machine)
        "detr_small": ("detect-detr", PAPER_DETR)}


def engine_config(model: str, size: int, batch: int, device: str, precision: str, compiled: bool = False):
    common = [f"data.batch_size={batch}", "data.num_workers=0", f"trainer.precision={precision}",
              "trainer.channels_last=true", f"trainer.device={device}", "trainer.log_every=50",
              "trainer.progress=plain", f"trainer.compile={str(compiled).lower()}"]
    if model in DETR:
        recipe, overrides = DETR[model]
        return C.load_config(recipe, overrides + common + ["optim.impl=fused", "trainer.clip_grad=0.1"])
    # Fashion-MNIST's 60,000 images: an epoch outlasts the timed steps. An epoch's end is a log point
    # (a host sync) and a new loader iterator loading its first batch; with 2 batches an epoch (as
    # once here) the engine paid both every other step and measured 0.82-0.89 of the loop on an H200.
    return C.load_config("classify-fashion", [
        f"task.model={model}", "task.drop_rate=0.0", "task.label_smoothing=0.0", f"data.image_size={size}",
        "data.name=fashion-mnist", "data.limit_val=8", "data.augment=none", "optim.name=adamw",
        "optim.impl=fused", "optim.weight_decay=0.05", *common])


def classification_step(model_name: str, size: int, batch: int, device: torch.device, dtype: torch.dtype | None,
                        compiled: bool = False):
    """A hand-written step: timm model, cross-entropy, fused AdamW."""
    model = build_model(model_name, num_classes=10, in_channels=1, image_size=size).to(device)
    model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05, fused=True)
    if compiled:
        model = torch.compile(model)
    x = torch.randn(batch, 1, size, size, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device=device)

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def detr_step(model_name: str, batch: int, device: torch.device, precision: str, dtype: torch.dtype | None,
              compiled: bool = False):
    """DETR's own loop, written out: model, set criterion, weighted sum, clip 0.1, fused AdamW."""
    cfg = engine_config(model_name, 0, batch, device.type, precision)
    task = build_task(cfg)
    data = task.build_data()
    model = task.build_model(data.info).to(device).to(memory_format=torch.channels_last)
    params = [p for p in model.parameters() if p.requires_grad]
    if compiled:
        model = torch.compile(model)
    source, _ = loaders(data, cfg, DistInfo(), device)  # the engine's first batch, seeded alike
    images, mask, targets = next(iter(source.batches(0)))
    sample = to_device((images.contiguous(memory_format=torch.channels_last), mask, targets), device)
    opt = torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, fused=True)
    weights = task.loss_weights

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            losses = task.losses(model, sample)
        loss = sum(losses[k] * w for k, w in weights.items() if k in losses)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.1)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def raw_loop(model_name: str, size: int, batch: int, device: torch.device, precision: str,
             steps: int, warmup: int, compiled: bool = False) -> tuple[float, float | None]:
    """(seconds per step, FLOPs per step: None when compiled) of the hand-written loop."""
    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp32": None}[precision]
    step = detr_step(model_name, batch, device, precision, dtype, compiled) if model_name in DETR else \
        classification_step(model_name, size, batch, device, dtype, compiled)

    from torch.utils.flop_counter import FlopCounterMode

    counter = None if compiled else FlopCounterMode(display=False)
    with counter or contextlib.nullcontext():
        step()  # (compiled: the compilation happens here, before the warm-up)
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        loss = step()
        if i % 50 == 0:
            loss.item()  # the loop's log read
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / steps, None if counter is None else float(counter.get_total_flops())


def measure(model: str, size: int, batch: int, device: torch.device, precision: str, *, steps: int, warmup: int,
            repeats: int, compiled: bool = False, flops: float | None = None) -> dict:
    """One case, raw and engine alternating ``repeats`` times: images/s both ways, their ratio, and
    (given the step's FLOPs, or counted here when eager) TFLOP/s and MFU against the device's peak."""
    raw_s, engine_s = [], []
    for _ in range(repeats):
        s, counted = raw_loop(model, size, batch, device, precision, steps, warmup, compiled)
        raw_s.append(s)
        flops = counted or flops
        cfg = engine_config(model, size, batch, device.type, precision, compiled)
        r = run_benchmark(cfg, build_task(cfg), steps=steps, warmup=warmup, synthetic=True)
        engine_s.append(r["step_ms"] / 1e3)
    raw, eng = statistics.median(raw_s), statistics.median(engine_s)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result = {"model": model, "image_size": size, "batch": batch, "device": name, "precision": precision,
              "compiled": compiled, "steps": steps, "repeats": repeats, "raw_images_per_s": round(batch / raw, 1),
              "engine_images_per_s": round(batch / eng, 1), "engine_over_raw": round(raw / eng, 3)}
    if flops:
        result.update(gflop_per_step=round(flops / 1e9, 1), engine_tflops=round(flops / eng / 1e12, 3))
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
        if peak:
            result["mfu"] = round(flops / eng / 1e12 / peak, 3)
    return result


RUNTIME_CALLS = ("Synchronize", "Memcpy", "Malloc", "Free", "HostAlloc", "EventQuery", "LaunchKernel")


def _profile_summary(prof: Any, steps: int, wall_s: float) -> dict:
    """Per step: the wall time, the kernels' device time, the CUDA runtime calls that wait or
    allocate (a sync or a cudaFree in the loop serialises the host's launches with the device's
    work), the costliest entries on the device and on the host."""
    events = prof.key_averages()
    device = lambda e: getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)  # noqa: E731
    runtime = {e.key: e.count / steps for e in events if e.key.startswith("cuda") and
               any(k in e.key for k in RUNTIME_CALLS)}
    per_step = lambda us: round(us / 1e3 / steps, 3)  # noqa: E731
    return {"wall_ms_per_step": round(1e3 * wall_s / steps, 2),
            "device_ms_per_step": per_step(sum(device(e) for e in events)),
            "host_ms_per_step": per_step(sum(e.self_cpu_time_total for e in events)),
            "runtime_calls_per_step": {k: round(v, 2) for k, v in sorted(runtime.items())},
            "top_device_ms_per_step": {e.key[:90]: per_step(device(e))
                                       for e in sorted(events, key=device, reverse=True)[:12] if device(e)},
            "top_host_ms_per_step": {e.key[:90]: per_step(e.self_cpu_time_total)
                                     for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]}}


def profile_case(model: str, size: int, batch: int, device: torch.device, precision: str, *, steps: int = 5,
                 warmup: int = 5) -> dict:
    """The same case as ``measure``, each runner's ``steps`` steps under torch.profiler (CPU and
    CUDA activity): what the engine's step does that the loop's does not, in kernels and in calls."""
    from torch.profiler import ProfilerActivity, profile

    from visiontrain.engine.protocols.hooks import Hook

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    dtype = {"bf16": torch.bfloat16, "fp32": None}[precision]
    step = detr_step(model, batch, device, precision, dtype) if model in DETR else \
        classification_step(model, size, batch, device, dtype)
    for _ in range(warmup):
        step()
    sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = time.perf_counter() - t0
    raw = _profile_summary(prof, steps, wall)

    class Window(Hook):
        def before_step(self) -> None:
            if self.trainer.step == warmup:
                sync()
                self.prof = profile(activities=activities)
                self.prof.start()
                self.t0 = time.perf_counter()

        def after_step(self) -> None:
            if self.trainer.step == warmup + steps:
                sync()
                self.wall = time.perf_counter() - self.t0
                self.prof.stop()

    window = Window()
    cfg = engine_config(model, size, batch, device.type, precision)
    run_benchmark(cfg, build_task(cfg), steps=steps, warmup=warmup, synthetic=True, hooks=[window])
    return {"model": model, "image_size": size, "batch": batch, "precision": precision, "raw": raw,
            "engine": _profile_summary(window.prof, steps, window.wall)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU, small models, few steps (no GPU figures)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model in both runners")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda")
    precision = "fp32" if smoke else "bf16"
    steps, warmup = args.steps or (6 if smoke else 100), args.warmup or (2 if smoke else 20)
    for model, size, batch in SMOKE_CASES if smoke else GPU_CASES:
        result = measure(model, size, batch, device, precision, steps=steps, warmup=warmup, repeats=args.repeats,
                         compiled=args.compile)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
