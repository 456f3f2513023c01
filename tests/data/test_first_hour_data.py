"""A user's first hour with their own data: no silent wrong result.

Hidden folders (Jupyter's ``.ipynb_checkpoints``) are not classes, ``data.limit_*`` keeps every class
of an image folder, and aspect-ratio batching says in plain words what it does. All in-process, on
tiny generated PNG trees.
"""
from __future__ import annotations

import collections
import logging
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from dataset_trees import build_png_tree
from visiontrain.data.datasets.classification import build_classification_data
from visiontrain.data.datasets.sources import ClassificationReader
from visiontrain.data.samplers import GroupedBatchSampler


def _labels_by_class(ds, classes: list[str]) -> dict[str, set[int]]:
    """Which labels the files of each class folder got."""
    out: dict[str, set[int]] = collections.defaultdict(set)
    for path, label in ds.samples:
        out[Path(path).parent.name].add(label)
    return {c: out[c] for c in classes}


# ---------------------------------------------------------------- item 1: hidden folders
def test_hidden_folders_and_files_are_neither_classes_nor_images(tmp_path: Path) -> None:
    root = tmp_path / ".cache" / "imgs"  # a data root under a hidden directory is still read
    build_png_tree(root, {"train": ["cat", "dog"], "val": ["cat", "dog"]})
    cat = root / "train" / "cat" / "0.png"
    for hidden in (root / "train" / ".ipynb_checkpoints" / "0-checkpoint.png",  # Jupyter, on opening 0.png
                   root / "train" / "cat" / ".ipynb_checkpoints" / "0-checkpoint.png",
                   root / "val" / "dog" / "._0.png"):  # macOS resource fork beside the image
        hidden.parent.mkdir(parents=True, exist_ok=True)
        hidden.write_bytes(cat.read_bytes())
    d = build_classification_data("image-folder", ClassificationReader(root=str(root), image_size=8))
    assert d.class_names == ["cat", "dog"] and d.num_classes == 2
    assert (len(d.train), len(d.val)) == (6, 6)
    assert not any("/." in p[len(str(root)):] for p, _ in [*d.train.samples, *d.val.samples])
    # the same class folder gets the same label in both splits (the train split's map)
    assert _labels_by_class(d.train, ["cat", "dog"]) == _labels_by_class(d.val, ["cat", "dog"]) == \
        {"cat": {0}, "dog": {1}}


def test_class_folder_with_only_hidden_files_is_an_error_naming_it(tmp_path: Path) -> None:
    build_png_tree(tmp_path, {"train": ["cat", "dog"], "val": ["cat", "dog"]}, n=1)
    cat = tmp_path / "train" / "cat"
    (cat / "0.png").rename(cat / ".0.png")
    with pytest.raises(FileNotFoundError) as info:
        build_classification_data("image-folder", ClassificationReader(root=str(tmp_path), image_size=8))
    msg = str(info.value)
    assert f"image-folder split {tmp_path / 'train'}: Found no valid file for the classes cat." in msg
    assert str(cat) in msg and "Supported extensions are: .jpg" in msg


# ---------------------------------------------------------------- item 8: balanced limits
def test_image_folder_limits_keep_every_class_and_are_deterministic(tmp_path: Path) -> None:
    build_png_tree(tmp_path, {"train": ["a", "b", "c"], "val": ["a", "b", "c"]}, n=4)

    def build():
        return build_classification_data("image-folder", ClassificationReader(root=str(tmp_path), image_size=8,
                                                                              limit_train=6, limit_val=4))

    d = build()
    assert collections.Counter(d.train.targets) == {0: 2, 1: 2, 2: 2}
    assert sorted(collections.Counter(d.val.targets).values()) == [1, 1, 2]
    assert list(d.train.samples) == list(build().train.samples) and list(d.val.samples) == list(build().val.samples)
    names = {Path(p).name for p, _ in d.train.samples}
    assert names != {"0.png", "1.png"}  # shuffled within a class, not each class's first files


# ---------------------------------------------------------------- item 12: aspect-ratio batching
def test_grouped_sampler_error_says_what_grouping_is_and_the_switch() -> None:
    with pytest.raises(ValueError) as info:
        GroupedBatchSampler([1] * 15 + [0], 16, seed=0)
    msg = str(info.value)
    assert "batched by orientation (1 portrait, 15 landscape or square)" in msg
    assert "no orientation has enough images for one batch of 16" in msg
    assert "data.batch_size" in msg and "task.group_aspect=false" in msg and "{" not in msg


def test_loaders_say_once_how_many_images_each_epoch_leaves_out(caplog) -> None:
    from visiontrain.core.config import load_config
    from visiontrain.engine.setup.loaders import loaders
    from visiontrain.engine.parallel.distributed import DistInfo
    from visiontrain.engine.protocols.task import TaskData

    cfg = load_config("classify-fashion", ["data.batch_size=4"])  # ships in-process (num_workers 0)
    ds = TensorDataset(torch.zeros(21, 1), torch.zeros(21, dtype=torch.int64))
    data = TaskData(ds, ds, {}, random_transforms=False, group_ids=[0] * 5 + [1] * 16)
    with caplog.at_level(logging.INFO, logger="visiontrain"):
        source, _ = loaders(data, cfg, DistInfo(), torch.device("cpu"))
    sampler = source.sampler
    assert sampler.left_out_per_epoch == 1 and len(sampler) == 5
    lines = [r.getMessage() for r in caplog.records if "leaves" in r.getMessage()]
    assert len(lines) == 1 and "leaves 1 out of each epoch" in lines[0] and "task.group_aspect=false" in lines[0]
