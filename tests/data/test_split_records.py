"""A COCO split read once is kept (``data/detection/record_cache.py``): a re-run of the same data
parses no annotation file and opens no image, and gets the same records and samples; an edited
annotation file, a changed or removed image, or a damaged kept file is read again, never trusted.
Before, every start parsed both splits' JSON again (most of a COCO re-run's 16-18 s to the first
batch once the image verdicts were recorded)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from dataset_trees import build_coco, truncated_jpeg
from procs import cli_here
from spies import calls_of
from visiontrain.data.detection import coco, record_cache
from visiontrain.data.detection.base import BadAnnotationError, DetectionDataset


@pytest.fixture
def parsed(monkeypatch, tmp_path) -> list[str]:
    """The annotation files parsed, with a data cache directory of this test's own."""
    monkeypatch.setenv("VISIONTRAIN_DATA_CACHE", str(tmp_path / "cache"))
    return calls_of(monkeypatch, coco, "_load")


@pytest.fixture
def kept_always(parsed, monkeypatch) -> list[str]:
    """``parsed``, with every annotation file large enough to be kept (the test trees' are a few kB)."""
    monkeypatch.setattr(record_cache, "MIN_BYTES", 0)
    return parsed


def tree(tmp_path: Path) -> Path:
    build_coco(tmp_path / "coco")
    return tmp_path / "coco"


def read(root: Path, **options: Any) -> DetectionDataset:
    return coco.read_coco(str(root / "annotations" / "instances_train2017.json"), str(root / "train2017"), **options)


def kept_files(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "cache" / record_cache.DIRECTORY).glob("*.npz"))


