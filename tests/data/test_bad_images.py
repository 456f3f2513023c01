"""Image files that cannot be read (data.on_bad_image): every file of a split is opened before the
first step, so that all of them are named at once, with their count (error), or dropped and counted
in one line (skip), for the image folder and the detection readers alike, DataLoader workers
included. Image files are this file's subject: the image-folder runs put data.name=image-folder in
place of the recipe's dataset, and say so."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from PIL import Image

from dataset_trees import (GIT_LFS_POINTER, add_image_folder_split, broken_inside_jpeg, build_image_folder,
                           build_yolo, renamed_text, truncated_jpeg)
from detection_helpers import vt
from procs import cli_here, run_cli
from visiontrain.data.datasets import ClassificationReader, build_classification_data, check_image_files
from visiontrain.data.datasets.image_folder import scan_split
from visiontrain.data.detection.base import BadAnnotationError
from visiontrain.data.detection.yolo import read_yolo
from visiontrain.data.image_check import image_problem

# the dataset under test replaces classify-fashion's Fashion-MNIST; the rest is the run's size
FOLDER = ["data.name=image-folder", "data.image_size=16", "data.batch_size=4", "trainer.epochs=1",
          "trainer.progress=plain"]


def folder_with_bad_files(root: Path, extra_per_class: int = 0) -> tuple[Path, Path]:
    """build_image_folder's tree (16 train, 8 val images) with a truncated JPEG and a renamed text
    file among the training images."""
    build_image_folder(root)
    if extra_per_class:
        add_image_folder_split(root, "train", extra_per_class)
    return truncated_jpeg(root / "train" / "circle" / "cut.jpg"), renamed_text(root / "train" / "cross" / "notes.jpg")


def test_each_kind_of_bad_file_is_told_apart(tmp_path: Path) -> None:
    truncated_jpeg(tmp_path / "cut.jpg")
    renamed_text(tmp_path / "notes.jpg")
    (tmp_path / "pointer.jpg").write_text(GIT_LFS_POINTER)
    (tmp_path / "page.jpg").write_text("<!DOCTYPE html><html><body>Not found</body></html>")
    (tmp_path / "empty.png").write_bytes(b"")
    broken_inside_jpeg(tmp_path / "broken.jpg")
    assert image_problem(str(tmp_path / "cut.jpg")).startswith("cannot be decoded (corrupt or truncated): image "
                                                               "file is truncated")
    assert image_problem(str(tmp_path / "notes.jpg")) == "is not an image: a text file"
    assert "git-LFS pointer" in image_problem(str(tmp_path / "pointer.jpg"))
    assert "HTML page" in image_problem(str(tmp_path / "page.jpg"))
    assert image_problem(str(tmp_path / "empty.png")) == "is not an image: an empty file"
    assert image_problem(str(tmp_path / "missing.jpg")) == "does not exist"
    assert image_problem(str(tmp_path / "broken.jpg")) is None  # whole to the check: found when loaded
    # bytes after a JPEG's end marker (some camera apps append data): no end marker to see, so the
    # file is decoded, and the decode decides
    Image.new("RGB", (64, 48), (10, 200, 30)).save(tmp_path / "tail.jpg")
    for name in ("tail.jpg", "broken.jpg"):
        (tmp_path / f"appended-{name}").write_bytes((tmp_path / name).read_bytes() + b"appended by a camera app")
    assert image_problem(str(tmp_path / "appended-tail.jpg")) is None
    assert "broken data stream" in image_problem(str(tmp_path / "appended-broken.jpg"))


def test_image_folder_bad_files_stop_the_run_before_the_first_step_in_one_line(tmp_path: Path) -> None:
    cut, notes = folder_with_bad_files(tmp_path / "imgs")
    run = tmp_path / "r"
    # in this process: refused before any DataLoader starts
    proc = cli_here("fit", "classify-fashion", *FOLDER, f"data.root={tmp_path / 'imgs'}", "--run-dir", str(run))
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("visiontrain: error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    assert (f"image-folder split {tmp_path / 'imgs' / 'train'}: 2 of 18 image files cannot be read: {cut} cannot "
            f"be decoded (corrupt or truncated): image file is truncated") in errors[0]
    assert f"{notes} is not an image: a text file; set data.on_bad_image=skip" in errors[0]
    assert not run.exists()  # nothing written


def test_image_folder_skip_drops_them_in_one_line_and_trains_with_the_recipes_workers(tmp_path: Path) -> None:
    """classify-mobilevit-imagenet as shipped (8 forkserver workers, fp16, imagenet augmentation) on a
    tiny folder: the run's length and size are all that change, besides the policy under test."""
    cut, notes = folder_with_bad_files(tmp_path / "imgs", extra_per_class=4)  # 2 of 26: under 10 %
    run = tmp_path / "r"
    proc = vt("fit", "classify-mobilevit-imagenet", f"data.root={tmp_path / 'imgs'}", "data.on_bad_image=skip",
              "trainer.max_steps=2", "data.batch_size=4", "data.image_size=64", "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "skipped" in line and "image files" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert (f"image-folder split {tmp_path / 'imgs' / 'train'}: skipped 2 of 26 image files that cannot be read "
            f"(data.on_bad_image=skip): {cut}, {notes}") in lines[0]
    assert json.loads((run / "summary.json").read_text())["steps"] == 2


