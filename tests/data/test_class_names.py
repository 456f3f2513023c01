"""Class names as a user types them: the spaces around a name are dropped ('tree ' is 'tree'); names
equal but for case or spacing ('Tree', 'tree') stay two classes with a warning naming both spellings
and where each comes from; a split whose classes differ from the training split's is an error
naming the missing and the extra classes, not two whole lists."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from PIL import Image

from dataset_trees import build_coco, build_voc_names, build_yolo
from visiontrain.data.datasets import ClassificationReader, build_classification_data
from visiontrain.data.detection.base import BadAnnotationError
from visiontrain.data.detection.coco import read_coco
from visiontrain.data.detection.sources import DetectionDataConfig
from visiontrain.data.detection.splits import build_detection_splits
from visiontrain.data.detection.voc import read_voc
from visiontrain.data.detection.yolo import read_yolo


def spelled_alike_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "equal but for case or spacing" in r.getMessage()]


def test_voc_name_typo_is_stripped_and_warned_with_both_spellings_and_files(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    build_voc_names(tmp_path, {"a": ["Tree", "Tree"], "b": ["Tree"], "c": ["tree "], "d": [" Tree\n"]})
    with caplog.at_level(logging.WARNING, logger="visiontrain"):
        ds = read_voc(str(tmp_path), "trainval")
    assert ds.class_names == ["Tree", "tree"]  # 'tree ' lost its space; ' Tree' is 'Tree'
    assert [r.labels.tolist() for r in ds.records] == [[0, 0], [0], [1], [0]]
    warnings = spelled_alike_warnings(caplog)
    annotations = tmp_path / "Annotations"
    assert warnings == [f"{tmp_path / 'ImageSets' / 'Main' / 'trainval.txt'}: class names equal but for case or "
                        f"spacing are different classes here: 'Tree' ({annotations / 'a.xml'}, "
                        f"{annotations / 'b.xml'}, {annotations / 'd.xml'}) and 'tree' ({annotations / 'c.xml'}); "
                        f"if they name one class, write it one way"]


def test_voc_val_name_spelled_otherwise_says_which_class_it_resembles(tmp_path: Path) -> None:
    build_voc_names(tmp_path, {"a": ["Tree"], "b": ["tree"]})
    with pytest.raises(BadAnnotationError, match=r"b.xml object 1: unknown category 'tree' \(differs from 'Tree' "
                                                  r"only in case or spacing\) \(known: Tree\)"):
        read_voc(str(tmp_path), "trainval", class_names=["Tree"])


def test_yolo_and_coco_names_are_stripped_and_warned(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    build_yolo(tmp_path / "yolo")
    (tmp_path / "yolo" / "data.yaml").write_text("names: ['square ', 'Square']\n")
    build_coco(tmp_path / "coco")
    ann_file = tmp_path / "coco" / "annotations" / "instances_val2017.json"
    data = json.loads(ann_file.read_text())
    data["categories"] = [{"id": 1, "name": " square"}, {"id": 2, "name": "bar "}, {"id": 3, "name": "B ar"}]
    ann_file.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="visiontrain"):
        yolo = read_yolo(str(tmp_path / "yolo"), "train")
        coco = read_coco(str(ann_file), str(tmp_path / "coco" / "val2017"))
    assert yolo.class_names == ["square", "Square"] and coco.class_names == ["square", "bar", "B ar"]
    assert spelled_alike_warnings(caplog) == [
        f"{tmp_path / 'yolo' / 'data.yaml'}: class names equal but for case or spacing are different classes here: "
        f"'square ' (class 0) and 'Square' (class 1); if they name one class, write it one way",
        f"{ann_file}: class names equal but for case or spacing are different classes here: 'bar ' (category id 2) "
        f"and 'B ar' (category id 3); if they name one class, write it one way"]


def test_detection_split_with_other_classes_names_the_missing_and_extra(tmp_path: Path) -> None:
    build_coco(tmp_path)
    ann_file = tmp_path / "annotations" / "instances_val2017.json"
    data = json.loads(ann_file.read_text())
    data["categories"] = [{"id": 1, "name": "square"}, {"id": 2, "name": "Bar"}]
    ann_file.write_text(json.dumps(data))
    with pytest.raises(ValueError) as info:
        build_detection_splits(DetectionDataConfig(name="coco", root=str(tmp_path), train_split="train2017",
                                                   val_split="val2017", on_bad_annotation="error"))
    assert str(info.value) == ("coco: the classes of split 'val2017' (2) must be those of split 'train2017' (2), in "
                               "the same order: missing from val2017: 1 ('bar'); not in train2017: 1 ('Bar' (differs "
                               "from 'bar' only in case or spacing))")


def test_image_folder_split_with_other_classes_names_them_in_one_line(tmp_path: Path) -> None:
    """30 classes, one renamed in val: the error names that one, not the 30 of each split."""
    names = [f"class{i:02d}" for i in range(30)]
    for split in ("train", "val"):
        for name in names:
            folder = tmp_path / split / (name if (split, name) != ("val", "class07") else "Class07")
            folder.mkdir(parents=True)
            Image.new("RGB", (8, 8), (50, 80, 110)).save(folder / "0.png")
    with pytest.raises(ValueError) as info:
        build_classification_data("image-folder", ClassificationReader(root=str(tmp_path), image_size=8))
    assert str(info.value) == (
        f"image-folder: the classes of {tmp_path / 'val'} (30) must be those of {tmp_path / 'train'} (30), one "
        f"sub-directory each; missing from val/: 1 ('class07'); not in train/: 1 ('Class07' (differs from "
        f"'class07' only in case or spacing))")
