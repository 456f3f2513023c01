"""The up-front image check's verdicts, kept between runs (``data.check_images``): a re-run opens no
file whose size and modification time are unchanged, and still finds a file that changed; ``full``
opens every file, ``off`` none but their headers; ranks checking one split at once open each file
once between them. Before, every start opened every file of both splits, on every rank."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from PIL import Image

from dataset_trees import build_coco, truncated_jpeg
from procs import cli_here
from spies import calls_of
from visiontrain.data import image_check


@pytest.fixture
def opened(monkeypatch, tmp_path) -> list[str]:
    """The files the check opens, in a verdict store of this test's own."""
    monkeypatch.setenv("VISIONTRAIN_DATA_CACHE", str(tmp_path / "cache"))
    return calls_of(monkeypatch, image_check, "inspect_image")


def jpegs(folder: Path, n: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        Image.new("RGB", (20 + i, 10), (i * 20, 90, 60)).save(folder / f"{i}.jpg")
    return [str(folder / f"{i}.jpg") for i in range(n)]


def test_a_re_run_opens_only_what_changed(opened, tmp_path):
    paths = jpegs(tmp_path / "images", 6)
    first = list(image_check.inspect_images(paths, size=True))
    assert len(opened) == 6 and first == [(None, (20 + i, 10)) for i in range(6)]
    opened.clear()
    assert list(image_check.inspect_images(paths, size=True)) == first and opened == []  # stat, not open
    truncated_jpeg(Path(paths[2]), size=(22, 10))  # replaced by a truncated copy
    os.utime(paths[4], ns=(1, 1))  # touched: another modification time
    again = list(image_check.inspect_images(paths, size=True))
    assert sorted(opened) == sorted([paths[2], paths[4]])
    assert again[2][0].startswith(image_check.CORRUPT) and again[4] == first[4]


def test_full_opens_every_file_and_off_only_reads_headers(opened, tmp_path):
    paths = jpegs(tmp_path / "images", 3)
    list(image_check.inspect_images(paths))
    opened.clear()
    list(image_check.inspect_images(paths, check="full"))
    assert len(opened) == 3
    cut = truncated_jpeg(tmp_path / "cut.jpg", size=(30, 20))
    assert list(image_check.inspect_images([str(cut)], size=True, check="off")) == [(None, (30, 20))]
    assert list(image_check.inspect_images([str(cut)], size=True))[0][0].startswith(image_check.CORRUPT)
    with pytest.raises(ValueError, match="data.check_images: expected one of full, changed, off, got 'some'"):
        list(image_check.inspect_images(paths, check="some"))


def test_ranks_checking_one_split_at_once_open_each_file_once(opened, tmp_path):
    """As two ranks of one run (or two runs started together) on one machine: the verdict store's lock
    is taken a chunk at a time, and a chunk one of them opened the other finds recorded."""
    paths = jpegs(tmp_path / "images", 40)
    results: list[list] = []
    ranks = [threading.Thread(target=lambda: results.append(list(image_check.inspect_images(paths, chunk=8))))
             for _ in range(2)]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join()
    assert sorted(opened) == sorted(paths) and results[0] == results[1]


def test_preview_twice_opens_the_images_once(opened, tmp_path):
    """Where a user meets it: `visiontrain preview` (as validate and fit) on a COCO tree, run twice."""
    build_coco(tmp_path / "coco")
    args = ["preview", "detect-faster-rcnn", "data.name=coco", f"data.root={tmp_path / 'coco'}",
            "data.train_split=train2017", "data.val_split=val2017"]
    for n, out in enumerate(("first", "second")):
        assert cli_here(*args, "--out", str(tmp_path / out)).returncode == 0
        if n == 0:
            assert len(opened) == 12  # 8 training and 4 validation images
            opened.clear()
    assert opened == []


def test_a_check_left_part_way_closes_on_any_thread_without_waiting_for_its_threads(opened, tmp_path):
    """A reader with a ``limit`` leaves the check's generator part-way; the garbage collector may close
    it on any thread, once on one of the next check's threads as it started, inside threading's own
    lock (``_shutdown_locks_lock``, taken again by a join): a suite hung there. Closing the check now
    asks its threads to end and does not join them. (The lock is CPython's private one, 3.11-3.13.)"""
    check = image_check.inspect_images(jpegs(tmp_path / "img", 6), chunk=2, workers=2)
    assert next(check)[0] is None  # one verdict taken: the generator holds its thread pool

    def close_inside_threadings_lock():
        with threading._shutdown_locks_lock:
            check.close()

    closer = threading.Thread(target=close_inside_threadings_lock, daemon=True)
    closer.start()
    closer.join(timeout=20)
    assert not closer.is_alive(), "closing the check joined its threads inside threading's lock"
