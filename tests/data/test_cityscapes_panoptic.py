"""Cityscapes panoptic (``data.name=cityscapes-panoptic``): COCO's panoptic format in Cityscapes'
folders, read through coco-panoptic's reader. The same annotation gives the same records, instances,
semantic map and ground truth in either layout; string image ids are numbered by position and their
images found in their city's folder; a missing image or id PNG follows the bad-data policy; a name
leaving the dataset is refused; and `visiontrain fit segment-panoptic` trains on it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from panoptic_trees import CITIES, CITYSCAPES_CATEGORIES, cityscapes_scene, write_cityscapes_panoptic
from procs import cli_here
from tiny import RCNN as TINY
from visiontrain.core import config as C
from visiontrain.data.detection.images import BadAnnotationError
from visiontrain.data.segmentation.panoptic import build_panoptic_splits
from visiontrain.rundir.metrics_file import read_metrics
from visiontrain.rundir.run_files import PLOTS_DIR

SPLITS = {"train": 6, "val": 3}


def splits(root: Path, *overrides: str, name: str = "cityscapes-panoptic"):
    return build_panoptic_splits(C.load_config("segment-panoptic", [f"data.name={name}", f"data.root={root}",
                                                                    *overrides]).data)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return write_cityscapes_panoptic(tmp_path_factory.mktemp("cityscapes") / "cityscapes", SPLITS)


def as_coco(cityscapes: Path, coco: Path) -> Path:
    """The same annotations in COCO panoptic's layout: each image under ``<split>/`` by its id, int
    image ids by position (from 1), the id PNGs under ``annotations/panoptic_<split>/``."""
    for split in SPLITS:
        data = json.loads((cityscapes / "gtFine" / f"cityscapes_panoptic_{split}.json").read_text())
        (coco / split).mkdir(parents=True)
        shutil.copytree(cityscapes / "gtFine" / f"cityscapes_panoptic_{split}", coco / "annotations" / f"panoptic_{split}")
        number = {image["id"]: n for n, image in enumerate(data["images"], start=1)}
        for image in data["images"]:
            city = image["id"].split("_")[0]
            shutil.copy(cityscapes / "leftImg8bit" / split / city / f"{image['id']}_leftImg8bit.png",
                        coco / split / f"{image['id']}.png")
            image.update(id=number[image["id"]], file_name=f"{image['id']}.png")
        for ann in data["annotations"]:
            ann["image_id"] = number[ann["image_id"]]
        (coco / "annotations" / f"panoptic_{split}.json").write_text(json.dumps(data))
    return coco


def test_the_same_annotation_gives_the_same_samples_as_in_coco_panoptics_layout(tree, tmp_path):
    got = splits(tree)
    want = splits(as_coco(tree, tmp_path / "coco"), "data.train_split=train", "data.val_split=val",
                  name="coco-panoptic")
    for g, w in zip(got, want):
        assert g.categories == w.categories and len(g) == len(w) > 0
        for i in range(len(g)):
            a, b = g.records[i], w.records[i]
            assert (a.image_id, a.height, a.width, a.segments) == (b.image_id, b.height, b.width, b.segments)
            (image, target), (want_image, want_target) = g.load(i), w.load(i)
            assert torch.equal(image, want_image) and target.keys() == want_target.keys()
            for key, value in target.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(want_target[key])), key
            (ids, segments), (want_ids, want_segments) = g.truth(i), w.truth(i)
            assert np.array_equal(ids, want_ids) and segments == want_segments
    # and what both say is Cityscapes' classes: things by label id (person 24, rider 25, car 26, ...),
    # stuff after the semantic head's "things" (road 7 the first, sky 23 the eleventh)
    _, target = got[0].load(1)
    assert target["labels"].tolist() == [2, 2, 0]  # two cars, a person
    semantic = target["semantic"].as_subclass(torch.Tensor)
    ids = cityscapes_scene(1)[0]
    assert semantic[torch.from_numpy(ids == 23)].eq(11).all() and semantic[torch.from_numpy(ids == 7)].eq(1).all()
    assert semantic[-1].eq(255).all()  # VOID


def test_string_image_ids_are_numbered_by_position_and_each_image_found_in_its_city(tree):
    train, val = splits(tree)  # the source's own split names: train and val
    assert [r.image_id for r in train.records] == list(range(1, 7)) and val.index_of == {1: 0, 2: 1, 3: 2}
    names = [json.loads((tree / "gtFine" / "cityscapes_panoptic_train.json").read_text())["images"][i]["id"]
             for i in range(6)]
    assert [r.image for r in train.records] == [
        str(tree / "leftImg8bit" / "train" / n.split("_")[0] / f"{n}_leftImg8bit.png") for n in names]
    assert {Path(r.image).parent.name for r in train.records} == set(CITIES)
    assert train.class_names == [c["name"] for c in CITYSCAPES_CATEGORIES if c["isthing"]]
    assert len(train.categories.semantic_names) == 1 + 11
    limited, _ = splits(tree, "data.limit_train=2")
    assert [r.image_id for r in limited.records] == [1, 2]


def test_a_key_coco_panoptic_does_not_read_is_refused_as_for_coco_panoptic(tree):
    """data.ignore_index is the label-map sources' key, not a panoptic one (VOID is the id 0): refused
    with the same line for both panoptic file sources."""
    said = []
    for name in ("coco-panoptic", "cityscapes-panoptic"):
        with pytest.raises(C.ConfigError, match="unknown config key 'data.ignore_index'") as err:
            splits(tree, "data.ignore_index=0", name=name)
        said.append(str(err.value).replace(name, "NAME"))
    assert said[0] == said[1]


def test_data_cache_ram_gives_the_samples_the_files_give(tree):
    """data.cache=ram (the decoded-image cache every image-decoding source has) for a panoptic file source."""
    plain, _ = splits(tree, "data.limit_train=2")
    cached, _ = splits(tree, "data.limit_train=2", "data.cache=ram")
    assert cached.cache is not None
    for _ in range(2):  # decoded, then read back from the cache
        for i in range(2):
            (a, want), (b, got) = plain.load(i), cached.load(i)
            assert torch.equal(a, b) and torch.equal(want["semantic"], got["semantic"])
    assert cached.cache.filled() == 2


@pytest.mark.parametrize("missing", ["image", "png"])
def test_a_missing_image_or_id_png_follows_the_bad_data_policy(tmp_path, missing):
    root = write_cityscapes_panoptic(tmp_path / "cityscapes", {"train": 3, "val": 1})
    gone = (root / "leftImg8bit" / "train" / "frankfurt" / "frankfurt_000001_000019_leftImg8bit.png"
            if missing == "image" else root / "gtFine" / "cityscapes_panoptic_train" / "frankfurt_000001_000019_gtFine_panoptic.png")
    gone.unlink()
    with pytest.raises(BadAnnotationError, match="does not exist") as err:
        splits(root)
    assert str(gone) in str(err.value)
    train, _ = splits(root, "data.on_bad_annotation=skip", "data.max_skipped_share=1")
    assert [r.image_id for r in train.records] == [1, 3]
    assert train.policy.skipped == {f"missing {'image' if missing == 'image' else 'annotation'}": 1}


def test_an_image_id_leaving_the_dataset_is_refused_before_any_file_is_opened(tmp_path, monkeypatch):
    root = write_cityscapes_panoptic(tmp_path / "cityscapes", {"train": 2, "val": 1})
    ann_file = root / "gtFine" / "cityscapes_panoptic_train.json"
    data = json.loads(ann_file.read_text())
    data["images"][1]["id"] = data["annotations"][1]["image_id"] = "../../secret"  # city "..": outside
    ann_file.write_text(json.dumps(data))
    opened = []
    monkeypatch.setattr("visiontrain.data.segmentation.panoptic.inspect_images",
                        lambda paths, **kw: opened.extend(paths) or iter(()))
    with pytest.raises(ValueError, match=r"'\.\./\.\./secret/\.\./\.\./secret_leftImg8bit.png' names a file outside"):
        splits(root)
    assert not opened


def test_fit_segment_panoptic_trains_and_evaluates_on_cityscapes_panoptic(tree, tmp_path):
    run = tmp_path / "run"
    proc = cli_here("fit", "segment-panoptic", "data.name=cityscapes-panoptic", f"data.root={tree}", *TINY,
                    "trainer.max_steps=2", "data.limit_val=2", "schedules.lr.warmup=0", "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    train, evals = read_metrics(run)
    assert train[-1]["step"] == 2 and np.isfinite(train[-1]["loss_sem"])
    assert {"PQ", "PQ_th", "PQ_st"} <= set(evals[-1])
    assert (run / PLOTS_DIR / "train_batch.png").is_file()  # the first look drew the source's first batch
