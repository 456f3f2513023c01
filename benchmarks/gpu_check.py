"""visiontrain on a GPU: one command that runs every CUDA path and takes the GPU figures.

    python benchmarks/gpu_check.py --out DIR             # on a GPU machine: about 9 minutes on an H100/H200
    python benchmarks/gpu_check.py --dry-run --out DIR   # the same stages on the CPU, tiny sizes (the suite runs it)
    python benchmarks/gpu_check.py --out DIR --stages tests,fsdp   # again, only these stages
    python benchmarks/gpu_check.py --out DIR --stages input        # the input pipeline alone: about 3 minutes

Each stage runs in its own process group with its own time budget, so one that fails, hangs or
takes CUDA down loses only its own figures; each writes its results as they come, and a stage cut
off by its budget keeps what it had. The stages that only check run side by side first, the timed
ones alone after them:

  env         the GPU, driver, CUDA, cuDNN and package versions; a bf16 matrix product's TFLOP/s;
              builds fashion-mosaic (the small detection recipes' data) while the tests run
  tests       `pytest -m cuda`: the suite's CUDA paths on the GPU (tests/support/devices.py): the step in
              fp32 / bf16 / fp16 with clipping, accumulation and skipped steps (fused optimizers),
              the side-stream prefetch from pinned memory, normalisation on the device, exact resume
              with deterministic kernels and forkserver workers beside a CUDA context, and CUDA's
              sync debug mode over the steps between log points of each small recipe's family
  fsdp        FSDP2 in one process (torchrun, NCCL) with bf16 autocast on a ResNet-18, beside the
              same run unsharded: finite or not
  profile     ResNet-50's steps under torch.profiler, the loop's and the engine's side by side:
              kernels, device time and the CUDA runtime calls that wait, per step
  throughput  benchmarks/throughput.py: ResNet-50 and ViT-B/16 at 224 px and DETR-R50 at 800 px, bf16,
              channels_last, the engine against the hand-written loop (img/s, ratio, MFU), then the
              two classifiers torch.compile'd in both
  recipes     each small recipe as shipped (its workers, forkserver, pinned memory, precision,
              data cache) through `visiontrain benchmark`: samples/s, data-wait share, peak memory;
              then on its first batch replayed (--synthetic): what the step alone could do, which
              says whether loading (DINO's multi-crop, detection decoding) is the limit
  input       an ImageNet-style folder of JPEGs (33,000 at 500 x 375, written here in parallel) read by
              the image-folder source into ResNet-50 at 224 px, bf16: images/s and data-wait share with
              data.decode=cpu at 0, 4, 8 and 16 workers and data.decode=gpu at 8 and 16, each against the
              step alone on its first batch replayed (the ceiling); and what trainer.precision=auto picks

Writes DIR/gpu_check.json (every stage: status, seconds, results), DIR/summary.txt (a few lines
a stage) and DIR/stages.log (every stage's own output).

On the GPU machine: its own python3 (3.12, torch 2.11, torchvision 0.26, timm) runs the source tree
(PYTHONPATH=src), nothing is installed from the network. What the checks need and it lacks travels
with the working tree in an ignored folder named in the call's carry list: pycocotools and
faster-coco-eval (the detection evaluation) as wheels, and Fashion-MNIST's four idx files (every small
recipe's data), as `data.root`-free runs find them under $VISIONTRAIN_DATA_CACHE/FashionMNIST/raw:

    mkdir -p .gpu/whl .gpu/data/FashionMNIST/raw && cp /usr/share/datasets/fashion-mnist/*.gz .gpu/data/FashionMNIST/raw/
    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux2014_x86_64 -d .gpu/whl pycocotools==2.0.11
    pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 -d .gpu/whl faster-coco-eval==1.8.0   # eval.coco_backend's default
    # then, there:
    pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl
    PYTHONPATH=src:/tmp/site python benchmarks/gpu_check.py --out "$OUT" --data .gpu/data
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- stage bookkeeping (any process)
class Results:
    """One stage's records, rewritten whole (atomically) after each one, so that a stage killed at
    its budget leaves everything it had measured."""

    def __init__(self, path: Path) -> None:
        self.path, self.records = path, []

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        print(json.dumps(record), flush=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.records, indent=1))
        os.replace(tmp, self.path)


@dataclass(frozen=True)
class Stage:
    name: str
    timed: bool          # measures speed: runs alone, after the checks
    budget_s: int        # on a GPU
    dry_budget_s: int    # --dry-run on a 2-core CPU
    run: Callable[[argparse.Namespace, Results], None]


def child_env(args: argparse.Namespace) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CI": "true"}  # CI: plain log lines, no progress bar
    if args.dry_run:  # its stages share the CPU side by side: one thread each, not a pool each per core
        env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    if args.data:
        env["VISIONTRAIN_DATA_CACHE"] = str(Path(args.data).resolve())
    return env


def run_logged(cmd: list[str], args: argparse.Namespace, timeout: float, **env: str) -> tuple[int, str]:
    """A command of a stage, in its own process group (killed whole at ``timeout``): (exit code,
    output). Its output also goes to this stage's log."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**child_env(args), **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n[gpu_check] killed after {timeout:.0f} s\n"
    print(f"$ {' '.join(cmd)}\n{out}", flush=True)
    return proc.returncode, out


