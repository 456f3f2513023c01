"""Between log points a training step reads nothing from the device on the host.

Every host read of a tensor value goes through one of the Tensor methods patched here; the test
counts them over 50 steps with log_every=50 and every optional part of the step switched on.
Data loading (CPU tensors made on the host, not device reads) is excluded from that count.

On a GPU (the tests are marked ``cuda``: benchmarks/gpu_check.py runs them there) CUDA itself
reports every synchronizing call in the same window, the batch's fetch and prefetch included, and
the ones no Tensor method sees too (an op whose output size depends on the data, a blocking copy).
"""
from __future__ import annotations

import contextlib
import traceback
import warnings
from pathlib import Path
from typing import Iterator

import pytest
import torch

from devices import ON_CUDA
from toy_task import ToyTask, toy_config
from visiontrain.core import config as C
from visiontrain.engine.loop.trainer import Trainer, next_micro_batches
from visiontrain.engine.protocols.hooks import Hook
from visiontrain.tasks import build_task

pytestmark = pytest.mark.cuda

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__",
         "__repr__", "__format__")


class ReadCounter:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.active, self.calls = False, []
        for name in READS:
            original = getattr(torch.Tensor, name)

            def wrapper(t, *args, _name=name, _orig=original, **kwargs):
                if self.active:
                    import traceback

                    self.calls.append((_name, "".join(traceback.format_stack(limit=6)[:-1])))
                return _orig(t, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, wrapper)


SYNC_WARNING = "called a synchronizing CUDA operation"
REPO = str(Path(__file__).resolve().parents[1]) + "/"


def short_path(filename: str) -> str:
    """A frame's file as a package path (torchvision/ops/boxes.py) or a repository path (src/...)."""
    return filename.rsplit("site-packages/", 1)[-1].removeprefix(REPO)


class CudaSyncs:
    """On CUDA, the synchronizing calls made while on (``torch.cuda.set_sync_debug_mode``), each as
    the Python frames that made it. The mode is "warn", not "error": an error would stop at the
    first sync and name only that one, the warnings list them all (ops in the backward pass are
    reported at their ``backward()`` call); the tests then require the list to be empty, or to
    name only a sync the code marks as intended."""

    def __init__(self) -> None:
        self.sites: list[str] = []

    def on(self) -> None:
        if ON_CUDA:
            torch.cuda.set_sync_debug_mode("warn")

    def off(self) -> None:
        if ON_CUDA:
            torch.cuda.set_sync_debug_mode("default")

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        with warnings.catch_warnings():
            warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")
            shown = warnings.showwarning

            def show(message, category, filename, lineno, file=None, line=None):
                if SYNC_WARNING not in str(message):
                    return shown(message, category, filename, lineno, file, line)
                frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
                self.sites.append(" <- ".join(f"{short_path(f.filename)}:{f.lineno} {f.name}"
                                              for f in reversed(frames[-5:])))

            warnings.showwarning = show
            try:
                yield
            finally:
                self.off()


def sync_report(sites: list[str]) -> str:
    """The synchronizing calls by place, most frequent first (a failure names each place once)."""
    from collections import Counter

    places = Counter(" <- ".join(site.split(" <- ")[:3]) for site in sites)
    return f"{len(sites)} synchronizing CUDA calls:\n" + "\n".join(f"{n:4d} x {place}" for place, n in places.most_common())


class Window(Hook):
    """Counts from the first step's start to the end of step ``steps`` (the log point comes after)."""

    def __init__(self, counter: ReadCounter, syncs: CudaSyncs, steps: int = 50) -> None:
        self.counter, self.syncs, self.steps = counter, syncs, steps

    def before_step(self) -> None:
        if self.trainer.step == 0:
            self.counter.active = True
            self.syncs.on()

    def after_step(self) -> None:
        if self.trainer.step == self.steps:
            self.counter.active = False
            self.syncs.off()