def test_image_folder_file_broken_inside_is_replaced_when_loaded_under_skip(tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    build_image_folder(tmp_path)
    broken = broken_inside_jpeg(tmp_path / "train" / "circle" / "000-broken.jpg")
    data = build_classification_data("image-folder", ClassificationReader(root=str(tmp_path), image_size=16))
    check_image_files(data, on_bad_image="skip", max_skipped_share=0.1)
    index = [path for path, _ in data.train.samples].index(str(broken))  # passed the up-front check
    with caplog.at_level(logging.WARNING, logger="visiontrain"):
        image, label = data.train[index]
    assert image.shape == (3, 16, 16) and label == data.train.samples[index + 1][1]
    assert any(str(broken) in r.getMessage() and "the next image stands in" in r.getMessage() for r in caplog.records)
    check_image_files(data, on_bad_image="error", max_skipped_share=0.1)
    with pytest.raises(ValueError, match="000-broken.jpg cannot be decoded"):
        data.train[index]


def test_detection_bad_image_files_are_named_together_or_skipped(tmp_path: Path) -> None:
    build_yolo(tmp_path)
    images = tmp_path / "images" / "train"
    cut, notes = truncated_jpeg(images / "000001.jpg"), renamed_text(images / "000003.jpg")
    with pytest.raises(BadAnnotationError) as info:
        read_yolo(str(tmp_path), "train")
    message = str(info.value)
    assert f"2 image files cannot be read: image file {cut} cannot be decoded" in message
    assert f"image file {notes} is not an image: a text file (set data.on_bad_image=skip to drop them)" in message
    kept = read_yolo(str(tmp_path), "train", on_bad_annotation="error", on_bad_image="skip")
    assert len(kept) == 6 and dict(kept.policy.skipped) == {"unreadable image": 2}
    assert str(cut) not in {r.path for r in kept.records}


def test_symlinked_folders_are_read_once_so_a_loop_neither_hangs_nor_multiplies_a_class(tmp_path: Path) -> None:
    """A link back up the tree (to the class, the split, above the dataset) and a second link into a
    class: each real folder is read once, and the links are named in one line."""
    root = tmp_path / "imgs"
    build_image_folder(root)
    train = root / "train"
    classes = {"circle": 0, "cross": 1}
    plain = scan_split(train, classes)
    (train / "circle" / "loop").symlink_to("..")
    (train / "circle" / "again").symlink_to("../circle")
    (train / "cross" / "up").symlink_to("../../..")
    (train / "cross" / "self").symlink_to(".")
    elsewhere = tmp_path / "more"  # a link to a folder outside the tree is followed, once
    elsewhere.mkdir()
    shutil.copy(train / "cross" / "000.png", elsewhere / "extra.png")
    (train / "cross" / "more").symlink_to(elsewhere)
    (train / "cross" / "more-again").symlink_to(elsewhere)
    assert scan_split(train, classes) == plain + [(str(train / "cross" / "more" / "extra.png"), 1)]
    proc = run_cli("preview", "classify-fashion", *FOLDER, f"data.root={root}", "--out", str(tmp_path / "out"),
                   timeout=120)  # torchvision's walk never ends here
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "symlinked" in line]
    assert len(said) == 1 and f"image-folder split {train}: 5 symlinked directories lead to a folder already read" \
        in said[0], proc.stderr[-3000:]