def last_json(output: str) -> dict[str, Any] | None:
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return None


def left(args: argparse.Namespace) -> float:
    return args.deadline - time.time()


# ---------------------------------------------------------------- the stages (each in its own process)
def stage_env(args: argparse.Namespace, out: Results) -> None:
    import platform

    import torch

    from visiontrain.core._tv_compat import ensure_torchvision

    ensure_torchvision()
    import timm
    import torchvision

    record: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                              "torchvision": torchvision.__version__, "timm": timm.__version__,
                              "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    try:
        import pycocotools  # noqa: F401
        record["pycocotools"] = True
    except ImportError:
        record["pycocotools"] = False
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        record.update(device=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                      memory_gib=round(p.total_memory / 2**30, 1), cudnn=torch.backends.cudnn.version())
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        record["driver"] = smi.stdout.strip() or smi.stderr.strip()[-200:]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    sync()
    tflops = 10 * 2 * n**3 / (time.perf_counter() - t0) / 1e12
    record[f"matmul_{n}_{str(dtype).removeprefix('torch.')}_tflops"] = round(tflops, 1 if tflops > 10 else 4)
    # The small recipes' detection set, built here while the tests run, not inside a timed stage
    from visiontrain.data.detection.embedded import build_fashion_mosaic
    from visiontrain.data.cache_dir import data_cache_dir

    t0 = time.perf_counter()
    build_fashion_mosaic(data_cache_dir())
    record["fashion_mosaic_s"] = round(time.perf_counter() - t0, 1)
    out.add(record)


# The dry run's `tests` stage runs this rehearsal, not the suite's cuda-marked tests (on the CPU the
# suite runs every one of those anyway): what it proves is the stage, with one test of each outcome it
# counts, and one without the mark that fails should `-m cuda` ever stop deselecting it.
REHEARSAL = {"conftest.py": '''
def pytest_configure(config):  # (tests/conftest.py registers the mark for the suite)
    config.addinivalue_line("markers", "cuda: a code path that differs on a GPU")
''', "test_rehearsal.py": '''"""Written by benchmarks/gpu_check.py --dry-run: its tests stage's rehearsal."""
import pytest


@pytest.mark.cuda
def test_a_cuda_test_passes():
    pass


@pytest.mark.cuda
def test_a_cuda_test_skips():
    pytest.skip("the rehearsal's skip")


@pytest.mark.cuda
def test_a_failure_is_reported():
    assert 1 == 2, "the rehearsal's planted failure"


def test_an_unmarked_test_is_deselected():
    raise AssertionError("ran without the cuda mark: pytest -m cuda did not deselect it")
'''}
REHEARSAL_COUNTS = {"exit": 1, "tests": 3, "passed": 1, "failed": 1, "skipped": 1}


def stage_tests(args: argparse.Namespace, out: Results) -> None:
    """`pytest -m cuda` over the suite on the GPU, its JUnit file read back as counts and failures.
    The dry run runs the same on REHEARSAL, and passes when exactly its planted outcomes come back."""
    junit = Path(args.work) / "tests.xml"
    if args.dry_run:
        rehearsal = Path(args.work) / "rehearsal"
        rehearsal.mkdir()
        for name, text in REHEARSAL.items():
            (rehearsal / name).write_text(text)
        workers, targets, env = ["-n", "0"], [str(rehearsal)], {}
    else:
        workers, targets, env = ["-n", "4", "--dist", "loadfile"], ["tests"], {"VISIONTRAIN_REQUIRE_CUDA": "1"}
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", *workers,
           f"--junitxml={junit}", *targets]
    rc, output = run_logged(cmd, args, left(args) - 5, **env)
    record: dict[str, Any] = {"exit": rc, "tail": output.strip().splitlines()[-1:], **junit_counts(junit)}
    out.add(record)
    if not args.dry_run:
        if rc != 0:
            raise SystemExit(rc)
        return
    reported = [f["test"].rsplit("::", 1)[-1] for f in record.get("failures", [])
                if "planted failure" in f["message"]]
    if {k: record.get(k) for k in REHEARSAL_COUNTS} != REHEARSAL_COUNTS or reported != ["test_a_failure_is_reported"]:
        raise SystemExit(f"the rehearsal's outcomes should be {REHEARSAL_COUNTS} with its planted failure "
                         f"reported; they were {record}")


