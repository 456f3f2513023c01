"""Image-classification datasets: one entry point, ``build_classification_data``.

=============  =========================================================================
name           source
=============  =========================================================================
fashion-mnist  idx files (Debian ``dataset-fashion-mnist`` or ``root``), 60k/10k, 28x28 grey
digits         ``sklearn.datasets.load_digits``: 1,797 8x8 grey, fixed stratified 80/20 split
image-folder   ``root/train/<class>/*`` and ``root/val/<class>/*``, RGB (``data.train_split`` / ``val_split``)
shards         ``visiontrain shard``'s tar shards at ``data.shards``, read as an image folder (``data/shards``)
=============  =========================================================================

Only an image folder has split names to choose (and a test split, ``root/test``); the splits of
``fashion-mnist`` and ``digits`` are fixed. Its files are checked before training by
``check_image_files``.

Augment policies: ``none`` (to float + normalise with the dataset mean/std), ``basic`` (RandomCrop
with padding 2, or 1 for digits, + horizontal flip for Fashion-MNIST), ``imagenet``
(RandomResizedCrop + flip + ImageNet mean/std; val: Resize(size/0.875) + CenterCrop).  Digits are
never flipped (a flipped digit is another glyph).  All randomness comes from torch's global RNG.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from dataclasses import dataclass
from importlib.metadata import version

import numpy as np
import torch
from torch.utils.data import Dataset

from visiontrain.core.typed_config import did_you_mean
from visiontrain.data.cache_dir import data_cache_dir
from visiontrain.data.datasets.fashion_mnist import CLASS_NAMES, load_fashion_mnist
from visiontrain.data.datasets.in_memory import ImageSetFacts, check_augment, make_in_memory_pair
from visiontrain.data.datasets.sources import ClassificationReader
from visiontrain.data.eval_transform import EvalTransform

DATASETS = ("fashion-mnist", "digits", "image-folder", "shards")
FILE_SOURCES = ("image-folder", "shards")  # RGB image files, decoded when loaded
FIXED_SPLITS = {"fashion-mnist": "val is Fashion-MNIST's official 10,000 test images",
                "digits": "val is a fixed stratified 20 % of scikit-learn's 1,797 digits"}
DIGITS_VAL_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0


@dataclass
class ClassificationData:
    train: Dataset  # items: (float32 Tensor [C,H,W], normalised; int label)
    val: Dataset
    num_classes: int
    class_names: list[str]
    in_channels: int
    image_size: int  # side of the (square) model input
    random_train_transforms: bool  # True when train items draw from torch's RNG (augmentation)
    eval_transform: EvalTransform  # how a val item is made from its pixels: data_info["preprocess"]


@functools.lru_cache(maxsize=1)
def digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(train_images uint8 [N,8,8] 0..16, train_labels, val_images, val_labels)``: fixed, stratified.

    Made once per machine by scikit-learn and kept in the data cache dir (an .npz of plain arrays,
    named by scikit-learn's version and the split's fraction and seed): importing scikit-learn costs
    a process about 3 s, which every rank and every run on the digits would pay again.
    Cached in memory too: the arrays are shared between callers; copy before modifying.
    """
    cached = data_cache_dir() / f"digits-split-{version('scikit-learn')}-{DIGITS_VAL_FRACTION}-{DIGITS_SPLIT_SEED}.npz"
    try:
        with np.load(cached) as arrays:  # no pickles: allow_pickle stays False
            return tuple(arrays[name] for name in _DIGITS_ARRAYS)
    except (OSError, KeyError, ValueError):
        pass
    split = _split_digits()
    with contextlib.suppress(OSError):  # a cache that cannot be written costs the next process 3 s, no more
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cached.parent, suffix=".tmp", delete=False) as tmp:
            np.savez(tmp, **dict(zip(_DIGITS_ARRAYS, split)))
        os.replace(tmp.name, cached)
    return split


_DIGITS_ARRAYS = ("train_images", "train_labels", "val_images", "val_labels")


def _split_digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    images = bunch.images.astype(np.uint8)  # values 0..16
    labels = bunch.target.astype(np.int64)
    train_idx, val_idx = train_test_split(
        np.arange(len(labels)), test_size=DIGITS_VAL_FRACTION, stratify=labels, random_state=DIGITS_SPLIT_SEED
    )
    return images[train_idx], labels[train_idx], images[val_idx], labels[val_idx]


def _limit(ds, n: int | None, name: str):
    if n is not None and n < 1:
        raise ValueError(f"{name} must be >= 1, got {n}")
    return ds.subset(n)


