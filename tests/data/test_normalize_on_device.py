"""data.normalize_on_device: the loader hands over uint8 and the step normalises on the device.

The device path must give the model what the CPU path gives it (same augmentation, same pixels to
float rounding, padding 0), for every recipe family that supports it, and a run must train the same.
The tests marked ``cuda`` normalise on the GPU when there is one (tests/support/devices.py).
"""
from __future__ import annotations

import json

import pytest
import torch

from devices import TEST_DEVICE
from visiontrain.core import config as C
from visiontrain.data.normalize import NormalizeOnDevice
from visiontrain.engine.loop.trainer import Trainer
from visiontrain.tasks import build_task

# The subject is the same run with the CPU or the device normalising: loaded in-process, no evaluation.
BASE = ["data.batch_size=4", "data.num_workers=0", "trainer.epochs=1", "trainer.progress=plain", "eval.every=0",
        "checkpoint.every=0"]
RECIPES = {
    "detect-detr": ["task.train_scales=[96,128]", "task.val_size=96", "task.max_size=160", "task.crop_resize=[96]",
                    "task.crop_min=64", "task.crop_max=96"],
    "detect-yolov3": ["task.letterbox=true", "task.size=96", "task.val_size=96", "task.multiscale_sizes=[96]"],
    "detect-faster-rcnn": ["task.train_scales=[96,128]", "task.val_size=96", "task.max_size=160"],
}


@pytest.fixture(scope="module")
def coco_root(mosaic_coco):
    return mosaic_coco(8, 2)


def first_batch(recipe: str, overrides: list[str], on_device: bool):
    cfg = C.load_config(recipe, BASE + overrides + [f"data.normalize_on_device={str(on_device).lower()}"])
    task = build_task(cfg)
    data = task.build_data()
    from visiontrain.engine.setup.loaders import loaders
    from visiontrain.engine.parallel.distributed import DistInfo

    source, _ = loaders(data, cfg, DistInfo(), torch.device("cpu"))
    return next(iter(source.batches(0))), task.device_transform(channels_last=False)


def on_test_device(batch):
    from visiontrain.engine.step.pipeline import to_device

    return to_device(batch, TEST_DEVICE)


def on_cpu(batch):
    from visiontrain.engine.step.pipeline import to_device

    return to_device(batch, torch.device("cpu"))


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_device_normalisation_gives_the_cpu_pipelines_batch(recipe, coco_root):
    overrides = RECIPES[recipe] + ["data.name=coco", f"data.root={coco_root}"]
    (cpu_images, cpu_mask, cpu_targets), none = first_batch(recipe, overrides, on_device=False)
    raw, transform = first_batch(recipe, overrides, on_device=True)
    assert none is None and transform is not None
    assert raw[0].dtype == torch.uint8 and cpu_images.dtype == torch.float32  # a quarter of the bytes to copy
    images, mask, targets = on_cpu(transform(on_test_device(raw)))
    assert torch.equal(mask, cpu_mask) and mask.any(), "the batch is padded: the padding must be checked too"
    torch.testing.assert_close(images, cpu_images, atol=2e-6, rtol=0)
    assert images[mask.unsqueeze(1).expand_as(images)].abs().max() == 0  # padding 0, as on the CPU
    for a, b in zip(targets, cpu_targets):
        assert torch.equal(a["boxes"], b["boxes"]) and torch.equal(a["labels"], b["labels"])


@pytest.mark.cuda
def test_image_folder_normalises_on_the_device(tmp_path):
    from dataset_trees import build_png_tree

    build_png_tree(tmp_path, {"train": ["a", "b"], "val": ["a", "b"]}, n=4)
    overrides = ["data.name=image-folder", f"data.root={tmp_path}", "data.image_size=16", "data.augment=basic",
                 "task.model=small_cnn"]
    (cpu_images, cpu_labels), _ = first_batch("classify-fashion", overrides, on_device=False)
    raw, transform = first_batch("classify-fashion", overrides, on_device=True)
    assert raw[0].dtype == torch.uint8
    images, labels = on_cpu(transform(on_test_device(raw)))
    torch.testing.assert_close(images, cpu_images, atol=2e-6, rtol=0)
    assert torch.equal(labels, cpu_labels)


def test_in_memory_datasets_refuse_it():
    """An in-memory dataset has no uint8 pipeline to hand over: the key is not one of its source's. The
    sources that read it are named in sorted order, whatever order their modules were imported in."""
    with pytest.raises(C.ConfigError, match=r"unknown config key 'data.normalize_on_device' \(data.name 'digits' "
                                            r"does not read it; ade20k, cityscapes, cityscapes-panoptic, coco, "
                                            r"coco-panoptic, fashion-mosaic, image-folder, neon-trees, segmentation-folder, "
                                            r"shards, voc, voc-segmentation, yolo do\)"):
        C.load_config("classify-fashion", ["data.name=digits", "data.normalize_on_device=true"])


def test_float_input_is_refused_by_name():
    with pytest.raises(TypeError, match="normalize_on_device expects uint8.*float32"):
        NormalizeOnDevice()(torch.zeros(1, 3, 4, 4))


@pytest.mark.cuda
def test_channels_last_is_kept():
    x = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8, device=TEST_DEVICE)
    x = x.contiguous(memory_format=torch.channels_last)
    assert NormalizeOnDevice()(x).is_contiguous(memory_format=torch.channels_last)


@pytest.mark.cuda
def test_a_yolo_run_trains_the_same_either_way(coco_root, tmp_path):
    from tiny import YOLO as TINY

    totals = {}
    for on_device in (False, True):
        cfg = C.load_config("detect-yolov3", BASE + TINY + RECIPES["detect-yolov3"] + [
            "data.name=coco", f"data.root={coco_root}", "trainer.max_steps=3", "trainer.log_every=1",
            "data.batch_size=2",
            f"data.normalize_on_device={str(on_device).lower()}"])
        run = tmp_path / str(on_device)
        Trainer(cfg, build_task(cfg), run).fit()
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        totals[on_device] = [r["total"] for r in rows if r["kind"] == "train"]
    assert len(totals[True]) == 3
    assert totals[True] == pytest.approx(totals[False], rel=1e-4)