def junit_counts(junit: Path) -> dict[str, Any]:
    """Tests, passed, failed (failures and errors), skipped, and each failure's test and message, from
    pytest's JUnit XML; nothing when pytest wrote none (it was killed, or failed before collecting)."""
    import xml.etree.ElementTree as ET

    if not junit.is_file():
        return {}
    cases = list(ET.parse(junit).getroot().iter("testcase"))
    failed = []
    for case in cases:
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            failed.append({"test": f"{case.get('classname')}::{case.get('name')}",
                           "message": (bad.get("message") or "")[:3000]})
    skipped = [c for c in cases if c.find("skipped") is not None]
    return {"tests": len(cases), "failed": len(failed), "skipped": len(skipped),
            "passed": len(cases) - len(failed) - len(skipped), "failures": failed}


FSDP_RUN = ["classify-fashion", "task.model=resnet18", "data.name=digits", "trainer.log_every=1",
            "eval.every=0", "checkpoint.every=0", "trainer.precision=bf16", "trainer.nonfinite=raise",
            "trainer.plots=false"]
# (steps, batch, images of the run's final evaluation). The dry run's: a second step, from the first
# one's update, on a batch of 4 (bf16 is emulated, slowly, on a CPU without AVX512-BF16)
FSDP_SIZES = {"gpu": (30, 64, 64), "dry": (2, 4, 8)}