def run_counted(trainer_cls, cfg, task, monkeypatch, steps: int = 50) -> ReadCounter:
    """The Tensor reads of steps 1..``steps`` (``.calls``) and, on CUDA, their synchronizing CUDA
    calls (``.syncs``: empty on the CPU)."""
    counter, syncs = ReadCounter(monkeypatch), CudaSyncs()

    def fetch_uncounted(*args):  # loading is host work by nature: the seam the trainer gives
        active, counter.active = counter.active, False
        try:
            return next_micro_batches(*args)
        finally:
            counter.active = active

    trainer = trainer_cls(cfg, task, None, hooks=[Window(counter, syncs, steps)], fetch=fetch_uncounted)
    assert trainer.device.type == ("cuda" if ON_CUDA else "cpu")
    with syncs.recording():
        trainer.fit()
    assert trainer.step >= steps
    counter.syncs = syncs.sites
    return counter


ALL_ON = ["trainer.log_every=50", "trainer.max_steps=60", "trainer.accum_steps=2", "trainer.clip_grad=1.0",
          "trainer.precision=bf16", "trainer.nonfinite=skip", "ema.enabled=true", "ema.warmup=true",
          "eval.every=0", "checkpoint.every=0", "trainer.progress=plain"]


def test_classification_step_has_no_host_reads(monkeypatch):
    cfg = C.load_config("classify-fashion", ALL_ON + [
        "data.name=digits", "data.batch_size=8", "data.augment=basic", "trainer.epochs=2",
        "task.mixup_alpha=0.2", "task.cutmix_alpha=1.0", "task.label_smoothing=0.1",
        "schedules.weight_decay={shape: cosine, end: 0.1}", "schedules.ema_decay={shape: cosine, end: 0.999}"])
    counter = run_counted(Trainer, cfg, build_task(cfg), monkeypatch)
    assert counter.calls == [], counter.calls[0][1]
    assert counter.syncs == [], sync_report(counter.syncs)


def test_toy_step_fp16_has_no_host_reads(monkeypatch):
    cfg = toy_config(task__samples=2048, trainer__log_every=50, trainer__max_steps=55, trainer__precision="fp16",
                     trainer__clip_grad=1.0, trainer__nonfinite="skip", ema__enabled=True, eval__every=0,
                     checkpoint__every=0, optim__name="adamw")
    counter = run_counted(Trainer, cfg, ToyTask(cfg), monkeypatch)
    assert counter.calls == [], counter.calls[0][1]
    assert counter.syncs == [], sync_report(counter.syncs)


def test_counter_detects_a_read(monkeypatch):
    """The counter is not blind: a task that calls .item() in its loss is caught."""

    class Leaky(ToyTask):
        def losses(self, model, batch):
            out = super().losses(model, batch)
            out["mse"].item()
            return out

    cfg = toy_config(task__samples=2048, trainer__log_every=50, trainer__max_steps=50, eval__every=0,
                     checkpoint__every=0)
    counter = run_counted(Trainer, cfg, Leaky(cfg), monkeypatch)
    assert len(counter.calls) == 50 and counter.calls[0][0] == "item"
    if ON_CUDA:  # CUDA's own report is not blind either: each .item() of a device value waits for it
        assert len(counter.syncs) == 50 and all(" losses" in site for site in counter.syncs), sync_report(counter.syncs)


# ---------------------------------------------------------------- the detection recipes
# Host reads are counted in this process, so the data loads here too (no workers: their reads are
# not the step's); the COCO copy of fashion-mosaic exercises the reader.
DETECTION = ["data.name=coco", "data.batch_size=2", "data.num_workers=0", "trainer.epochs=1", "trainer.log_every=8",
             "trainer.max_steps=8", "eval.every=0", "checkpoint.every=0", "trainer.progress=plain"]


@pytest.fixture(scope="module")
def coco_root(tmp_path_factory):
    from detection_helpers import mosaic_coco

    return mosaic_coco(tmp_path_factory, 16, 4)


def count_detection(recipe: str, overrides: list[str], root, monkeypatch) -> ReadCounter:
    cfg = C.load_config(recipe, DETECTION + [f"data.root={root}", *overrides])
    return run_counted(Trainer, cfg, build_task(cfg), monkeypatch, steps=8)


def test_yolo_step_has_no_host_reads(coco_root, monkeypatch):
    from test_yolo import TINY

    counter = count_detection("detect-yolov3", TINY + ["task.size=64", "task.val_size=64", "task.multiscale_sizes=[64]",
                                                       "trainer.clip_grad=10.0", "trainer.nonfinite=skip",
                                                       "data.normalize_on_device=true"],
                              coco_root, monkeypatch)
    assert counter.calls == [], counter.calls[0][1]
    assert counter.syncs == [], sync_report(counter.syncs)


