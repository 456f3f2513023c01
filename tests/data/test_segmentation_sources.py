"""Cityscapes and ADE20K read as their own tools read them: Cityscapes' labelIds through
cityscapesscripts' table to the 19 train ids (every other id ignored, a byte that is no id bad data
naming the file and the value), its labelTrainIds PNGs as written; ADE20K's 150 classes with label 0
"other" ignored (reduce_zero_label on by default) and its training / validation splits; a missing
directory the layout's error; and the semantic task trains on both trees."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from segmentation_dataset_trees import (ADE20K_SPLITS, CITYSCAPES_IDS, ade20k_values, cityscapes_ids, write_ade20k,
                                        write_cityscapes)
from visiontrain.core import config as C
from visiontrain.data.detection.images import BadAnnotationError
from visiontrain.data.segmentation.readers import build_semantic_splits
from visiontrain.engine.loop.trainer import Trainer
from visiontrain.tasks import build_task

#: cityscapesscripts' helpers/labels.py: the id of each train class -> its trainId (every other id: 255).
TRAIN_ID_OF = {7: 0, 8: 1, 11: 2, 12: 3, 13: 4, 17: 5, 19: 6, 20: 7, 21: 8, 22: 9, 23: 10, 24: 11, 25: 12, 26: 13,
               27: 14, 28: 15, 31: 16, 32: 17, 33: 18}
CITYSCAPES_NAMES = ["road", "sidewalk", "building", "wall", "fence", "pole", "traffic light", "traffic sign",
                    "vegetation", "terrain", "sky", "person", "rider", "car", "truck", "bus", "train", "motorcycle",
                    "bicycle"]


def splits(*overrides: str):
    return build_semantic_splits(C.load_config("segment-semantic", list(overrides)).data)


@pytest.fixture(scope="module")
def cityscapes(tmp_path_factory) -> Path:
    return write_cityscapes(tmp_path_factory.mktemp("cityscapes") / "cityscapes")


@pytest.fixture(scope="module")
def ade20k(tmp_path_factory) -> Path:
    return write_ade20k(tmp_path_factory.mktemp("ade") / "ADEChallengeData2016")


def test_cityscapes_label_ids_become_the_19_train_ids_and_every_other_id_the_ignore_index(cityscapes):
    train, val = splits("data.name=cityscapes", f"data.root={cityscapes}")
    assert (len(train), len(val)) == (4, 2) and train.class_names == val.class_names == CITYSCAPES_NAMES
    assert [Path(image).parent.name for image, _ in train.pairs] == ["aachen", "aachen", "bochum", "bochum"]
    assert all(label.endswith("_gtFine_labelIds.png") for _, label in train.pairs)
    for i in range(len(train)):
        labels = train.load(i)[1].numpy()
        want = np.vectorize(lambda v: TRAIN_ID_OF.get(int(v), 255))(cityscapes_ids(i))
        assert np.array_equal(labels, want)
        assert set(np.unique(labels)) == set(range(19)) | {255}  # every train id, and the ids of none ignored
    assert {0, 1, 4, 9, 14, 29, 30, 255} < set(CITYSCAPES_IDS)


def test_cityscapes_label_train_ids_pngs_are_read_as_written(cityscapes):
    by_ids, _ = splits("data.name=cityscapes", f"data.root={cityscapes}")
    train, _ = splits("data.name=cityscapes", f"data.root={cityscapes}", "data.label_kind=labelTrainIds")
    assert all(label.endswith("_gtFine_labelTrainIds.png") for _, label in train.pairs)
    for i in range(len(train)):
        assert np.array_equal(train.load(i)[1].numpy(), by_ids.load(i)[1].numpy())


def broken_cityscapes(root: Path, value: int, kind: str = "labelIds") -> str:
    """A Cityscapes tree whose second training label map (of ``kind``) holds ``value`` at one pixel."""
    write_cityscapes(root)
    label = root / "gtFine" / "train" / "aachen" / f"aachen_000000_000001_gtFine_{kind}.png"
    broken = np.asarray(Image.open(label)).copy()
    broken[3, 5] = value
    Image.fromarray(broken, mode="L").save(label)
    return str(label)


@pytest.mark.parametrize("kind, value, said", [
    ("labelIds", 40, "value 40 is no Cityscapes labelId (0..33, or 255 for none)"),
    ("labelTrainIds", 19, "value 19 is no Cityscapes trainId (0..18, or 255 for none)")])
def test_a_value_that_is_no_cityscapes_id_is_bad_data_naming_the_file_and_the_value(tmp_path, kind, value, said):
    label = broken_cityscapes(tmp_path / "cityscapes", value, kind)
    root = ["data.name=cityscapes", f"data.root={tmp_path / 'cityscapes'}", f"data.label_kind={kind}"]
    with pytest.raises(BadAnnotationError) as err:
        splits(*root)
    assert f"label map {label}: {said}" in str(err.value) and "data.on_bad_annotation=skip" in str(err.value)
    train, _ = splits(*root, "data.on_bad_annotation=skip", "data.max_skipped_share=0.5")
    assert len(train) == 3 and train.policy.skipped == {"bad label value": 1}
    assert label not in [lab for _, lab in train.pairs]


def test_a_missing_cityscapes_directory_is_the_layouts_error(tmp_path):
    root = write_cityscapes(tmp_path / "cityscapes")
    shutil.rmtree(root / "gtFine" / "val")
    with pytest.raises(FileNotFoundError, match=r"cityscapes: .*gtFine/val does not exist \(expected layout: "
                                                r"ROOT/leftImg8bit/<split>/<city>/<stem>_leftImg8bit.png"):
        splits("data.name=cityscapes", f"data.root={root}")
    with pytest.raises(FileNotFoundError, match=r"leftImg8bit/training does not exist"):
        splits("data.name=cityscapes", f"data.root={root}", "data.train_split=training")
    with pytest.raises(ValueError, match=r"data.reduce_zero_label: cityscapes .* leave it false"):
        splits("data.name=cityscapes", f"data.root={root}", "data.reduce_zero_label=true")
    with pytest.raises(ValueError, match=r"data.val_split='../val' points outside data.root"):
        splits("data.name=cityscapes", f"data.root={root}", "data.val_split=../val")


def test_ade20k_reads_its_150_classes_with_0_ignored_from_training_and_validation(ade20k):
    train, val = splits("data.name=ade20k", f"data.root={ade20k}")
    assert (len(train), len(val)) == (ADE20K_SPLITS["training"], ADE20K_SPLITS["validation"])
    assert len(train.class_names) == 150 and train.class_names[:3] == ["wall", "building", "sky"]
    assert train.class_names[7] == "bed" and train.class_names[-1] == "flag"
    assert [Path(image).name for image, _ in val.pairs] == ["ADE_validation_00000001.jpg", "ADE_validation_00000002.jpg"]
    for i in range(len(train)):
        labels, raw = train.load(i)[1].numpy(), ade20k_values(i)
        assert np.array_equal(labels, np.where(raw == 0, 255, raw.astype(np.int64) - 1))
    assert set(np.unique(train.load(0)[1].numpy())) == {0, 1, 74, 148, 149, 255}  # 150 -> flag, the last class


def test_an_ade20k_value_above_150_is_bad_data_and_a_missing_directory_the_layouts_error(tmp_path):
    root = write_ade20k(tmp_path / "ADEChallengeData2016")
    label = root / "annotations" / "training" / "ADE_training_00000002.png"
    broken = ade20k_values(1).copy()
    broken[0, 0] = 151
    Image.fromarray(broken, mode="L").save(label)
    with pytest.raises(BadAnnotationError) as err:
        splits("data.name=ade20k", f"data.root={root}")
    assert (f"label map {label}: value 151 is no class (1..150 under data.reduce_zero_label) and not 0 or the ignore "
            f"index 255") in str(err.value)
    train, _ = splits("data.name=ade20k", f"data.root={root}", "data.on_bad_annotation=skip",
                      "data.max_skipped_share=0.5")
    assert len(train) == 3 and train.policy.skipped == {"bad label value": 1}
    shutil.rmtree(root / "annotations" / "validation")
    with pytest.raises(FileNotFoundError, match=r"ade20k: .*annotations/validation does not exist \(expected layout: "
                                                r"ADEChallengeData2016"):
        splits("data.name=ade20k", f"data.root={root}", "data.on_bad_annotation=skip", "data.max_skipped_share=0.5")


@pytest.mark.parametrize("source", ["cityscapes", "ade20k"])
def test_the_semantic_task_trains_two_steps_on_each_tree(source, cityscapes, ade20k, tmp_path):
    """segment-semantic on the tree: 2 steps of 2 crops, then the evaluation at the end."""
    root = cityscapes if source == "cityscapes" else ade20k
    cfg = C.load_config("segment-semantic", [
        f"data.name={source}", f"data.root={root}", "data.batch_size=2", "task.crop=32", "task.train_sizes=[24,40]",
        "trainer.max_steps=2", "trainer.progress=plain",
        "schedules.lr.warmup=0",  # the recipe's 50-step warm-up outlasts 2 steps: its warning says nothing here
        "data.num_workers=0",  # a reader's test: loaded in-process; test_recipes.py runs the recipes' own workers
        "trainer.plots=false"])  # the figures are the task's, tested in tests/tasks/test_semantic.py
    summary = Trainer(cfg, build_task(cfg), tmp_path / "run").fit()
    assert summary["steps"] == 2 and 0 <= summary["final"]["mIoU"] <= 1, summary
    assert len(summary["final"]["per_class"]) == (19 if source == "cityscapes" else 150)
