"""`skip` that would drop much of a split stops the run instead (data.max_skipped_share): with the
count, the share, the likely cause and the value that accepts it. A split that loses that much is
more often read wrongly than dirty: COCO boxes written as x1,y1,x2,y2, YOLO labels in pixels, a
clone holding git-LFS pointers instead of photos."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dataset_trees import GIT_LFS_POINTER, build_coco, build_image_folder, build_yolo
from procs import cli_here
from visiontrain.data.datasets import ClassificationReader, build_classification_data, check_image_files
from visiontrain.data.detection.sources import DetectionDataConfig
from visiontrain.data.detection.splits import build_detection_splits

COCO_SPLITS = dict(train_split="train2017", val_split="val2017")


def coco_written_as_xyxy(root: Path) -> Path:
    """dataset_trees' COCO tree with every training bbox written [x1, y1, x2, y2], not [x, y, w, h]."""
    build_coco(root)
    ann_file = root / "annotations" / "instances_train2017.json"
    data = json.loads(ann_file.read_text())
    for a in data["annotations"]:
        x, y, w, h = a["bbox"]
        a["bbox"] = [x, y, x + w, y + h]
    ann_file.write_text(json.dumps(data))
    return root


def test_coco_boxes_written_as_xyxy_stop_the_run_with_the_cause(tmp_path: Path) -> None:
    root = coco_written_as_xyxy(tmp_path / "coco")
    run = tmp_path / "r"
    # the subject: the skip policy on the user's COCO tree (the recipe's own data is fashion-mosaic)
    # in this process: refused before any DataLoader starts
    proc = cli_here("fit", "detect-faster-rcnn", "data.name=coco", f"data.root={root}",
                    "data.train_split=train2017", "data.val_split=val2017", "data.on_bad_annotation=skip",
                    "trainer.max_steps=1", "--run-dir", str(run))
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line == (
        f"visiontrain: error: coco train2017 ({root / 'annotations' / 'instances_train2017.json'}): 6 of 12 boxes "
        f"are bad data (50%; 6 box outside image), more than data.max_skipped_share=0.1 lets a run skip; likely "
        f"cause: boxes look like x1,y1,x2,y2: COCO's bbox is x,y,w,h (6 of the 6); correct the data, or set "
        f"data.max_skipped_share=0.5 to train on the other 6")
    assert not run.exists()


def test_the_share_the_error_names_is_accepted(tmp_path: Path) -> None:
    root = coco_written_as_xyxy(tmp_path / "coco")
    with pytest.raises(ValueError, match="set data.max_skipped_share=0.5 to train"):
        build_detection_splits(DetectionDataConfig(name="coco", root=str(root), on_bad_annotation="skip",
                                                   max_skipped_share=0.49, **COCO_SPLITS))
    train, _ = build_detection_splits(DetectionDataConfig(name="coco", root=str(root), on_bad_annotation="skip",
                                                          max_skipped_share=0.5, **COCO_SPLITS))
    assert dict(train.policy.skipped) == {"box outside image": 6}


def test_yolo_labels_in_pixels_name_the_cause(tmp_path: Path) -> None:
    build_yolo(tmp_path)
    for label in (tmp_path / "labels" / "train").glob("*.txt"):  # cx cy w h times the image's 128 x 96
        lines = [line.split() for line in label.read_text().splitlines()]
        label.write_text("".join(f"{c} {float(cx) * 128:.1f} {float(cy) * 96:.1f} {float(w) * 128:.1f} "
                                 f"{float(h) * 96:.1f}\n" for c, cx, cy, w, h in lines))
    with pytest.raises(ValueError) as info:
        build_detection_splits(DetectionDataConfig(name="yolo", root=str(tmp_path), train_split="train",
                                                   val_split="val", on_bad_annotation="skip", max_skipped_share=0.1))
    assert ("12 of 12 boxes are bad data (100%; 12 box outside image), more than data.max_skipped_share=0.1 lets a "
            "run skip; likely cause: labels look like pixel coordinates: YOLO's cx cy w h are divided by the image "
            "width and height (12 of the 12)") in str(info.value)


def test_image_folder_of_git_lfs_pointers_stops_with_the_cause(tmp_path: Path) -> None:
    build_image_folder(tmp_path)
    pointers = sorted((tmp_path / "train" / "circle").glob("*.png"))[:5]
    for path in pointers:  # a clone without `git lfs pull`
        path.write_text(GIT_LFS_POINTER)
    data = build_classification_data("image-folder", ClassificationReader(root=str(tmp_path), image_size=16))
    with pytest.raises(ValueError) as info:
        check_image_files(data, on_bad_image="skip", max_skipped_share=0.1)
    assert (f"image-folder split {tmp_path / 'train'}: 5 of 16 image files cannot be read (31%), more than "
            f"data.max_skipped_share=0.1 lets a run skip; likely cause: a git-LFS pointer, not the image (run "
            f"`git lfs pull`) (5 of the 5); correct the data, or set data.max_skipped_share=0.32 to train on the "
            f"other 11") in str(info.value)
    check_image_files(data, on_bad_image="skip", max_skipped_share=0.32)
    assert len(data.train) == 11 and not {str(p) for p in pointers} & {p for p, _ in data.train.samples}
