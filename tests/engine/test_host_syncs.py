"""Between log points a training step reads nothing from the device on the host.

Every host read of a tensor value goes through one of the Tensor methods patched here; the test
counts them over 50 steps with log_every=50 and every optional part of the step switched on.
Data loading (CPU tensors made on the host, not device reads) is excluded from that count.

On a GPU (the tests are marked ``cuda``: benchmarks/gpu_check.py runs them there) CUDA itself
reports every synchronizing call in the same window, the batch's fetch and prefetch included, and
the ones no Tensor method sees too (an op whose output size depends on the data, a blocking copy).
"""
from __future__ import annotations

import pytest

from devices import ON_CUDA
from host_reads import ALL_ON, ReadCounter, run_counted, sync_report
from tiny import DINO, DINO_NO_WARMUP, RCNN, YOLO
from toy_task import ToyTask, toy_config
from visiontrain.core import config as C
from visiontrain.engine.loop.trainer import Trainer
from visiontrain.tasks import build_task

pytestmark = pytest.mark.cuda


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
def coco_root(mosaic_coco):
    return mosaic_coco(16, 4)


def count_detection(recipe: str, overrides: list[str], root, monkeypatch) -> ReadCounter:
    cfg = C.load_config(recipe, DETECTION + [f"data.root={root}", *overrides])
    return run_counted(Trainer, cfg, build_task(cfg), monkeypatch, steps=8)


def test_yolo_step_has_no_host_reads(coco_root, monkeypatch):
    counter = count_detection("detect-yolov3", YOLO + ["task.size=64", "task.val_size=64", "task.multiscale_sizes=[64]",
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
    counter = count_detection("detect-faster-rcnn", RCNN[:-2], coco_root, monkeypatch)
    # The poolers infer their scales at the model's first forward pass, which the first look's FLOP
    # count makes before the counted steps (then the steps read nothing at all).
    assert all("torchvision/ops/poolers.py" in where for _, where in counter.calls), \
        [where for _, where in counter.calls if "poolers.py" not in where][:1]
    cfg = C.load_config("detect-faster-rcnn", DETECTION + [f"data.root={coco_root}", *RCNN[:-2],
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
    counter = count_detection("segment-mask-rcnn", RCNN[:-2], coco_root, monkeypatch)
    assert all("torchvision/ops/poolers.py" in where for _, where in counter.calls), \
        [where for _, where in counter.calls if "poolers.py" not in where][:1]
    assert all("torchvision/" in site for site in counter.syncs), \
        sync_report([s for s in counter.syncs if "torchvision/" not in s])


def test_dino_step_has_no_host_reads(monkeypatch):
    """ssl-dino's batched multi-crop: in the step on CUDA (``task.multicrop_in=auto``), in the
    loader on the CPU; the teacher (the EMA), the centre and the loss stay on the device either way."""
    cfg = C.load_config("ssl-dino", DINO + DINO_NO_WARMUP + [
        "trainer.log_every=20", "trainer.max_steps=25", "trainer.epochs=1", "eval.every=0", "eval.at_start=false",
        "checkpoint.every=0"])
    counter = run_counted(Trainer, cfg, build_task(cfg), monkeypatch, steps=20)
    assert counter.calls == [], counter.calls[0][1]
    assert counter.syncs == [], sync_report(counter.syncs)



def test_semantic_step_has_no_host_reads(monkeypatch):
    """segment-semantic's step (its transforms, the aux head, class weights, normalisation on the
    device) with every optional part of the step on: the pixel losses read nothing back."""
    weights = ",".join(["0.5"] + ["1.0"] * 10)
    cfg = C.load_config("segment-semantic", ALL_ON + [
        "data.limit_train=32", "data.limit_val=2", "data.batch_size=2", "data.num_workers=0", "task.crop=64",
        "task.train_sizes=[64,96]", f"task.class_weights=[{weights}]", "data.normalize_on_device=true",
        "trainer.log_every=8", "trainer.max_steps=8"])
    counter = run_counted(Trainer, cfg, build_task(cfg), monkeypatch, steps=8)
    assert counter.calls == [], counter.calls[0][1]
    assert counter.syncs == [], sync_report(counter.syncs)
