"""`visiontrain shard`: any data the project reads as tar shards (data/shards/), through the CLI.

Each sample's image is the file's bytes as they were (an in-memory set's pixels as PNG), its labels
are the reader's, every sample of a split is in exactly one shard, in a fixed shuffle of the
reader's order, no shard passes --shard-size, and a write killed with SIGKILL continues to the
bytes a straight write gives. The commands run in this process (``shard_helpers.in_process``) but
the killed write, which is a process of its own; the digits' shards are written once a session
(``shard_helpers.digits_shards``), for these tests and those that train on them."""
from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dataset_trees import add_image_folder_split, build_coco, build_image_folder, truncated_jpeg
from procs import finish, in_process, wait_for
from shard_helpers import DIGITS_SHARDS, digits_shards, start_cli
from visiontrain.data.datasets.classification import digits_split
from visiontrain.data.detection.coco import read_coco
from visiontrain.data.shards.layout import parse_size
from visiontrain.data.shards.writer import written_order


def shard_samples(out: Path, split: str) -> list[dict[str, bytes]]:
    """Every sample of a split, in shard order: {extension: bytes} by key, keys checked in order."""
    index = json.loads((out / "index.json").read_text())
    samples: dict[str, dict[str, bytes]] = {}
    for shard in index["splits"][split]["shards"]:
        with tarfile.open(out / shard["name"]) as tar:
            for member in tar.getmembers():
                key, ext = member.name.split(".", 1)
                samples.setdefault(key, {})[ext] = tar.extractfile(member).read()
    assert list(samples) == [f"{i:09d}" for i in range(len(samples))]  # each once, in the reader's order
    assert len(samples) == index["splits"][split]["samples"] and index["splits"][split]["complete"]
    return list(samples.values())


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> tuple[Path, dict]:
    """`visiontrain shard classify-fashion data.name=digits --shard-size 64KB`: (its --out, its JSON line)."""
    return digits_shards(tmp_path_factory)


def test_digits_pixels_and_labels_in_shards_of_the_size_asked(digits) -> None:
    out, summary = digits
    train_x, train_y, val_x, val_y = digits_split()
    assert summary["splits"]["train"]["samples"] == len(train_y) and summary["splits"]["val"]["samples"] == len(val_y)
    index = json.loads((out / "index.json").read_text())
    assert index["kind"] == "classification" and index["class_names"] == [str(i) for i in range(10)]
    assert index["pixel_max"] == 16 and len(index["splits"]["train"]["shards"]) > 10
    for shard in index["splits"]["train"]["shards"]:
        assert (out / shard["name"]).stat().st_size == shard["bytes"] <= 64_000
    for (images, labels), split in (((train_x, train_y), "train"), ((val_x, val_y), "val")):
        order = written_order(len(labels))  # a fixed shuffle: a shard holds every class, not one
        assert sorted(order.tolist()) == list(range(len(labels))) and order.tolist() != sorted(order.tolist())
        for i, sample in zip(order, shard_samples(out, split)):
            assert np.array_equal(np.asarray(Image.open(io.BytesIO(sample["png"]))), images[i])
            assert int(sample["cls"]) == labels[i] == json.loads(sample["json"])["label"]
    assert not list(out.glob("*.partial"))


def test_image_files_go_in_as_they_were_and_a_bad_one_is_named(tmp_path: Path, capsys) -> None:
    root = tmp_path / "folder"
    build_image_folder(root)
    out = tmp_path / "shards"
    code, _, err = in_process(capsys, "shard", "classify-fashion", "data.name=image-folder", f"data.root={root}",
                              "--out", str(out))
    assert code == 0, err
    classes = sorted(p.name for p in (root / "train").iterdir())
    for split in ("train", "val"):
        samples = shard_samples(out, split)
        files = sorted((root / split).rglob("*.*"))
        assert len(samples) == len(files)
        for sample in samples:
            source = Path(json.loads(sample["json"])["source"])
            ext = source.suffix.lstrip(".").lower()
            assert sample[ext] == source.read_bytes()  # the file's bytes, never re-encoded
            assert int(sample["cls"]) == classes.index(source.parent.name)
    bad = truncated_jpeg(root / "train" / classes[0] / "cut.jpg")
    code, _, err = in_process(capsys, "shard", "classify-fashion", "data.name=image-folder", f"data.root={root}",
                              "--out", str(tmp_path / "other"))
    assert code == 2 and str(bad) in err and len(err.strip().splitlines()) == 1, err