def stage_fsdp(args: argparse.Namespace, out: Results) -> None:
    """FSDP2 with bf16 autocast on a ResNet, one process, beside the same run unsharded. On the
    CPU (gloo) the sharded one's strided convolutions went non-finite (docs/distributed.md)."""
    steps, batch, val_images = FSDP_SIZES["dry" if args.dry_run else "gpu"]
    common = [*FSDP_RUN, f"data.limit_val={val_images}", f"trainer.max_steps={steps}", f"data.batch_size={batch}"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    runs = {"fsdp": [*torchrun, "-m", "visiontrain", "fit", *common, "distributed.strategy=fsdp"],
            "unsharded": [sys.executable, "-m", "visiontrain", "fit", *common]}
    for i, (name, cmd) in enumerate(runs.items()):
        run_dir = Path(args.work) / f"fsdp-{name}"
        rc, output = run_logged([*cmd, "--run-dir", str(run_dir)], args, left(args) / (len(runs) - i) - 2)
        metrics = run_dir / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
        totals = [r["total"] for r in rows if r.get("kind") == "train"]
        weights = run_dir / "model.safetensors"
        bad = nonfinite_tensors(weights) if weights.is_file() else None
        finite = rc == 0 and bool(totals) and all(t is not None and abs(t) < float("inf") for t in totals) \
            and bad == []
        # (under torchrun a rank's exit code 3, non-finite, reaches us as torchrun's 1: read the message)
        stopped = next((line for line in output.splitlines() if "non-finite" in line and "error" in line), None)
        out.add({"run": name, "exit": rc, "finite": finite, "steps_logged": len(totals), "totals": totals[:6],
                 "last_total": totals[-1] if totals else None, "nonfinite_weights": bad, "nonfinite_stop": stopped,
                 "error": None if rc == 0 else output.strip().splitlines()[-3:]})


def nonfinite_tensors(path: Path) -> list[str]:
    """The names of the tensors in a safetensors file holding NaN or Inf (the final weights: the
    losses can all be finite while the last update was not)."""
    import torch
    from safetensors.torch import load_file

    return [k for k, v in load_file(path).items() if v.is_floating_point() and not torch.isfinite(v).all()]


THROUGHPUT = {  # (model, image size, batch, compiled)
    "gpu": [("resnet50", 224, 128, False), ("vit_base_patch16_224", 224, 128, False), ("detr_r50", 800, 8, False),
            ("resnet50", 224, 128, True), ("vit_base_patch16_224", 224, 128, True)],
    # each of the GPU's kinds of case (a timm CNN, a ViT, DETR, a CNN compiled with the eager one's FLOPs),
    # as small as they go: DETR's images are its recipe's (detect-detr), whatever the size said here
    "dry": [("resnet18", 32, 2, False), ("vit_tiny_patch16_224", 32, 2, False), ("detr_small", 160, 2, False),
            ("resnet18", 32, 2, True)],
}
DRY_COMPILE_BACKEND = "aot_eager"


def compile_by_tracing_only() -> None:
    """The dry run's torch.compile, in the loop and in the engine alike: dynamo's and AOTAutograd's
    tracing of the same forward and backward graphs, with no code generated from them. Inductor's
    code for the CPU is C++ built by the compiler, 3 to 5 minutes of a 2-core machine for one
    ResNet-18 in both runners, and is not what a GPU runs (Triton); the suite compiles the engine's
    step with inductor on the CPU (tests/engine/test_precision_and_files.py)."""
    import functools

    import torch

    torch.compile = functools.partial(torch.compile, backend=DRY_COMPILE_BACKEND)


def chosen_cases(cases: list[tuple[str, int, int, bool]], models: str | None) -> list[tuple[str, int, int, bool]]:
    """The throughput cases ``--models`` names (``vit_base_patch16_224+compiled``: only its compiled
    case); all of them without it."""
    if not models:
        return cases
    names = set(models.split(","))
    return [c for c in cases if (f"{c[0]}+compiled" if c[3] else c[0]) in names]


def stage_throughput(args: argparse.Namespace, out: Results) -> None:
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import throughput

    if args.dry_run:
        compile_by_tracing_only()
    device = torch.device("cpu" if args.dry_run else "cuda")
    precision = "fp32" if args.dry_run else "bf16"
    steps, warmup = (1, 1) if args.dry_run else (30, 8)
    flops: dict[str, float] = {}
    for model, size, batch, compiled in chosen_cases(THROUGHPUT["dry" if args.dry_run else "gpu"], args.models):
        need = (60 if compiled else 25) * (0.3 if args.dry_run else 1)  # what a case takes, about
        if left(args) < need:
            out.add({"model": model, "compiled": compiled, "skipped": f"{left(args):.0f} s of the budget left"})
            continue
        repeats = 1 if compiled or args.dry_run else 2
        r = throughput.measure(model, size, batch, device, precision, steps=steps, warmup=warmup, repeats=repeats,
                               compiled=compiled, flops=flops.get(model))
        if "gflop_per_step" in r:
            flops[model] = r["gflop_per_step"] * 1e9
        if device.type == "cuda":
            r["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
            torch.cuda.reset_peak_memory_stats()
        if compiled and args.dry_run:
            r["compile_backend"] = DRY_COMPILE_BACKEND
        out.add(r)


def stage_profile(args: argparse.Namespace, out: Results) -> None:
    """ResNet-50 (ResNet-18 in the dry run) under torch.profiler, the loop's steps and the engine's:
    kernels, device time and the runtime calls that wait, per step, side by side."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import throughput

    device = torch.device("cpu" if args.dry_run else "cuda")
    case = ("resnet18", 32, 2, "fp32") if args.dry_run else ("resnet50", 224, 128, "bf16")
    out.add(throughput.profile_case(*case[:3], device, case[3], steps=1 if args.dry_run else 5,
                                    warmup=1 if args.dry_run else 5))


SMALL_RECIPES = ["detect-faster-rcnn", "segment-mask-rcnn", "segment-panoptic", "segment-semantic", "detect-detr",
                 "detect-yolov3", "ssl-dino", "classify-fashion"]
# --dry-run only: the run's size (tests/support/shipped.py's keys)
DRY_SIZES = {
    "classify-fashion": ["data.batch_size=8"],
    "ssl-dino": ["data.batch_size=4"],
    "detect-yolov3": ["data.batch_size=2", "task.size=64", "task.multiscale_sizes=[64]"],
    "detect-detr": ["data.batch_size=2", "task.train_scales=[96]", "task.max_size=128", "task.val_size=96",
                    "task.crop_resize=[96]", "task.crop_min=64", "task.crop_max=96"],
    "detect-faster-rcnn": ["data.batch_size=2", "task.train_scales=[96]", "task.max_size=128", "task.val_size=96"],
    "segment-mask-rcnn": ["data.batch_size=2", "task.train_scales=[96]", "task.max_size=128", "task.val_size=96"],
    "segment-panoptic": ["data.batch_size=2", "task.train_scales=[96]", "task.max_size=128", "task.val_size=96"],
    "segment-semantic": ["data.batch_size=2", "task.crop=64", "task.train_sizes=[64,96]"],
}
# --dry-run: every recipe's first batch replayed (--synthetic) loads that batch through the recipe's
# loader as shipped, then replays it: what `visiontrain benchmark` adds to a recipe's run. Its real-data
# run adds only the loader's next batches, which the suite's run of every recipe loads
# (tests/app/test_recipes.py); one recipe takes it, for the stage's pairing of the two figures.
DRY_REAL_DATA = "classify-fashion"


def stage_recipes(args: argparse.Namespace, out: Results) -> None:
    """Each small recipe as shipped: real data (its loader as written), then its first batch replayed."""
    real, synthetic = ((1, 1), (1, 1)) if args.dry_run else ((200, 20), (20, 5))
    for recipe in args.recipes.split(",") if args.recipes else SMALL_RECIPES:
        sizes = DRY_SIZES[recipe] if args.dry_run else []
        record: dict[str, Any] = {"recipe": recipe}
        kinds = {"real": real, "synthetic": synthetic}
        if args.dry_run and recipe != DRY_REAL_DATA:
            del kinds["real"]
        for kind, (steps, warmup) in kinds.items():
            if left(args) < 10:
                record[kind] = {"skipped": f"{left(args):.0f} s of the budget left"}
                continue
            cmd = [sys.executable, "-m", "visiontrain", "benchmark", recipe, *sizes, "--steps", str(steps),
                   "--warmup", str(warmup), *(["--synthetic"] if kind == "synthetic" else [])]
            rc, output = run_logged(cmd, args, min(left(args) - 2, 120))
            r = last_json(output) if rc == 0 else None
            record[kind] = r if r else {"exit": rc, "error": output.strip().splitlines()[-3:]}
        if "samples_per_s" in record.get("real", {}) and "samples_per_s" in record.get("synthetic", {}):
            r, s = record["real"], record["synthetic"]
            record["data_wait_share"] = round(r["data_wait_ms"] / max(r["step_ms"], 1e-9), 3)
            record["real_over_synthetic"] = round(r["samples_per_s"] / s["samples_per_s"], 3)
        out.add(record)


# The input stage: an ImageNet-style folder of JPEGs made here, read by the classification recipe's
# image-folder source as it ships, ResNet-50 at 224 px in bf16 (the dry run: ResNet-18 at 32 px, fp32).
INPUT_RUN = ["classify-mobilevit-imagenet", "ema.enabled=false"]
# (train images, val images, classes, (width, height), processes: None = one a core). 32,000 train
# images, not fewer: an epoch (125 steps of 256) holds each case's warm-up and window, since an
# epoch's end restarts every worker's prefetch at once, a stall that ImageNet's 5,000-step epochs
# spread thin and a short window would not.
INPUT_SIZES = {
    "gpu": (32_000, 1_000, 100, (500, 375), None),
    "dry": (48, 4, 2, (64, 48), 1),
}
INPUT_OVERRIDES = {
    "gpu": ["task.model=resnet50", "data.image_size=224", "data.batch_size=256", "trainer.precision=bf16"],
    "dry": ["task.model=resnet18", "data.image_size=32", "data.batch_size=8", "trainer.precision=fp32"],
}


@dataclass(frozen=True)
class InputCase:
    """One `visiontrain benchmark` run of the input stage. The first synthetic case at the run's
    precision is the ceiling that the others are divided by: its first batch replayed, so loading
    drops out."""
    decode: str                   # data.decode: cpu (PIL in the loader's workers) | gpu (on the device)
    workers: int                  # data.num_workers
    steps: int
    warmup: int
    need_s: int                   # what it takes with its start-up, about: skipped when less is left
    synthetic: bool = False
    precision: str | None = None  # trainer.precision instead of the run's: auto, to record what it picks


INPUT_CASES = {
    # The order: what the stage is for first (a case is skipped when the budget runs short), the
    # ceiling before all (each ratio as it comes). The warm-ups where workers decode (cpu): 4 x
    # workers + 2 steps. While the first step runs (cuDNN's autotune) the workers stack up their
    # prefetch (2 batches a worker), which a timed window would get for free; where loading is the
    # limit, that many steps eat it first. The steps: 5-10 s timed a case (0 workers: 1,280 images).
    "gpu": [InputCase("cpu", 0, 40, 10, 15, synthetic=True), InputCase("cpu", 16, 50, 66, 28),
            InputCase("gpu", 16, 40, 10, 18), InputCase("cpu", 8, 30, 34, 25), InputCase("gpu", 8, 40, 10, 18),
            InputCase("cpu", 4, 20, 18, 26), InputCase("cpu", 0, 5, 1, 22),
            InputCase("cpu", 0, 3, 1, 12, synthetic=True, precision="auto")],
    # each kind of run once, loaded in the training process: the dry run shares 2 cores with the
    # others. (auto has its own case: on a CPU with AVX512-BF16 it picks bf16, not the cases' fp32)
    "dry": [InputCase("cpu", 0, 1, 1, 8, synthetic=True), InputCase("cpu", 0, 1, 1, 8), InputCase("gpu", 0, 1, 1, 8),
            InputCase("cpu", 0, 1, 1, 8, synthetic=True, precision="auto")],
}


def write_jpegs(job: tuple[str, str, int, int, int, int, int]) -> int:
    """One class's images ``start`` to ``start + count`` of one split, as JPEGs at quality 90: random
    colours on a coarse grid, upsampled smoothly, plus pixel noise, so that a file is about the size of
    an ImageNet photo (about 55 kB at 500 x 375) and costs about as much to decode. Every fourth one
    is portrait, so RandomResizedCrop's geometry varies as on photos. Returns its files' bytes."""
    import numpy as np
    from PIL import Image

    root, split, cls, start, count, width, height = job
    rng = np.random.default_rng([int(split == "train"), cls, start])
    side = width + height  # one block of noise, each image a window of it: 2.5 ms an image, not 4.5
    noise = rng.integers(0, 17, (side, side, 3), dtype=np.uint8)
    folder = Path(root) / split / f"class{cls:03d}"
    folder.mkdir(parents=True, exist_ok=True)
    total = 0
    for i in range(start, start + count):
        w, h = (height, width) if i % 4 == 3 else (width, height)
        coarse = rng.integers(0, 240, (h // 16 + 2, w // 16 + 2, 3), dtype=np.uint8)
        smooth = np.asarray(Image.fromarray(coarse).resize((w, h), Image.BILINEAR))  # no overshoot: at most 239
        y, x = rng.integers(0, side - h + 1), rng.integers(0, side - w + 1)
        path = folder / f"{i:05d}.jpg"
        Image.fromarray(smooth + noise[y:y + h, x:x + w]).save(path, quality=90)
        total += path.stat().st_size
    return total


def make_image_folder(root: Path, dry_run: bool) -> dict[str, Any]:
    """ROOT/train/<class>/*.jpg and ROOT/val/<class>/*.jpg, written by a process a core (the GPU
    machine's 16 write its 33,000 files in seconds: about 3 ms a file), in jobs of at most 50 images
    so that the processes share them evenly."""
    import multiprocessing

    train, val, classes, (width, height), processes = INPUT_SIZES["dry" if dry_run else "gpu"]
    processes = processes or os.cpu_count() or 1
    jobs = [(str(root), split, c, start, min(50, n // classes - start), width, height)
            for split, n in (("train", train), ("val", val)) for c in range(classes)
            for start in range(0, n // classes, 50)]
    t0 = time.perf_counter()
    if processes == 1:
        sizes = list(map(write_jpegs, jobs))
    else:  # forked: this stage's process has imported nothing but the standard library
        with multiprocessing.get_context("fork").Pool(processes) as pool:
            sizes = list(pool.imap_unordered(write_jpegs, jobs))
    seconds = time.perf_counter() - t0
    print(f"[gpu_check] input: {train + val} JPEGs written in {seconds:.1f} s by {processes} processes", flush=True)
    return {"dataset": "imagenet-like", "train_images": train, "val_images": val, "classes": classes,
            "size": f"{width}x{height}", "portrait_share": 0.25, "processes": processes, "seconds": round(seconds, 1),
            "mean_kb": round(sum(sizes) / (train + val) / 1e3, 1)}


def input_case(case: InputCase, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One case's record: its figures from `visiontrain benchmark`'s JSON, or its exit and error."""
    record: dict[str, Any] = {"decode": case.decode, "workers": case.workers, "synthetic": case.synthetic}
    if case.precision:
        record["precision_asked"] = case.precision
    if left(args) < case.need_s:
        return {**record, "skipped": f"{left(args):.0f} s of the budget left"}
    overrides = [*INPUT_OVERRIDES["dry" if args.dry_run else "gpu"], f"data.root={root}",
                 f"data.decode={case.decode}", f"data.num_workers={case.workers}",
                 *([f"trainer.precision={case.precision}"] if case.precision else [])]
    cmd = [sys.executable, "-m", "visiontrain", "benchmark", *INPUT_RUN, *overrides, "--steps", str(case.steps),
           "--warmup", str(case.warmup), *(["--synthetic"] if case.synthetic else [])]
    t0 = time.time()
    rc, output = run_logged(cmd, args, min(left(args) - 2, 120))
    record["seconds"] = round(time.time() - t0, 1)  # start-up included: what need_s guesses
    r = last_json(output) if rc == 0 else None
    if not r:
        return {**record, "exit": rc, "error": output.strip().splitlines()[-3:]}
    return {**record, "precision": r["precision"], "steps": r["steps"], "warmup": r["warmup"],
            "images_per_s": round(r["samples_per_s"], 1), "step_ms": round(r["step_ms"], 1),
            "data_wait_ms": round(r["data_wait_ms"], 1),
            "data_wait_share": round(r["data_wait_ms"] / max(r["step_ms"], 1e-9), 3),
            **{k: v for k, v in r.items() if k.startswith("peak_")}}


def stage_input(args: argparse.Namespace, out: Results) -> None:
    """What an ImageNet-style folder of JPEGs gives a ResNet-50 end to end: decoded by PIL in 0 to 16
    workers, or on the GPU, each against the step alone (the ceiling), and what precision=auto picks.
    The ceiling replays a batch decoded on the CPU: the step alone. With data.decode=gpu the device's
    decode is the step's first part (Task.device_transform), so its data wait is the file reads alone
    and what the decode costs shows as the gap to the ceiling."""
    root = Path(args.work) / "imagenet-like"
    out.add(make_image_folder(root, args.dry_run))
    ceiling = None
    for case in INPUT_CASES["dry" if args.dry_run else "gpu"]:
        record = input_case(case, root, args)
        if case.synthetic and not case.precision and ceiling is None and "images_per_s" in record:
            ceiling = record["images_per_s"]
            record["ceiling"] = True
        if ceiling and "images_per_s" in record and not case.synthetic:
            record["x_ceiling"] = round(record["images_per_s"] / ceiling, 3)
        out.add(record)


STAGES = {s.name: s for s in [
    # The dry run's budgets are caps for a loaded CI machine (the suite runs it beside another test
    # worker); on an idle 2-core machine the whole dry run takes about 3 minutes.
    Stage("env", False, 60, 120, stage_env),
    Stage("tests", False, 130, 600, stage_tests),
    Stage("fsdp", False, 110, 300, stage_fsdp),
    Stage("profile", True, 45, 120, stage_profile),
    Stage("throughput", True, 180, 400, stage_throughput),
    Stage("recipes", True, 190, 560, stage_recipes),
    Stage("input", True, 210, 180, stage_input),
]}


# ---------------------------------------------------------------- the runner (the parent process)
def start(stage: Stage, args: argparse.Namespace, work: Path) -> tuple[subprocess.Popen, float, Any]:
    budget = args.budgets.get(stage.name) or (stage.dry_budget_s if args.dry_run else stage.budget_s)
    deadline = time.time() + budget
    cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", stage.name, "--work", str(work),
           "--deadline", str(deadline), *(["--dry-run"] if args.dry_run else []),
           *(["--data", args.data] if args.data else []), *(["--recipes", args.recipes] if args.recipes else []),
           *(["--models", args.models] if args.models else [])]
    log = open(work / f"{stage.name}.log", "w")  # noqa: SIM115  (closed by finish)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=child_env(args), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    print(f"[gpu_check] {stage.name}: started (budget {budget} s)", flush=True)
    return proc, deadline, log


def finish(stage: Stage, proc: subprocess.Popen, deadline: float, log: Any, work: Path, t0: float) -> dict[str, Any]:
    try:
        rc = proc.wait(timeout=max(deadline - time.time(), 0) + 10)  # the stage stops itself first
        status = "ok" if rc == 0 else f"failed (exit {rc})"
    except subprocess.TimeoutExpired:
        status = "timed out"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it left: workers, torchrun's ranks
        except ProcessLookupError:
            pass
        proc.wait()
        log.close()
    path = work / f"{stage.name}.json"
    records = json.loads(path.read_text()) if path.is_file() else []
    text = (work / f"{stage.name}.log").read_text(errors="replace")
    result = {"status": status, "seconds": round(time.time() - t0, 1), "records": records}
    if status != "ok":
        result["log_tail"] = text.strip().splitlines()[-15:]
    print(f"[gpu_check] {stage.name}: {status} in {result['seconds']} s", flush=True)
    return result


def input_lines(records: list[dict[str, Any]]) -> list[str]:
    """The input stage's few lines: its data, then a row a case (images/s, against the step alone, and
    the share of a step spent waiting for the next batch), in reading order (the stage runs them in
    order of need), then what precision=auto picked."""
    lines, rows, picked = [], ["  decode       workers    img/s  x ceiling  data wait"], []
    for r in records:
        if "dataset" in r:
            lines.append(f"  {r['train_images']} train + {r['val_images']} val JPEGs, {r['classes']} classes, "
                         f"{r['size']} (a quarter portrait), {r['mean_kb']} kB each, written in {r['seconds']} s "
                         f"by {r['processes']} process{'es' if r['processes'] > 1 else ''}")
    cases = sorted((r for r in records if "decode" in r),
                   key=lambda r: (not r["synthetic"], "precision_asked" in r, r["decode"], r["workers"]))
    for r in cases:
        what = (f"step alone{', ' + r['precision_asked'] if 'precision_asked' in r else ''}" if r["synthetic"]
                else r["decode"])
        if "images_per_s" not in r:
            why = f"skipped: {r['skipped']}" if "skipped" in r else f"failed (exit {r.get('exit')})"
            rows.append(f"  {what:<16} {r['workers']:>3}  {why}")
            continue
        if "precision_asked" in r:
            picked.append(f"  trainer.precision={r['precision_asked']} picked {r['precision']}")
        ratio = "ceiling" if r.get("ceiling") else r.get("x_ceiling", "")
        wait = "" if r["synthetic"] else f"{100 * r['data_wait_share']:.0f} %"
        rows.append(f"  {what:<16} {r['workers']:>3} {r['images_per_s']:>8.0f} {ratio:>10} {wait:>10}".rstrip())
    return lines + rows + picked


def summary_lines(name: str, result: dict[str, Any]) -> list[str]:
    lines = [f"{name}: {result['status']} in {result['seconds']} s"]
    if name == "input":
        return lines + input_lines(result["records"])
    for r in result["records"]:
        if name == "throughput" and "engine_over_raw" in r:
            lines.append(f"  {r['model']}{' compiled' if r['compiled'] else ''} {r['image_size']} px batch {r['batch']}: "
                         f"engine {r['engine_images_per_s']} img/s, loop {r['raw_images_per_s']} img/s, "
                         f"ratio {r['engine_over_raw']}" + (f", MFU {r['mfu']}" if "mfu" in r else ""))
        elif name == "recipes" and "real_over_synthetic" in r:
            real = r["real"]
            memory = ", ".join(f"{v:.0f} MiB {k.removeprefix('peak_').removesuffix('_mib').replace('_', ' ')}"
                               for k, v in real.items() if k.startswith("peak_"))
            lines.append(f"  {r['recipe']}: {real['samples_per_s']:.0f} samples/s (step alone "
                         f"{r['synthetic']['samples_per_s']:.0f}: {r['real_over_synthetic']}), data wait "
                         f"{100 * r['data_wait_share']:.0f} % of a step, peak {memory}")
        elif name == "tests" and "tests" in r:
            lines.append(f"  {r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped")
            lines += [f"  FAILED {f['test']}: {f['message'][:300]}" for f in r["failures"]]
        elif name == "profile" and "raw" in r:
            for who in ("raw", "engine"):
                x = r[who]
                lines.append(f"  {r['model']} {who}: {x['wall_ms_per_step']} ms a step, device {x['device_ms_per_step']} ms, "
                             f"host {x['host_ms_per_step']} ms, runtime calls {x['runtime_calls_per_step']}")
        elif name == "fsdp":
            lines.append(f"  {r['run']}: exit {r['exit']}, finite {r['finite']}, last total {r['last_total']}, "
                         f"non-finite weights {r['nonfinite_weights']}")
        else:
            lines.append(f"  {json.dumps(r)[:400]}")
    return lines


def write_outputs(out: Path, work: Path, results: dict[str, Any], chosen: list[Stage]) -> list[str]:
    """The three files, rewritten after each stage: a call cut off from outside keeps what ended."""
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1))
    summary = [line for name, r in results["stages"].items() for line in summary_lines(name, r)]
    (out / "summary.txt").write_text("\n".join(summary + [f"total {results['seconds']} s"]) + "\n")
    with open(out / "stages.log", "w") as log:
        for stage in chosen:
            if (work / f"{stage.name}.log").is_file():
                log.write(f"======== {stage.name}\n{(work / f'{stage.name}.log').read_text(errors='replace')}\n")
    return summary


def run_side_by_side(chosen: list[Stage], args: argparse.Namespace, work: Path,
                     record: Callable[[Stage, dict[str, Any]], None]) -> None:
    """--dry-run: it times nothing, so the timed stages need not run alone; they start beside the
    checks as soon as env has ended (it builds fashion-mosaic, which they read). Recorded in the
    GPU run's order: the checks, then the timed stages."""
    order = [s for s in chosen if not s.timed] + [s for s in chosen if s.timed]
    running = {s.name: (*start(s, args, work), time.time()) for s in order if not s.timed}
    ended = {}
    if "env" in running:
        proc, deadline, log, started = running.pop("env")
        ended["env"] = finish(STAGES["env"], proc, deadline, log, work, started)
    running.update({s.name: (*start(s, args, work), time.time()) for s in order if s.timed})
    for stage in order:
        if stage.name not in ended:
            proc, deadline, log, started = running[stage.name]
            ended[stage.name] = finish(stage, proc, deadline, log, work, started)
        record(stage, ended[stage.name])


def run_all(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    names = args.stages.split(",") if args.stages else list(STAGES)
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        raise SystemExit(f"--stages: unknown {unknown}; the stages are {', '.join(STAGES)}")
    chosen = [STAGES[n] for n in names]
    results: dict[str, Any] = {"dry_run": args.dry_run, "stages": {}, "seconds": 0.0}
    t0 = time.time()

    def record(stage: Stage, result: dict[str, Any]) -> None:
        results["stages"][stage.name] = result
        results["seconds"] = round(time.time() - t0, 1)
        write_outputs(out, work, results, chosen)

    if args.dry_run:
        run_side_by_side(chosen, args, work, record)
    else:
        checks = [(s, *start(s, args, work), time.time()) for s in chosen if not s.timed]  # side by side
        for stage, proc, deadline, log, started in checks:
            record(stage, finish(stage, proc, deadline, log, work, started))
        for stage in (s for s in chosen if s.timed):  # alone: nothing else on the device while timed
            started = time.time()
            record(stage, finish(stage, *start(stage, args, work), work, started))
    print("\n".join(write_outputs(out, work, results, chosen)), flush=True)
    shutil.rmtree(work, ignore_errors=True)  # its logs are in stages.log, its results in gpu_check.json
    return 0 if all(r["status"] == "ok" for r in results["stages"].values()) else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="folder for gpu_check.json, summary.txt and stages.log")
    p.add_argument("--dry-run", action="store_true", help="the same stages on the CPU, with tiny sizes")
    p.add_argument("--stages", help=f"comma-separated subset of: {', '.join(STAGES)}")
    p.add_argument("--data", help="a folder holding FashionMNIST/raw/*.gz (becomes VISIONTRAIN_DATA_CACHE)")
    p.add_argument("--recipes", help=f"the recipes stage's recipes (default: {', '.join(SMALL_RECIPES)})")
    p.add_argument("--models", help="the throughput stage's cases, comma-separated: MODEL or MODEL+compiled "
                                    "(default: all)")
    p.add_argument("--budgets", default="", help="seconds per stage instead of the defaults: throughput=150,recipes=60")
    p.add_argument("--stage", help=argparse.SUPPRESS)     # the runner's own call of one stage
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    try:
        args.budgets = {k: int(v) for k, v in (item.split("=") for item in args.budgets.split(",") if item)}
    except ValueError:
        p.error(f"--budgets {args.budgets!r}: expected STAGE=SECONDS[,STAGE=SECONDS...]")
    if args.stage:
        STAGES[args.stage].run(args, Results(Path(args.work) / f"{args.stage}.json"))
        return
    if not args.out:
        p.error("--out is required")
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            p.error("no CUDA device here: use --dry-run for the CPU rehearsal")
    sys.exit(run_all(args))


if __name__ == "__main__":
    main()
