"""Shards carry everything a task reads (issues 51 and 53): `visiontrain shard` writes, for the
recipe's task, each object's mask and crowd flag (segment-mask-rcnn), the label map
(segment-semantic: ``KEY.seg.png``) or the id PNG and its segments_info (segment-panoptic:
``KEY.pan.png``), and `data.name=shards` gives the samples the files give: masks and crowd flags
equal to the folder's, label maps bit-equal, panoptic instances, masks, boxes and semantic maps equal.
A corrupt label PNG in a shard is one line naming its shard and key (or, under
data.on_bad_annotation=skip, the next sample stands in); a detector's aspect-ratio groups are formed
from shards, a fixed number of batches an epoch, and a resumed sampler gives the rest of the epoch.

The writes run in this process (``procs.in_process``); the end-to-end run is a process of its own,
segment-semantic as shipped but for its length and size (tests/support/shipped.py's rule)."""
from __future__ import annotations

import dataclasses
import io
import json
import logging
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import procs
from detection_helpers import MASK_SCENES, masks_coco
from panoptic_trees import write_coco_panoptic
from procs import in_process
from segmentation_dataset_trees import write_ade20k, write_cityscapes
from segmentation_trees import write_segmentation_folder, write_voc_segmentation
from visiontrain.core import config as C
from visiontrain.data.detection import masks as M
from visiontrain.data.detection.images import BadAnnotationError
from visiontrain.data.detection.splits import build_detection_splits
from visiontrain.data.segmentation.panoptic import build_panoptic_splits
from visiontrain.data.segmentation.readers import build_semantic_splits
from visiontrain.data.shards.raw import RawSample, png_bytes, raw_data
from visiontrain.data.shards.reader import shard_index
from visiontrain.data.shards.sampler import ShardBatchSampler
from visiontrain.data.shards.writer import write_shards, written_order


W0, H0 = MASK_SCENES[0][:2]  # the first scene's image: 64 x 48


def shard(capsys, recipe: str, out: Path, *overrides: str) -> dict:
    """`visiontrain shard RECIPE OVERRIDES --out OUT` in this process: its JSON line."""
    code, stdout, err = in_process(capsys, "shard", recipe, *overrides, "--out", str(out), "--shard-size", "20KB")
    assert code == 0, err[-2000:]
    shard_index.cache_clear()  # a test may write a directory another one read
    return json.loads(stdout.strip().splitlines()[-1])


def from_shards(recipe: str, out: Path, *overrides: str) -> C.Config:
    return C.load_config(recipe, ["data.name=shards", f"data.shards={out}", *overrides])


def pairs(folder) -> list[tuple[int, int]]:
    """(folder index, shard index) of each sample: the shards hold the reader's samples in ``written_order``."""
    return [(int(i), position) for position, i in enumerate(written_order(len(folder)))]


def ground_truth(ds) -> list[tuple]:
    """What COCO evaluation scores against, image by image (the annotations' ids are their order's)."""
    return sorted((a["image_id"], a["category_id"], a["bbox"], a["iscrowd"], a["area"],
                   a.get("segmentation", {}).get("counts")) for a in ds.coco_ground_truth()["annotations"])


# ------------------------------------------------------------------------------ instance masks
def test_masks_and_crowd_flags_from_shards_are_the_folders(tmp_path, capsys):
    crowd = np.zeros((1, H0, W0), np.uint8)
    crowd[0, 30:44, 2:20] = 1
    extra = [{"id": 99, "image_id": 1, "category_id": 3, "iscrowd": 1, "bbox": [2, 30, 18, 14],
              "segmentation": {"size": [H0, W0], "counts": M.encode(crowd)[0]}}]
    root = masks_coco(tmp_path / "coco", MASK_SCENES, extra=extra)
    keys = ("data.name=coco", f"data.root={root}", "data.train_split=train", "data.val_split=val")
    summary = shard(capsys, "segment-mask-rcnn", tmp_path / "shards", *keys)  # the recipe's task reads masks
    assert summary["kind"] == "detection"
    for masks in (True, False):  # without masks (a box detector on the same shards): no crowd region, as a folder
        folder = build_detection_splits(C.load_config("segment-mask-rcnn", list(keys)).data, masks=masks)
        shards = build_detection_splits(from_shards("segment-mask-rcnn", tmp_path / "shards").data, masks=masks)
        for f, s in zip(folder, shards):
            for i, j in pairs(f):
                a, b = f.records[i], s.records[j]
                assert a.masks == b.masks and np.array_equal(a.boxes, b.boxes) and np.array_equal(a.ann_ids, b.ann_ids)
                assert (a.crowd is None) == (b.crowd is None) and (a.crowd is None or np.array_equal(a.crowd, b.crowd))
                if masks:  # the decoded masks the task trains on
                    assert torch.equal(f.load(i)[1]["masks"], s.load(j)[1]["masks"])
            assert ground_truth(f) == ground_truth(s)  # mask AP's ground truth, crowd regions its ignore regions
        if masks:
            assert sum(r.crowd.sum() for r in shards[0].records) == 1
    with pytest.raises(ValueError, match="holds detection shards .*; this task trains on semantic shards"):
        build_semantic_splits(from_shards("segment-semantic", tmp_path / "shards").data)  # another family's
    boxes_only = tmp_path / "boxes"
    shard(capsys, "detect-faster-rcnn", boxes_only, *keys)  # a task of boxes: its shards hold no masks
    with pytest.raises(ValueError, match="holds no instance masks.*segment-mask-rcnn"):
        build_detection_splits(from_shards("segment-mask-rcnn", boxes_only).data, masks=True)