def test_detection_labels_are_the_readers(tmp_path: Path, capsys) -> None:
    root = tmp_path / "coco"
    build_coco(root, orientations=(6, 1))  # the boxes of a turned phone photo are the upright image's
    out = tmp_path / "shards"
    code, _, err = in_process(capsys, "shard", "detect-faster-rcnn", "data.name=coco", f"data.root={root}",
                              "data.train_split=train2017", "data.val_split=val2017", "--out", str(out),
                              "--shard-size", "20KB")
    assert code == 0, err
    index = json.loads((out / "index.json").read_text())
    assert index["kind"] == "detection" and index["category_ids"] == [1, 2]
    for split in ("train2017", "val2017"):
        records = read_coco(str(root / "annotations" / f"instances_{split}.json"), str(root / split)).records
        samples = shard_samples(out, split)
        assert len(samples) == len(records)
        for record, sample in zip((records[int(i)] for i in written_order(len(records))), samples):
            labels = json.loads(sample["json"])
            assert np.array_equal(np.array(labels["boxes"], np.float32).reshape(-1, 4), record.boxes)
            assert labels["labels"] == record.labels.tolist() and labels["source"] == record.path
            assert (labels["height"], labels["width"], labels["image_id"]) == (record.height, record.width,
                                                                               record.image_id)
            assert sample["jpg"] == Path(record.path).read_bytes()


def digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_a_killed_write_continues_to_the_same_shards(digits, tmp_path: Path, capsys) -> None:
    """The digits' write (95 shards) killed once three shards are listed, then the same command
    again: every file is the bytes of the straight write (the module's ``digits``)."""
    straight, _ = digits
    out = tmp_path / "killed"
    proc = start_cli(*DIGITS_SHARDS, "--out", str(out))

    def listed() -> int:
        try:
            return len(json.loads((out / "index.json").read_text())["splits"]["train"]["shards"])
        except (OSError, ValueError):
            return 0
    wait_for(lambda: listed() >= 3, "three shards listed", proc)
    os.killpg(proc.pid, signal.SIGKILL)
    finish(proc, 60)
    assert proc.returncode == -signal.SIGKILL
    assert listed() < len(json.loads((straight / "index.json").read_text())["splits"]["train"]["shards"])
    code, _, err = in_process(capsys, *DIGITS_SHARDS, "--out", str(out))
    assert code == 0, err
    assert digest(out) == digest(straight)  # no partial shard left, every byte the same

    code, _, err = in_process(capsys, "shard", "classify-fashion", "data.name=fashion-mnist", "data.limit_train=50",
                              "data.limit_val=50", "--out", str(out))
    assert code == 2 and "holds shards of other data ('digits'" in err, err


@pytest.mark.parametrize("text, size", [("1GB", 10**9), ("256MiB", 256 * 2**20), ("64k", 64_000), ("1500", 1500),
                                        ("0.5 GB", 5 * 10**8)])
def test_shard_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_a_bad_shard_size_is_named(tmp_path: Path, capsys) -> None:
    code, _, err = in_process(capsys, "shard", "classify-fashion", "data.name=digits", "--out", str(tmp_path),
                              "--shard-size", "big")
    assert code == 2 and "--shard-size: expected bytes or a size such as 500MB" in err, err


def test_the_test_split_is_written_where_the_source_has_one_and_validate_reads_it(tmp_path: Path, capsys) -> None:
    """`shard` wrote train and val only, so `validate --split test` on a run from the shards failed. It
    writes data.test_split too where the source has it (--splits chooses), and validate reads it."""
    root, out, run = tmp_path / "folder", tmp_path / "shards", tmp_path / "run"
    build_image_folder(root)
    code, _, err = in_process(capsys, "shard", "classify-fashion", "data.name=image-folder", f"data.root={root}",
                              "--out", str(tmp_path / "two"))
    assert code == 0 and "no test split written" in err, err
    assert set(json.loads((tmp_path / "two" / "index.json").read_text())["splits"]) == {"train", "val"}
    add_image_folder_split(root, "test", per_class=3)
    code, _, err = in_process(capsys, "shard", "classify-fashion", "data.name=image-folder", f"data.root={root}",
                              "--out", str(out))
    assert code == 0, err
    assert json.loads((out / "index.json").read_text())["splits"]["test"]["samples"] == 6
    assert len(shard_samples(out, "test")) == 6
    # the run's length and size; classify-fashion loads in this process (data.num_workers: 0)
    code, _, err = in_process(capsys, "fit", "classify-fashion", "data.name=shards", f"data.shards={out}",
                              "data.image_size=16", "data.batch_size=4", "trainer.max_steps=2", "--run-dir", str(run))
    assert code == 0, err
    code, printed, err = in_process(capsys, "validate", str(run), "--split", "test")
    assert code == 0, err
    result = json.loads(printed.strip().splitlines()[-1])
    assert {name: row["support"] for name, row in result["per_class"].items()} == {"circle": 3, "cross": 3}
    code, _, err = in_process(capsys, "shard", "classify-fashion", "data.name=image-folder", f"data.root={root}",
                              "--out", str(tmp_path / "chosen"), "--splits", "train,val")
    assert code == 0 and set(json.loads((tmp_path / "chosen" / "index.json").read_text())["splits"]) == {"train", "val"}
    code, _, err = in_process(capsys, "shard", "classify-fashion", "data.name=digits", "--out", str(tmp_path / "d"),
                              "--splits", "train,test")
    assert code == 2 and "digits has two fixed splits, train and val, and no test split" in err, err