def edit_json(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def assert_same(a: DetectionDataset, b: DetectionDataset) -> None:
    """The same records, classes, counts of what was skipped, and samples."""
    saved_a, saved_b = a.records.saved(), b.records.saved()
    assert saved_a.keys() == saved_b.keys()
    for name in saved_a:
        assert saved_a[name].dtype == saved_b[name].dtype and np.array_equal(saved_a[name], saved_b[name]), name
    assert (a.class_names, a.category_ids, a.policy.counts()) == (b.class_names, b.category_ids, b.policy.counts())
    assert a.coco_ground_truth() == b.coco_ground_truth()
    for i in range(len(a)):
        (image_a, target_a), (image_b, target_b) = a.load(i), b.load(i)
        assert torch.equal(image_a, image_b) and target_a.keys() == target_b.keys()
        for key in target_a:
            same = (torch.equal(target_a[key], target_b[key]) if isinstance(target_a[key], torch.Tensor)
                    else target_a[key] == target_b[key])
            assert same, key


def test_a_second_preview_parses_no_annotation_file(parsed, tmp_path):
    """Where a user meets it: `visiontrain preview` (as validate and fit) twice on a COCO tree whose
    annotation files are as large as those worth keeping; the second run parses neither."""
    root = tree(tmp_path)
    for split in ("train2017", "val2017"):
        edit_json(root / "annotations" / f"instances_{split}.json",
                  lambda data: data.update(info={"description": " " * record_cache.MIN_BYTES}))
    args = ["preview", "detect-faster-rcnn", "data.name=coco", f"data.root={root}", "data.train_split=train2017",
            "data.val_split=val2017"]
    first = cli_here(*args, "--out", str(tmp_path / "first"))
    assert first.returncode == 0, first.stderr[-3000:]
    assert len(parsed) == 2 and len(kept_files(tmp_path)) == 2
    parsed.clear()
    second = cli_here(*args, "--out", str(tmp_path / "second"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert parsed == []


@pytest.mark.parametrize("masks", [False, True])
def test_the_kept_split_is_the_split_read(kept_always, tmp_path, masks):
    root = tree(tmp_path)
    first = read(root, masks=masks)
    second = read(root, masks=masks)
    assert len(kept_always) == 1 and len(second) == 8
    assert_same(first, second)


def test_an_edited_or_touched_annotation_file_is_parsed_again(kept_always, tmp_path):
    root = tree(tmp_path)
    ann = root / "annotations" / "instances_train2017.json"
    first = read(root)
    edit_json(ann, lambda data: data["annotations"][0]["bbox"].__setitem__(0, data["annotations"][0]["bbox"][0] + 1))
    os.utime(ann, ns=(10**18, 10**18))  # as an edit a second later (whatever the file system's clock resolution)
    edited = read(root)
    assert len(kept_always) == 2 and edited.records.boxes[0, 0] == first.records.boxes[0, 0] + 1
    os.utime(ann, ns=(1, 1))  # touched only
    assert_same(read(root), edited)
    assert len(kept_always) == 3
    read(root)  # kept anew
    assert len(kept_always) == 3


def test_an_image_changed_or_removed_since_is_checked_again(kept_always, tmp_path):
    root = tree(tmp_path)
    read(root)
    truncated_jpeg(root / "train2017" / "000003.jpg", size=(128, 96))
    with pytest.raises(BadAnnotationError, match="000003.jpg cannot be decoded"):
        read(root)
    (root / "train2017" / "000003.jpg").unlink()
    with pytest.raises(BadAnnotationError, match="000003.jpg does not exist"):
        read(root)
    skipped = read(root, on_bad_image="skip")
    assert len(skipped) == 7 and skipped.policy.skipped == {"missing image": 1}


def test_a_re_run_skips_and_counts_what_the_first_did(kept_always, tmp_path):
    root = tree(tmp_path)
    edit_json(root / "annotations" / "instances_train2017.json",
              lambda data: data["annotations"].append({**data["annotations"][0], "id": 999, "bbox": [5, 5, 0, 4]}))
    photo = (root / "train2017" / "000002.jpg").read_bytes()
    (root / "train2017" / "000002.jpg").unlink()
    first = read(root, on_bad_annotation="skip")
    second = read(root, on_bad_annotation="skip")
    assert len(kept_always) == 1 and first.policy.skipped == {"missing image": 1, "degenerate box": 1}
    assert_same(first, second)
    assert second.policy.unreadable == first.policy.unreadable and len(second.policy.unreadable) == 1
    (root / "train2017" / "000002.jpg").write_bytes(photo)  # back again
    assert len(read(root, on_bad_annotation="skip")) == 8 and len(kept_always) == 2


def _damage(kind: str, path: Path, boxes: np.ndarray) -> None:
    """``path`` (a kept split) damaged as ``kind`` says."""
    raw = path.read_bytes()
    if kind in ("truncated", "not a zip", "bytes flipped"):
        if kind == "bytes flipped":  # inside the boxes' bytes: only the zip's CRC tells
            at = raw.index(boxes.tobytes()) + 5
            raw = raw[:at] + bytes([raw[at] ^ 0x40]) + raw[at + 1:]
        path.write_bytes(raw[:len(raw) // 2] if kind == "truncated" else b"not a cache" if kind == "not a zip" else raw)
        return
    with np.load(path) as npz:
        arrays = {name: npz[name] for name in npz.files}
    if kind == "a pickle inside":
        arrays["records.labels"] = np.array(["a pickled", None], dtype=object)
    elif kind == "buffers that disagree":
        arrays["records.box_starts"] = arrays["records.box_starts"] + 1
    else:  # another format
        meta = json.loads(arrays["meta"].tobytes())
        arrays["meta"] = np.frombuffer(json.dumps({**meta, "format": -1}).encode(), dtype=np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


@pytest.mark.parametrize("kind", ["truncated", "not a zip", "bytes flipped", "a pickle inside", "buffers that disagree",
                                  "another format"])
def test_a_damaged_kept_split_is_ignored_and_written_again(kept_always, tmp_path, kind):
    root = tree(tmp_path)
    first = read(root)
    [kept] = kept_files(tmp_path)
    _damage(kind, kept, first.records.boxes)
    again = read(root)
    assert len(kept_always) == 2
    assert_same(first, again)
    read(root)
    assert len(kept_always) == 2  # written anew, and read back


def test_only_a_whole_large_split_checked_as_changed_is_kept(parsed, tmp_path, monkeypatch):
    """A small annotation file parses faster than its kept copy is checked; ``limit`` reads a part of
    the split; ``full`` opens every file each run, ``off`` promises no check."""
    root = tree(tmp_path)
    read(root)
    read(root)
    assert len(parsed) == 2 and kept_files(tmp_path) == []
    monkeypatch.setattr(record_cache, "MIN_BYTES", 0)
    for options in ({"limit": 3}, {"check_images": "full"}, {"check_images": "off"}):
        read(root, **options)
        read(root, **options)
    assert len(parsed) == 8 and kept_files(tmp_path) == []


def test_the_least_recently_used_kept_splits_go_first(kept_always, tmp_path, monkeypatch):
    monkeypatch.setattr(record_cache, "MAX_ENTRIES", 2)
    root = tree(tmp_path)
    for n, options in enumerate(({}, {"masks": True}, {"on_bad_image": "skip"}), 1):
        before = set(kept_files(tmp_path))
        read(root, **options)
        if n < 3:  # one use a second apart from the next (a coarse file-system clock cannot tie them)
            [new] = set(kept_files(tmp_path)) - before
            os.utime(new, ns=(n * 10**9, n * 10**9))
    assert len(kept_files(tmp_path)) == 2 and len(kept_always) == 3
    read(root, masks=True)
    read(root, on_bad_image="skip")
    assert len(kept_always) == 3