def test_detr_step_reads_once_per_batch_for_the_hungarian_matching(coco_root, monkeypatch):
    """DETR's matching runs scipy's linear_sum_assignment on the host: by nature one transfer per
    batch, the cost matrices of the whole batch together (models/detr_loss.py, match_many)."""
    counter = count_detection("detect-detr", [
        "task.backbone=resnet18", "task.hidden_dim=32", "task.dim_feedforward=64", "task.enc_layers=1",
        "task.dec_layers=1", "task.num_queries=5", "task.train_scales=[96]", "task.val_size=96", "task.max_size=128"],
        coco_root, monkeypatch)
    assert [name for name, _ in counter.calls] == ["cpu", "numpy"] * 8
    assert all("match_many" in where for _, where in counter.calls)
    # on CUDA: the same transfer, one wait per batch, and no other
    assert len(counter.syncs) == (8 if ON_CUDA else 0) and all("match_many" in s for s in counter.syncs), \
        sync_report(counter.syncs)


def test_faster_rcnn_step_reads_only_host_made_scalars(coco_root, monkeypatch):
    """The only reads are torchvision's MultiScaleRoIAlign turning feature-map sizes (Python ints)
    into its level scales through CPU tensors: host-only, no device value. (torchvision's R-CNN
    does sync implicitly on CUDA, through ops whose output size depends on the data, e.g. nonzero
    in its samplers; no patched method sees those.)"""
    from test_rcnn import TINY

    counter = count_detection("detect-faster-rcnn", TINY[:-2], coco_root, monkeypatch)
    # The poolers infer their scales at the model's first forward pass, which the first look's FLOP
    # count makes before the counted steps (then the steps read nothing at all).
    assert all("torchvision/ops/poolers.py" in where for _, where in counter.calls), \
        [where for _, where in counter.calls if "poolers.py" not in where][:1]
    cfg = C.load_config("detect-faster-rcnn", DETECTION + [f"data.root={coco_root}", *TINY[:-2],
                                                           "trainer.summary=false"])
    unlooked = run_counted(Trainer, cfg, build_task(cfg), monkeypatch, steps=8)
    assert unlooked.calls and all("torchvision/ops/poolers.py" in where for _, where in unlooked.calls)
    # On CUDA torchvision's R-CNN waits for the device by its design (above); the project's own code
    # adds no wait of its own: every synchronizing call is made inside torchvision.
    assert all("torchvision/" in site for site in counter.syncs), \
        sync_report([s for s in counter.syncs if "torchvision/" not in s])


def test_mask_rcnn_step_reads_only_host_made_scalars(coco_root, monkeypatch):
    """segment-mask-rcnn's step reads what the Faster R-CNN step reads (the poolers' scales, above)
    and nothing more: the mask targets travel with the boxes to torchvision's mask loss, which crops
    them to the RoIs on the device; on CUDA every wait is torchvision's own."""
    from test_rcnn import TINY

    counter = count_detection("segment-mask-rcnn", TINY[:-2], coco_root, monkeypatch)
    assert all("torchvision/ops/poolers.py" in where for _, where in counter.calls), \
        [where for _, where in counter.calls if "poolers.py" not in where][:1]
    assert all("torchvision/" in site for site in counter.syncs), \
        sync_report([s for s in counter.syncs if "torchvision/" not in s])


def test_dino_step_has_no_host_reads(monkeypatch):
    """ssl-dino's batched multi-crop: in the step on CUDA (``task.multicrop_in=auto``), in the
    loader on the CPU; the teacher (the EMA), the centre and the loss stay on the device either way."""
    from test_dino import NO_WARMUP, TINY

    cfg = C.load_config("ssl-dino", TINY + NO_WARMUP + [
        "trainer.log_every=20", "trainer.max_steps=25", "trainer.epochs=1", "eval.every=0", "eval.at_start=false",
        "checkpoint.every=0"])
    counter = run_counted(Trainer, cfg, build_task(cfg), monkeypatch, steps=20)
    assert counter.calls == [], counter.calls[0][1]
    assert counter.syncs == [], sync_report(counter.syncs)

