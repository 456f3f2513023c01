"""Panoptic data: COCO's panoptic format read as its files say (things as instances, crowds as no
instance, stuff and things in the semantic map, VOID ignored), fashion-mosaic's panoptic annotation
agreeing with its instance annotation, bad id PNGs under data.on_bad_annotation with one line naming
the file, and masks and semantic maps that stay on their pixels through the recipe's transforms."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from panoptic_trees import GREY, scene, write_coco_panoptic
from segmentation_trees import interior
from visiontrain.core import config as C
from visiontrain.data.detection.images import BadAnnotationError
from visiontrain.data.detection.splits import build_detection_splits
from visiontrain.data.segmentation.panoptic import build_panoptic_splits
from visiontrain.tasks.panoptic import PanopticTask


def cfg(*overrides: str) -> C.Config:
    return C.load_config("segment-panoptic", list(overrides))


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return write_coco_panoptic(tmp_path_factory.mktemp("panoptic") / "coco")


def coco_splits(root: Path, *overrides: str):
    return build_panoptic_splits(cfg("data.name=coco-panoptic", f"data.root={root}", "data.train_split=train",
                                     "data.val_split=val", *overrides).data)


def test_coco_panoptic_gives_things_as_instances_and_stuff_in_the_semantic_map(tree):
    train, val = coco_splits(tree)
    assert (len(train), len(val)) == (6, 3)
    assert train.class_names == ["box", "bar"] and train.categories.semantic_names == ["things", "sky", "ground"]
    image, target = train.load(1)
    ids, segments = scene(1)
    assert target["labels"].tolist() == [0, 0, 1]  # the things in segments_info's order, 0-based
    for mask, box, s in zip(target["masks"], target["boxes"], segments[2:]):
        assert torch.equal(mask.bool(), torch.from_numpy(ids == s["id"]))
        x, y, w, h = s["bbox"]
        assert box.tolist() == [x, y, x + w, y + h]  # pixel edges, as COCO's boxes
    semantic = target["semantic"].as_subclass(torch.Tensor)
    assert set(semantic[torch.from_numpy(ids >= 10)].tolist()) == {0}  # every thing: class 0
    assert set(semantic[:20, :2].flatten().tolist()) == {1} and semantic[-1].eq(255).all()  # sky; VOID ignored
    truth, truth_segments = val.truth(0)
    assert np.array_equal(truth, scene(0)[0]) and len(truth_segments) == 5


def test_a_crowd_is_no_instance_but_its_pixels_are_things(tmp_path):
    root = write_coco_panoptic(tmp_path / "coco", {"train": 2, "val": 1})
    ann_file = root / "annotations" / "panoptic_train.json"
    coco = json.loads(ann_file.read_text())
    coco["annotations"][0]["segments_info"][2]["iscrowd"] = 1
    ann_file.write_text(json.dumps(coco))
    train, _ = coco_splits(root)
    _, target = train.load(0)
    assert len(target["labels"]) == 2
    crowd = torch.from_numpy(scene(0)[0] == 10)
    assert target["semantic"].as_subclass(torch.Tensor)[crowd].eq(0).all()


@pytest.mark.parametrize("fault, said", [("missing", "does not exist"), ("size", "is 30x20 (WxH)"),
                                         ("colour", "is in the id map but not in segments_info")])
def test_a_bad_id_png_is_an_error_naming_it_or_is_skipped(tmp_path, fault, said):
    root = write_coco_panoptic(tmp_path / "coco", {"train": 3, "val": 1})
    png = root / "annotations" / "panoptic_train" / "0001.png"
    if fault == "missing":
        png.unlink()
    elif fault == "size":
        Image.new("RGB", (30, 20)).save(png)
    else:
        Image.new("RGB", (64, 48), (77, 0, 0)).save(png)
    if fault == "missing":  # found when the split is read
        with pytest.raises(ValueError, match=f"{png}.*{said}|{said}.*{png}"):
            coco_splits(root)
        train, _ = coco_splits(root, "data.on_bad_annotation=skip", "data.max_skipped_share=1")
        assert len(train) == 2 and train.policy.skipped == {"missing annotation": 1}
        return
    train, _ = coco_splits(root)  # found when the sample is loaded: the PNGs are not read up front
    with pytest.raises(BadAnnotationError, match=re.escape(said)) as err:
        train[1]
    assert str(png) in str(err.value) and "data.on_bad_annotation=skip" in str(err.value)
    train, _ = coco_splits(root, "data.on_bad_annotation=skip")
    assert train[1][1]["image_id"] == 3  # the next image in its place


def test_fashion_mosaic_panoptic_agrees_with_its_instance_annotation():
    c = cfg("data.limit_train=6", "data.limit_val=2")
    train, _ = build_panoptic_splits(c.data)
    objects, _ = build_detection_splits(c.data, masks=True)
    assert train.categories.semantic_names == ["things", "wall", "floor"]
    for i in range(6):
        image, target = train.load(i)
        _, want = objects.load(i)
        assert torch.equal(target["masks"], want["masks"]) and torch.equal(target["labels"], want["labels"])
        assert torch.equal(target["boxes"].as_subclass(torch.Tensor), want["boxes"].as_subclass(torch.Tensor))
        semantic = target["semantic"].as_subclass(torch.Tensor)
        assert torch.equal(semantic == 0, want["masks"].bool().any(0))  # the things' pixels, and only those
        assert (semantic != 255).all()  # no VOID in fashion-mosaic


def test_masks_and_the_semantic_map_stay_on_their_pixels_through_the_recipes_transforms(tree):
    """The recipe's flip and multi-scale resize (uint8 images: normalised on the device): wherever a
    thing's mask is, a resized source pixel inside it, the image holds its category's grey; wherever the semantic map
    names a stuff class, the stuff's grey; the boxes are the masks' boxes (to a source pixel: a box is
    scaled, a mask resized by nearest neighbour)."""
    task = PanopticTask(cfg("data.name=coco-panoptic", f"data.root={tree}", "data.train_split=train",
                            "data.val_split=val", "data.normalize_on_device=true"))
    train = task.build_data().train
    stuff_grey = torch.tensor([-1, GREY[3], GREY[4], -1])  # semantic class -> grey (things: checked per mask)
    thing_grey = torch.tensor([GREY[1], GREY[2]])
    torch.manual_seed(0)
    for _ in range(2):
        for i in range(len(train)):
            image, target = train[i]
            grey = image.as_subclass(torch.Tensor)[0].long()
            semantic = target["semantic"].as_subclass(torch.Tensor).long()
            assert grey.shape == semantic.shape and min(grey.shape) in task.cfg.task.train_scales
            reach = grey.shape[0] // 48 + 2  # a source pixel, upscaled, blends this far (bilinear)
            stuff = (semantic == 1) | (semantic == 2)
            inside = stuff & interior(semantic, reach)
            assert (grey[inside] - stuff_grey[semantic[inside]]).abs().max() <= 2
            for mask, label, box in zip(target["masks"], target["labels"], target["boxes"]):
                mask = mask.as_subclass(torch.Tensor).long()
                core = interior(mask, reach) & mask.bool()
                assert (grey[core] - thing_grey[label]).abs().max() <= 2
                rows, cols = mask.any(1).nonzero().flatten(), mask.any(0).nonzero().flatten()
                edges = [int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1]
                assert box.tolist() == pytest.approx(edges, abs=grey.shape[0] / 48)  # a source pixel, resized


def test_data_cache_ram_keeps_each_decoded_image_and_gives_the_same_samples():
    plain, _ = build_panoptic_splits(cfg("data.limit_train=3", "data.limit_val=2").data)
    cached, _ = build_panoptic_splits(cfg("data.limit_train=3", "data.limit_val=2", "data.cache=ram").data)
    assert cached.cache is not None and cached.cache.get(0) is None
    for _ in range(2):  # decoded, then read back from the cache
        for i in range(3):
            (a, want), (b, got) = plain.load(i), cached.load(i)
            assert torch.equal(a, b) and torch.equal(want["semantic"], got["semantic"])
    assert torch.equal(cached.cache.get(0), plain.load(0)[0].as_subclass(torch.Tensor))


@pytest.mark.parametrize("key", ["annotation", "image"])
def test_a_file_name_outside_the_dataset_is_refused_before_any_file_is_opened(tmp_path, key, monkeypatch):
    root = write_coco_panoptic(tmp_path / "coco", {"train": 2, "val": 1})
    ann_file = root / "annotations" / "panoptic_train.json"
    coco = json.loads(ann_file.read_text())
    (coco["annotations"] if key == "annotation" else coco["images"])[1]["file_name"] = "../../secret.png"
    ann_file.write_text(json.dumps(coco))
    opened = []
    monkeypatch.setattr("visiontrain.data.segmentation.panoptic.inspect_images",
                        lambda paths, **kw: opened.extend(paths) or iter(()))
    with pytest.raises(ValueError, match="'../../secret.png' names a file outside the dataset"):
        coco_splits(root)
    assert not opened
