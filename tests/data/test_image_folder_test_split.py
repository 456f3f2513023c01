"""`visiontrain validate RUN --split test` on an image folder reads ROOT/test/<class>/* (data.test_split),
a split no training step touched; a run whose datasets have fixed splits says so in plain words,
with what to run instead. The image folder replaces classify-fashion's Fashion-MNIST: its splits are
this file's subject."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dataset_trees import add_image_folder_split, build_image_folder
from procs import cli_here
from visiontrain.core import config as C
from visiontrain.use.trained import load_trained


def test_validate_split_test_evaluates_the_image_folders_test_directory(tmp_path: Path, capfd) -> None:
    # classify-fashion loads in-process (data.num_workers: 0): its fit and validates run in this process
    root = tmp_path / "imgs"
    build_image_folder(root)  # train: 16 images, val: 8
    run = tmp_path / "r"
    proc = cli_here("fit", "classify-fashion", "data.name=image-folder", f"data.root={root}", "data.image_size=16",
                    "data.batch_size=4", "trainer.max_steps=2", "--run-dir", str(run), capture=capfd)
    assert proc.returncode == 0, proc.stderr[-3000:]

    proc = cli_here("validate", str(run), "--split", "test", capture=capfd)  # no test/ yet
    assert proc.returncode == 2 and f"image-folder directory {root / 'test'} does not exist" in proc.stderr

    add_image_folder_split(root, "test", per_class=3)
    proc = cli_here("validate", str(run), "--split", "test", capture=capfd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["split"] == "test" and result["data_split"] == "test"
    assert {name: row["support"] for name, row in result["per_class"].items()} == {"circle": 3, "cross": 3}
    proc = cli_here("validate", str(run), capture=capfd)  # the validation split, as before
    assert {n: r["support"] for n, r in json.loads(proc.stdout.strip().splitlines()[-1])["per_class"].items()} \
        == {"circle": 4, "cross": 4}


def test_validate_split_test_on_fixed_splits_says_what_happened(classify_checkpoint: Path, capfd) -> None:
    """A digits run: its val split is the held-out one, and the message says so, not that a key is unread."""
    proc = cli_here("validate", str(classify_checkpoint), "--split", "test", capture=capfd)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line == ("visiontrain: error: digits has no 'test' split (asked for by `visiontrain validate --split test`, "
                    "or data.val_split): its two splits are fixed, train and val (val is a fixed stratified 20 % of "
                    "scikit-learn's 1,797 digits), and `visiontrain validate RUN` evaluates on val. Split names "
                    "choose the directories of data.name=image-folder (ROOT/<split>/<class>/) and the splits of "
                    "detection datasets")


def test_validate_split_test_of_a_dino_run_says_there_is_none(tmp_path: Path) -> None:
    """DINO reads an image folder's train/ and val/ only: refused before any data or model is built."""
    cfg = C.load_config("ssl-dino", [])
    path = tmp_path / "dino.pt"
    torch.save({"config": C.config_to_dict(cfg), "data_info": {}, "progress": {"step": 0}}, path)
    with pytest.raises(C.ConfigError) as info:
        load_trained(path, split="test")
    assert str(info.value) == (
        "--split test: this run's task has fixed splits, so there is no test split to evaluate (DINO reads an image "
        "folder's train/ (its training images and k-NN bank) and val/ (the k-NN queries) only); `visiontrain "
        "validate RUN` without --split evaluates on its validation split")
