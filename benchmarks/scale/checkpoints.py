"""Checkpoint costs against model size: save and load time, file size, the peak extra memory of the
atomic save, and a kept best checkpoint (``checkpoint.keep_best``: a new record that is also among
the k best, before and after it was written once and linked as best.pt).

Each size runs in a fresh process: the model (timm ViTs from 5.7M to 86M parameters, DETR-R50's
41M through the project's own model), AdamW with its state after one step, and an EMA, as a run
holds them. The checkpoint is the trainer's (``ReplicatedWeights.save`` plus the other entries'
small states) written by ``engine.state.files.atomic_save`` and read by ``load_checkpoint``. The
peak extra memory is the process's resident high-water mark during the save above its resident
size before it (Linux ``/proc/self/clear_refs`` resets the mark): a save that copied the state
would show about the checkpoint's size here.

    python benchmarks/scale/checkpoints.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loglog import RESULTS, draw, rss_kib

#: name -> how to build it (in the measuring process)
MODELS = {
    "vit_tiny (5.7M)": "timm:vit_tiny_patch16_224",
    "vit_small (22M)": "timm:vit_small_patch16_224",
    "detr_r50 (41M)": "detr",
    "vit_base (86M)": "timm:vit_base_patch16_224",
}
QUICK = ("vit_tiny (5.7M)", "vit_small (22M)")


def _build(spec: str):
    from visiontrain.core._tv_compat import ensure_torchvision

    ensure_torchvision()  # torchvision's native ops on a CPU-only torch, before timm imports it
    if spec.startswith("timm:"):
        import timm

        return timm.create_model(spec[5:], pretrained=False, num_classes=1000)
    from visiontrain.models.detr import DETR, DetrSpec

    return DETR(91, DetrSpec(backbone="resnet50"))


def measure(spec: str, workdir: Path) -> dict:
    """In this process: build, take one AdamW step, save, load, prune; the figures."""
    import torch

    from visiontrain.engine.state.checkpoint import BestTracker, ReplicatedWeights, load_checkpoint
    from visiontrain.engine.state.files import atomic_save
    from visiontrain.engine.step.ema import ModelEma

    torch.manual_seed(0)
    model = _build(spec)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # AdamW's two moments now exist, as in a run
    model.zero_grad(set_to_none=True)
    ema = ModelEma(model, 0.999)
    params = sum(p.numel() for p in model.parameters())
    state = {"weights": ReplicatedWeights().save(1, model, optimizer, ema), "progress": {"step": 1}}
    path = workdir / "last.pt"
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
    before = rss_kib("VmRSS")
    start = time.perf_counter()
    atomic_save(state, path)
    save_s = time.perf_counter() - start
    peak_extra = rss_kib("VmHWM") - before
    start = time.perf_counter()
    loaded = load_checkpoint(path)
    load_s = time.perf_counter() - start
    del loaded
    best = BestTracker(workdir, "max", keep=3)
    start = time.perf_counter()
    for step in range(1, 6):  # five records, kept: the 4th and 5th each prune the worst of the kept
        best.update("model", float(step), state, step)
    best_s = (time.perf_counter() - start) / 5
    start = time.perf_counter()
    for step in range(1, 6):  # what a kept record cost before: best-stepS.pt and best.pt written apart
        atomic_save(state, workdir / f"before-step{step}.pt")
        atomic_save(state, workdir / "before-best.pt")
    best_before_s = (time.perf_counter() - start) / 5
    size = path.stat().st_size
    return {"params_m": round(params / 1e6, 1), "file_mib": round(size / 2**20, 1), "save_s": round(save_s, 3),
            "load_s": round(load_s, 3), "save_mib_per_s": round(size / 2**20 / save_s, 1),
            "peak_extra_mib": round(peak_extra / 1024, 1),
            "peak_extra_share": round(peak_extra * 1024 / size, 3), "kept_record_s": round(best_s, 3),
            "kept_record_before_s": round(best_before_s, 3)}


def run(quick: bool = False) -> list[dict]:
    """One row per model, each measured in a process of its own."""
    rows = []
    for name, spec in MODELS.items():
        if quick and name not in QUICK:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = subprocess.run([sys.executable, __file__, "--one", spec, "--work", tmp], capture_output=True,
                                 text=True, check=True)
        rows.append({"model": name, **json.loads(out.stdout.strip().splitlines()[-1])})
    if not quick:  # the figure shows every size
        xs = [r["params_m"] for r in rows]
        curves = {label: (xs, [r[key] for r in rows]) for key, label in (
            ("save_s", "save"), ("load_s", "load"), ("kept_record_s", "kept best record"),
            ("kept_record_before_s", "kept best record, before"))}
        draw([("parameters (M); checkpoint with AdamW and EMA", "seconds", curves)], RESULTS / "scale-checkpoints.png")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the two smallest models only")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, Path(args.work))))
        return
    rows = run(args.quick)
    keys = list(rows[0])
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(str(row[k]) for k in keys))


if __name__ == "__main__":
    main()