def test_a_mask_whose_runs_pass_its_image_is_refused_before_any_decode(tmp_path, capsys):
    """A downloaded samples file is data: pycocotools writes past its buffer on such runs."""
    root = masks_coco(tmp_path / "coco", MASK_SCENES[:2])
    out = tmp_path / "shards"
    shard(capsys, "segment-mask-rcnn", out, "data.name=coco", f"data.root={root}", "data.train_split=train",
          "data.val_split=val")
    name = json.loads((out / "index.json").read_text())["splits"]["train"]["samples_file"]
    with np.load(out / name) as npz:
        arrays = {k: npz[k] for k in npz.files}
    big = M.encode(np.ones((1, 2 * H0, 2 * W0), np.uint8))[0].encode()  # the runs of an image 4 times as large
    first = int(arrays["mask_length"][0])
    arrays["mask_bytes"] = np.concatenate([np.frombuffer(big, np.uint8), arrays["mask_bytes"][first:]])
    arrays["mask_length"][0] = len(big)
    with open(out / name, "wb") as f:
        np.savez(f, **arrays)
    shard_index.cache_clear()
    with pytest.raises(ValueError, match=r"train-000000\.tar sample 000000000: the mask of object 0 is a compressed "
                                         r"RLE of \d+ pixels for \d+"):
        build_detection_splits(from_shards("segment-mask-rcnn", out).data, masks=True)


# ------------------------------------------------------------------------------ semantic label maps
SEMANTIC = {
    "folder": lambda root: ("data.name=segmentation-folder", f"data.root={write_segmentation_folder(root)}"),
    "voc": lambda root: ("data.name=voc-segmentation", f"data.root={write_voc_segmentation(root)}"),
    "cityscapes": lambda root: ("data.name=cityscapes", f"data.root={write_cityscapes(root)}"),
    # ADE20K's 0 ("other") to the ignore index, here 254: the shards write it as 255
    "ade20k": lambda root: ("data.name=ade20k", f"data.root={write_ade20k(root)}", "data.ignore_index=254"),
}


@pytest.mark.parametrize("source", list(SEMANTIC))
def test_label_maps_from_shards_are_bit_equal_to_the_readers(tmp_path, capsys, source):
    keys = SEMANTIC[source](tmp_path / source)
    summary = shard(capsys, "segment-semantic", tmp_path / "shards", *keys)
    index = json.loads((tmp_path / "shards" / "index.json").read_text())
    assert summary["kind"] == index["kind"] == "semantic" and index["ignore_index"] == 255
    folder = build_semantic_splits(C.load_config("segment-semantic", list(keys)).data)
    names = ["data.train_split=training", "data.val_split=validation"] if source == "ade20k" else []  # ADE20K's
    shards = build_semantic_splits(from_shards("segment-semantic", tmp_path / "shards", *names).data)
    ignore = 254 if source == "ade20k" else 255
    for f, s in zip(folder, shards):
        assert len(f) == len(s) and f.class_names == s.class_names
        for i, j in pairs(f):
            (image, labels), (shard_image, shard_labels) = f.load(i), s[j]
            want = labels.as_subclass(torch.Tensor).clone()
            want[want == ignore] = 255
            assert torch.equal(image, shard_image)
            assert shard_labels.dtype == torch.uint8 and torch.equal(shard_labels.as_subclass(torch.Tensor), want)
            assert (want == 255).any() == (source != "folder")  # VOC's borders, Cityscapes' ids, ADE20K's 0


def zero_member(out: Path, split: str, ext: str, key: str = "") -> list[str]:
    """Every ``KEY.ext`` member of a split's shards (``key``: that sample's alone) overwritten with
    zeros in place, the index and the samples file still right: the ``SHARD sample KEY`` of each."""
    index = json.loads((out / "index.json").read_text())
    named = []
    for entry in index["splits"][split]["shards"]:
        with tarfile.open(out / entry["name"]) as tar:
            members = [m for m in tar.getmembers() if m.name.endswith(f".{ext}") and m.name.startswith(key)]
        with open(out / entry["name"], "r+b") as f:
            for m in members:
                f.seek(m.offset_data)
                f.write(b"\0" * m.size)
                named.append(f"{out / entry['name']} sample {m.name.split('.')[0]}")
    shard_index.cache_clear()
    return named


