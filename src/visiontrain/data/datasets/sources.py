"""The ``data`` keys of each classification source, read by ``build_classification_data``: digits
(bundled with scikit-learn) reads the size, augmentation and its fixed splits' names; fashion-mnist
also where its files are and whether to download them; an image folder its directories and what an
unreadable image file does, and may leave the train images uint8 for the device."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from visiontrain.core.config import register_kind
from visiontrain.core.typed_config import doc
from visiontrain.data.section import DataConfig, ImageFileKeys, SplitKeys


@dataclass
class ClassificationKeys(SplitKeys, DataConfig):
    """What every classification source reads: the model's input size and the train augmentation."""

    image_size: int | None = doc("model input side; None = the dataset's native size", None, minimum=1)
    augment: str = doc("train augmentation: none | flip | basic | imagenet", "none")


@dataclass
class DigitsDataConfig(ClassificationKeys):
    """digits: in memory, two fixed splits (train and val)."""

    in_memory: ClassVar[bool] = True
    name: str = doc("dataset: digits (scikit-learn's 8 x 8 digits, two fixed splits)", "digits")
    on_device: bool | Literal["auto"] = doc(
        "keep the whole set on the GPU and prepare its batches there (index, flip, normalise: the step waits "
        "for no loader); auto: on a GPU when data.num_workers is 0 and the set takes at most a quarter of the "
        "free memory. The batches, their samples and each sample's augmentation are those of the CPU path", "auto")


@dataclass
class FashionMnistDataConfig(DigitsDataConfig):
    """fashion-mnist: read from data.root (torchvision's files), two fixed splits."""

    name: str = doc("dataset: fashion-mnist (two fixed splits, train and val)", "fashion-mnist")
    root: str | None = doc("directory of torchvision's FashionMNIST files (null: the default data directory)", None)
    download: bool = doc("allow torchvision to download the dataset if it is not found", False)


@dataclass
class ImageFolderDataConfig(ImageFileKeys, ClassificationKeys):
    """image-folder: ROOT/<split>/<class>/*.jpg, each image decoded when it is loaded."""

    name: str = doc("dataset: image-folder (ROOT/<split>/<class>/*)", "image-folder")
    root: str | None = doc("dataset directory (image-folder: ROOT/train, ROOT/val)", None)
    decode: Literal["auto", "cpu", "gpu"] = doc(
        "where the training images' JPEG files are decoded: cpu (PIL, in the loader's workers), or gpu (the "
        "workers read the files and draw each sample's crop and flip; the device decodes the batch with "
        "nvJPEG, crops, resizes, flips and normalises it; a file that is not a JPEG, or that nvJPEG cannot "
        "decode, is decoded on the CPU and counted). Needs data.augment imagenet. auto: gpu on a GPU for "
        "augment imagenet, else cpu. Evaluation decodes on the CPU either way", "auto")

    def image_policy(self) -> str:
        """What an image file that cannot be read does."""
        return self.on_bad_image or "error"


for _config in (DigitsDataConfig, FashionMnistDataConfig, ImageFolderDataConfig):
    register_kind("data", _config.name, _config)


@dataclass(frozen=True)
class ClassificationReader:
    """What a classification source is read with (``build_classification_data``, ``build_image_folder``,
    ``build_shards_classification``): a data section's keys, as ``reader_args`` takes them from it."""
    root: str | None = None
    image_size: int | None = None          # None: the source's native size (an image folder's default)
    augment: str = "none"
    limit_train: int | None = None
    limit_val: int | None = None
    download: bool = False
    uint8_train: bool = False              # train images stay uint8, normalised on the device
    train_split: str = "train"             # an image folder's split directories, or a shard directory's splits
    val_split: str = "val"
    shards: Any = None                     # what data.name=shards reads (ShardsDataConfig.shard_spec)
    decode_on_device: bool = False         # image-folder's data.decode resolved to gpu (the task resolves it)


def reader_args(data: DataConfig) -> ClassificationReader:
    """How a classification source's section is read (a source without a key, such as digits' root,
    gets the reader's default)."""
    return ClassificationReader(
        root=getattr(data, "root", None), image_size=getattr(data, "image_size", None),
        augment=getattr(data, "augment", "none"), limit_train=data.limit_train, limit_val=data.limit_val,
        download=getattr(data, "download", False), uint8_train=getattr(data, "normalize_on_device", False),
        train_split=getattr(data, "train_split", "train"), val_split=getattr(data, "val_split", "val"),
        shards=data.shard_spec() if hasattr(data, "shard_spec") else None)
