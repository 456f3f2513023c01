"""Tiny Cityscapes and ADE20K trees in the layouts their downloads unpack to (docs/datasets.md):
Cityscapes' ``leftImg8bit/<split>/<city>/`` and ``gtFine/<split>/<city>/`` (labelIds PNGs, and the
labelTrainIds PNGs cityscapesscripts' createTrainIdLabelImgs writes beside them), and ADE20K's
``ADEChallengeData2016`` (``images/`` JPEGs, ``annotations/`` grey PNGs, 0 = other).

Each label map is vertical stripes of known values (``cityscapes_ids``, ``ade20k_values``), shifted
by the image's index, and each image paints a stripe in a grey of its value, so a test knows every
pixel's value and a network has something to learn."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from visiontrain.data.segmentation.class_tables import CITYSCAPES_LABEL_IDS

#: Every labelId of a train class, then ids of none (unlabeled, ego vehicle, static, parking, guard rail,
#: caravan, trailer) and 255 (license plate's -1 written in a byte).
CITYSCAPES_IDS = (*CITYSCAPES_LABEL_IDS, 0, 1, 4, 9, 14, 29, 30, 255)
CITYSCAPES_SPLITS = {"train": {"aachen": 2, "bochum": 2}, "val": {"frankfurt": 2}}
ADE20K_SPLITS = {"training": 4, "validation": 2}
STRIPE = 4  # px a value


def stripes(values: tuple[int, ...], index: int, height: int) -> np.ndarray:
    """uint8 [height, len(values) * STRIPE]: a stripe per value, rolled by ``index`` stripes."""
    row = np.repeat(np.roll(np.asarray(values, np.uint8), index), STRIPE)
    return np.repeat(row[None], height, axis=0)


def cityscapes_ids(index: int) -> np.ndarray:
    """The labelIds of Cityscapes image ``index`` (27 values, 108 x 54 px, Cityscapes' 2:1)."""
    return stripes(CITYSCAPES_IDS, index, 54)


def cityscapes_train_ids(ids: np.ndarray) -> np.ndarray:
    """What createTrainIdLabelImgs writes for ``ids``: each train class's id its train id, others 255."""
    table = np.full(256, 255, np.uint8)
    table[list(CITYSCAPES_LABEL_IDS)] = np.arange(len(CITYSCAPES_LABEL_IDS))
    return table[ids]


def ade20k_values(index: int) -> np.ndarray:
    """The label values of ADE20K image ``index``: 0 (other), 1, 2, 75, 149, 150 (the last class)."""
    return stripes((0, 1, 2, 75, 149, 150), index, 20)


def grey(values: np.ndarray) -> np.ndarray:
    """An RGB image of ``values``' stripes, each in a grey of its value, with a little noise (a photo's
    grain: a flat image draws as too small a figure to tell from an empty one)."""
    noise = np.random.default_rng(int(values.sum())).integers(-12, 13, (*values.shape, 3))
    level = 24 + (values.astype(np.int64) * 37) % 208
    return np.clip(level[..., None] + noise, 0, 255).astype(np.uint8)


def write_cityscapes(root: Path, splits: dict[str, dict[str, int]] | None = None) -> Path:
    """``root`` as Cityscapes: ``splits`` split -> city -> image count (default ``CITYSCAPES_SPLITS``),
    each image ``<city>_000000_<i>_leftImg8bit.png`` with its ``_gtFine_labelIds.png`` and
    ``_gtFine_labelTrainIds.png``. Image i of a split (counted across its cities) is ``cityscapes_ids(i)``."""
    for split, cities in (splits or CITYSCAPES_SPLITS).items():
        index = 0
        for city, n in cities.items():
            (root / "leftImg8bit" / split / city).mkdir(parents=True, exist_ok=True)
            (root / "gtFine" / split / city).mkdir(parents=True, exist_ok=True)
            for _ in range(n):
                stem, ids = f"{city}_000000_{index:06d}", cityscapes_ids(index)
                Image.fromarray(grey(ids)).save(root / "leftImg8bit" / split / city / f"{stem}_leftImg8bit.png")
                Image.fromarray(ids, mode="L").save(root / "gtFine" / split / city / f"{stem}_gtFine_labelIds.png")
                Image.fromarray(cityscapes_train_ids(ids), mode="L").save(
                    root / "gtFine" / split / city / f"{stem}_gtFine_labelTrainIds.png")
                index += 1
    return root


def write_ade20k(root: Path, splits: dict[str, int] | None = None) -> Path:
    """``root`` as ADEChallengeData2016: ``splits`` split -> image count (default ``ADE20K_SPLITS``),
    ``images/<split>/ADE_<split>_<i>.jpg`` and ``annotations/<split>/ADE_<split>_<i>.png`` holding
    ``ade20k_values(i)``."""
    for split, n in (splits or ADE20K_SPLITS).items():
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "annotations" / split).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            stem, values = f"ADE_{split}_{i + 1:08d}", ade20k_values(i)
            Image.fromarray(grey(values)).save(root / "images" / split / f"{stem}.jpg", quality=95)
            Image.fromarray(values, mode="L").save(root / "annotations" / split / f"{stem}.png")
    return root