def build_classification_data(name: str, reader: ClassificationReader) -> ClassificationData:
    """Train/val datasets plus what a model needs to know about them (see the module doc), read as
    ``reader`` says."""
    r = reader
    image_size, augment, train_split, val_split = r.image_size, r.augment, r.train_split, r.val_split
    if name not in DATASETS:
        raise ValueError(f"data.name: unknown classification dataset {name!r}{did_you_mean(name, list(DATASETS))}; "
                         f"expected one of {', '.join(DATASETS)}")
    check_augment(augment)
    if r.uint8_train and name not in FILE_SOURCES:
        raise ValueError(f"data.normalize_on_device=true applies to data.name=image-folder, shards and the detection "
                         f"datasets; {name!r} is held in memory as float tensors already (set it to false)")
    if name in FILE_SOURCES:
        return _decoded_from_files(name, r)
    for key, split, fixed in (("train_split", train_split, "train"), ("val_split", val_split, "val")):
        if split != fixed:
            asked = ("`visiontrain validate --split test`, or data.val_split" if key == "val_split"
                     else "data.train_split")
            raise ValueError(f"{name} has no {split!r} split (asked for by {asked}): its two splits are fixed, "
                             f"train and val ({FIXED_SPLITS[name]}), and `visiontrain validate RUN` evaluates on "
                             f"val. Split names choose the directories of data.name=image-folder "
                             f"(ROOT/<split>/<class>/) and the splits of detection datasets")

    if name == "fashion-mnist":
        (tx, ty), (vx, vy) = load_fashion_mnist(r.root, r.download)
        facts = ImageSetFacts(list(CLASS_NAMES), max_value=255.0, basic_padding=2, flip_ok=True)
    else:  # digits
        a, b, c, d = digits_split()
        tx, ty = torch.tensor(a).unsqueeze(1), torch.tensor(b)  # copies: the split is cached
        vx, vy = torch.tensor(c).unsqueeze(1), torch.tensor(d)
        facts = ImageSetFacts([str(i) for i in range(10)], max_value=16.0, basic_padding=1, flip_ok=False)
    classes = list(facts.classes)
    train, val, size = make_in_memory_pair((tx, ty), (vx, vy), facts, image_size=image_size, augment=augment)
    train = _limit(train, r.limit_train, "limit_train")
    val = _limit(val, r.limit_val, "limit_val")
    return ClassificationData(
        train=train, val=val, num_classes=len(classes), class_names=classes,
        in_channels=int(tx.shape[1]), image_size=size, random_train_transforms=train.random_transforms,
        eval_transform=val.eval_transform,
    )


def _decoded_from_files(name: str, reader: ClassificationReader) -> ClassificationData:
    """An image folder's datasets, or those of classification shards: image files decoded to RGB."""
    if name == "shards":
        from visiontrain.data.shards.datasets import build_shards_classification

        if reader.shards is None:
            raise ValueError("data.name=shards needs data.shards=DIR or URL (the --out of `visiontrain shard`)")
        train, val, classes, size = build_shards_classification(reader)
    else:
        from visiontrain.data.datasets.image_folder import build_image_folder

        train, val, classes, size = build_image_folder(reader)
    return ClassificationData(train, val, len(classes), classes, 3, size, reader.augment != "none",
                              val.eval_transform)


def check_image_files(data: ClassificationData, *, on_bad_image: str, max_skipped_share: float,
                      check: str = "changed") -> None:
    """Open every image file of an image folder's splits before training, under ``data.on_bad_image``
    (``ImageFolderClassification.check_files``); fashion-mnist and digits have no files to check.
    ``check``: ``data.check_images`` (off: none is opened)."""
    from visiontrain.data.datasets.image_folder import ImageFolderClassification

    if check == "off":
        return
    for split in (data.train, data.val):
        if isinstance(split, ImageFolderClassification):
            split.check_files(on_bad_image, max_skipped_share, check)


def classification_eval_transform(name: str, *, root: str | None, image_size: int | None, augment: str,
                                  download: bool = False) -> EvalTransform:
    """The validation transform ``build_classification_data`` gives for these settings, for a
    checkpoint written before ``data_info`` recorded it. image-folder's needs only the size; an
    in-memory set's normalisation is its train split's statistics, so its files are read again
    (a missing dataset raises the loader's error, naming the paths searched)."""
    if name == "image-folder":
        from visiontrain.data.datasets.image_folder import DEFAULT_IMAGE_SIZE, image_folder_eval_transform

        return image_folder_eval_transform(DEFAULT_IMAGE_SIZE if image_size is None else int(image_size))
    reader = ClassificationReader(root=root, image_size=image_size, augment=augment, download=download)
    return build_classification_data(name, reader).eval_transform