def test_a_corrupt_label_png_in_a_shard_is_one_line_naming_its_shard_and_key(tmp_path, capsys):
    keys = ("data.name=segmentation-folder", f"data.root={write_segmentation_folder(tmp_path / 'folder')}")
    out = tmp_path / "shards"
    shard(capsys, "segment-semantic", out, *keys)
    (name,) = zero_member(out, "train", "seg.png", key="000000003")
    train, _ = build_semantic_splits(from_shards("segment-semantic", out).data)
    with pytest.raises(BadAnnotationError) as err:
        train[3]
    assert str(err.value) == (f"{out} split train: label map {name} seg.png cannot be read: not an image file "
                              f"(set data.on_bad_annotation=skip to drop it)")
    train, _ = build_semantic_splits(from_shards("segment-semantic", out, "data.on_bad_annotation=skip").data)
    assert torch.equal(train[3][1], train[4][1])  # the next sample stands in (a warning names the bad one)
    # through `fit`, whichever sample comes first: one line (data.num_workers=0: in this process, for speed)
    overwritten = zero_member(out, "train", "seg.png")
    code, _, err = in_process(capsys, "fit", "segment-semantic", "data.name=shards", f"data.shards={out}",
                              "data.num_workers=0", "data.batch_size=2", "trainer.max_steps=1", "--run-dir",
                              str(tmp_path / "run"))
    errors = [line for line in err.splitlines() if line.startswith("visiontrain: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert any(f"label map {name} seg.png cannot be read" in errors[0] for name in overwritten), errors


def test_a_label_map_value_that_is_no_class_is_named_when_loaded(tmp_path):
    """Shards written by another tool hold a label value that is no class (a cross-entropy index out
    of range, on a GPU a device-side assert): named with its shard, key and value instead."""
    root = write_segmentation_folder(tmp_path / "folder", {"train": 2, "val": 1})
    raw, _ = raw_data(C.load_config("segment-semantic", ["data.name=segmentation-folder", f"data.root={root}"]).data,
                      ["train", "val"])
    written = raw.splits[0].load

    def with_a_7(i: int) -> RawSample:
        sample = written(i)
        labels = np.asarray(Image.open(io.BytesIO(dict(sample.extra)["seg.png"]))).copy()
        labels[0, 0] = 7
        return sample._replace(extra=(("seg.png", png_bytes(labels)),))
    raw.splits[0] = dataclasses.replace(raw.splits[0], load=with_a_7)
    out = tmp_path / "shards"
    write_shards(raw, out, 10**6, {})
    shard_index.cache_clear()
    train, _ = build_semantic_splits(from_shards("segment-semantic", out).data)
    with pytest.raises(BadAnnotationError, match=rf"{out}/train-000000\.tar sample 000000000 seg\.png: value 7 is no "
                                                 r"class \(0\.\.2\) and not the ignore index 255"):
        train[0]


# ------------------------------------------------------------------------------ panoptic
def test_panoptic_samples_from_shards_are_the_folders(tmp_path, capsys):
    root = write_coco_panoptic(tmp_path / "coco")
    coco = json.loads((root / "annotations" / "panoptic_train.json").read_text())
    coco["annotations"][1]["segments_info"][3]["iscrowd"] = 1  # a crowd: no instance, its pixels things
    (root / "annotations" / "panoptic_train.json").write_text(json.dumps(coco))
    keys = ("data.name=coco-panoptic", f"data.root={root}", "data.train_split=train", "data.val_split=val")
    summary = shard(capsys, "segment-panoptic", tmp_path / "shards", *keys)
    assert summary["kind"] == "panoptic"
    folder = build_panoptic_splits(C.load_config("segment-panoptic", list(keys)).data)
    shards = build_panoptic_splits(from_shards("segment-panoptic", tmp_path / "shards").data)
    for f, s in zip(folder, shards):
        assert f.categories == s.categories and s.aspect_ratios() == [f.aspect_ratios()[i] for i, _ in pairs(f)]
        for i, j in pairs(f):
            (image, target), (shard_image, shard_target) = f.load(i), s.load(j)
            assert torch.equal(image, shard_image) and target["image_id"] == shard_target["image_id"]
            for key in ("boxes", "labels", "masks", "semantic", "orig_size"):
                assert torch.equal(target[key].as_subclass(torch.Tensor), shard_target[key].as_subclass(torch.Tensor))
            (ids, segments), (shard_ids, shard_segments) = f.truth(i), s.truth(j)  # what PQ is scored against
            assert np.array_equal(ids, shard_ids) and segments == shard_segments
            assert s.index_of[target["image_id"]] == j
    zero_member(tmp_path / "shards", "val", "pan.png")
    _, val = build_panoptic_splits(from_shards("segment-panoptic", tmp_path / "shards").data)
    with pytest.raises(BadAnnotationError, match=r"id PNG .*val-\d+\.tar sample 000000000 pan\.png cannot be read: "
                                                 r"not an image file \(set data\.on_bad_annotation=skip"):
        val[0]


# ------------------------------------------------------------------------------ aspect-ratio groups
SIZES = [7, 13, 5, 11, 9, 3, 8, 12, 4]  # 72 samples in 9 shards of uneven sizes
GROUPS = [int(g) for g in np.random.default_rng(0).random(sum(SIZES)) < 0.3]  # 30 % tall


def grouped(rank: int, world: int, streams: int, epoch: int, start: int = 0) -> list[list[int]]:
    s = ShardBatchSampler(SIZES, 4, seed=3, buffer=6, streams=streams, rank=rank, world_size=world, seeded=False,
                          group_ids=GROUPS)
    s.set_epoch(epoch, start_batch=start)
    return list(s)


@pytest.mark.parametrize("world,streams", [(2, 2), (1, 3), (3, 1)])
def test_grouped_shard_batches_are_one_orientation_a_fixed_count_an_epoch_and_resume_exactly(world, streams):
    counts = set()
    for epoch in range(3):
        read = []
        for rank in range(world):
            batches = grouped(rank, world, streams, epoch)
            counts.add(len(batches))
            assert all(len(b) == 4 and len({GROUPS[i] for i in b}) == 1 for b in batches)  # one orientation a batch
            assert grouped(rank, world, streams, epoch, start=2) == batches[2:]  # a resumed epoch: the rest of it
            read += [i for b in batches for i in b]
        assert len(read) == len(set(read))  # each sample at most once an epoch
    assert len(counts) == 1  # every rank, every epoch: the same number of batches
    assert grouped(0, world, streams, 0) != grouped(0, world, streams, 1)


def test_grouped_shards_keep_each_workers_stream_and_say_what_an_epoch_leaves_out(tmp_path, capsys, caplog):
    root = masks_coco(tmp_path / "coco", MASK_SCENES * 4)  # 8 wide and 8 tall images
    out = tmp_path / "shards"
    shard(capsys, "detect-faster-rcnn", out, "data.name=coco", f"data.root={root}", "data.train_split=train",
          "data.val_split=val")
    # two workers: two streams, each grouping its own run (the recipe's one worker would give one stream)
    cfg = from_shards("detect-faster-rcnn", out, "data.batch_size=2", "data.num_workers=2")
    train, _ = build_detection_splits(cfg.data)
    groups = [int(r >= 1.0) for r in train.aspect_ratios()]  # the detector's task.group_aspect
    with caplog.at_level(logging.INFO, logger="visiontrain"):
        sampler = cfg.data.batch_sampler(len(train), groups, seed=0, rank=0, world_size=1)
    assert caplog.messages == [sampler.left_out_message()] and "leaves 4 out of each epoch" in caplog.messages[0]
    assert sampler.order_state() == {"order": "shards", "streams": 2, "order_processes": 1, "shuffle_buffer": 1000,
                                     "aspect_groups": 2}
    sampler.set_epoch(0)
    batches = [[i for i, _ in b] for b in sampler]  # (index, seed): the detector's random transforms
    assert len(batches) == sampler.batches_per_epoch == 6 and all(len({groups[i] for i in b}) == 1 for b in batches)
    streams = [i for b in batches[0::2] for i in b], [i for b in batches[1::2] for i in b]  # a worker's each
    assert not set(streams[0]) & set(streams[1])


# ------------------------------------------------------------------------------ end to end
def test_shard_then_fit_segment_semantic_from_the_shards(tmp_path):
    out = tmp_path / "shards"
    small = ("data.limit_train=8", "data.limit_val=4")
    wrote = procs.run_cli("shard", "segment-semantic", *small, "--out", str(out), "--splits", "train,val",
                          timeout=300)
    assert wrote.returncode == 0, wrote.stderr[-2000:]
    assert json.loads(wrote.stdout.strip().splitlines()[-1])["kind"] == "semantic"
    fit = procs.run_cli("fit", "segment-semantic", "data.name=shards", f"data.shards={out}", "data.batch_size=4",
                        "task.crop=64", "task.train_sizes=[64,96]", "trainer.max_steps=2", "--run-dir",
                        str(tmp_path / "run"), timeout=600)
    assert fit.returncode == 0, fit.stderr[-3000:]
    final = json.loads(fit.stdout.strip().splitlines()[-1])
    assert final["steps"] == 2 and final["final"]["mIoU"] is not None  # evaluated on the shards' val split
