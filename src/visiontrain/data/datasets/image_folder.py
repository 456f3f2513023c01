"""``root/train/<class>/*.jpg`` + ``root/val/<class>/*.jpg``, scanned with torchvision's ImageFolder.

Images are decoded with PIL to RGB (any mode: grey, palette, RGBA, 16-bit; ``data.images``) and
transformed with ``torchvision.transforms.v2``; normalisation uses ImageNet mean/std. A file that
cannot be decoded stops the run with its path when it is loaded (files are not all opened up front:
ImageNet has 1.3M). An empty split or class directory is an error naming the directory. The
dataset object keeps only the sample list and a transform spec (the v2 objects are rebuilt after
unpickling), so spawned DataLoader workers do not import torchvision before the compatibility shim.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor
from torch.utils.data import Dataset

from visiontrain.data.datasets.in_memory import IMAGENET_MEAN, IMAGENET_STD, VAL_CROP_RATIO, check_augment, tv_v2

DEFAULT_IMAGE_SIZE = 224
LAYOUT = "ROOT/train/<class>/*.jpg and ROOT/val/<class>/*.jpg (one sub-directory per class)"


class ImageFolderClassification(Dataset):
    """Items ``(float32 [3,S,S] normalised image, int label)``; ``mode`` is "val", "basic" or "imagenet"."""

    mean, std = IMAGENET_MEAN, IMAGENET_STD  # the normalisation, also for transforms built elsewhere

    def __init__(self, samples: list[tuple[str, int]], classes: list[str], *, image_size: int, mode: str,
                 uint8: bool = False) -> None:
        self.samples = list(samples)
        self.uint8 = uint8  # True: no ToDtype/Normalize here; the device does them (NormalizeOnDevice)
        self.classes = list(classes)
        self.image_size = int(image_size)
        self.mode = mode
        self._tf = None
        self._build()

    def _build(self) -> None:
        v2 = tv_v2()
        import torch

        s = self.image_size
        if self.mode == "imagenet":
            geometry = [v2.RandomResizedCrop(s, antialias=True), v2.RandomHorizontalFlip()]
        elif self.mode == "basic":
            geometry = [v2.Resize(int(s / VAL_CROP_RATIO), antialias=True), v2.RandomCrop(s), v2.RandomHorizontalFlip()]
        elif self.mode == "val":
            geometry = [v2.Resize(int(s / VAL_CROP_RATIO), antialias=True), v2.CenterCrop(s)]
        else:
            raise ValueError(f"unknown image-folder transform mode {self.mode!r}")
        finish = [] if self.uint8 else [v2.ToDtype(torch.float32, scale=True),
                                        v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
        self._tf = v2.Compose([v2.ToImage(), *geometry, *finish])

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tf"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._build()

    @property
    def targets(self) -> list[int]:
        return [t for _, t in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def raw_item(self, index: int) -> tuple[Any, int]:
        """The decoded RGB PIL image and its label, for transforms built elsewhere (DINO's multi-crop).
        A corrupt or truncated file raises ``UnreadableImageError`` naming it."""
        from visiontrain.data.images import open_rgb

        path, label = self.samples[index]
        return open_rgb(path), int(label)

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        img, label = self.raw_item(index)
        return self._tf(img).as_subclass(Tensor).contiguous(), label


def _scan(directory: Path) -> tuple[list[tuple[str, int]], list[str]]:
    from visiontrain._tv_compat import ensure_torchvision

    ensure_torchvision()
    from torchvision.datasets import ImageFolder

    try:
        folder = ImageFolder(str(directory))
    except FileNotFoundError as err:  # a class without images; torchvision's message names no directory
        raise FileNotFoundError(f"image-folder split {directory}: {err}") from None
    return [(str(p), int(t)) for p, t in folder.samples], list(folder.classes)


def _class_dirs(directory: Path) -> list[str]:
    return sorted(e.name for e in directory.iterdir() if e.is_dir() and not e.name.startswith("."))


def build_image_folder(
    root: str | None, *, image_size: int | None, augment: str, limit_train: int | None, limit_val: int | None,
    uint8_train: bool = False,
) -> tuple[Dataset, Dataset, list[str], int]:
    """``(train, val, class_names, image_size)``."""
    check_augment(augment)
    if root is None:
        raise FileNotFoundError(f"data.name=image-folder needs data.root=ROOT with the layout {LAYOUT}")
    base = Path(root).expanduser()
    for d in (base, base / "train", base / "val"):
        if not d.is_dir():
            raise FileNotFoundError(f"image-folder directory {d} does not exist; expected the layout {LAYOUT}")
    train_classes, val_classes = _class_dirs(base / "train"), _class_dirs(base / "val")
    for split, found in (("train", train_classes), ("val", val_classes)):
        if not found:
            raise FileNotFoundError(f"no class sub-directories in {base / split}; expected the layout {LAYOUT}")
    if train_classes != val_classes:
        raise ValueError(
            "image-folder: the val classes must equal the train classes.\n"
            f"  train ({base / 'train'}): {train_classes}\n"
            f"  val   ({base / 'val'}): {val_classes}\n"
            f"  only in train: {sorted(set(train_classes) - set(val_classes))}; "
            f"only in val: {sorted(set(val_classes) - set(train_classes))}"
        )
    train_samples, classes = _scan(base / "train")
    val_samples, _ = _scan(base / "val")
    size = DEFAULT_IMAGE_SIZE if image_size is None else int(image_size)
    for name, n in (("limit_train", limit_train), ("limit_val", limit_val)):
        if n is not None and n < 1:
            raise ValueError(f"{name} must be >= 1, got {n}")
    train_samples = train_samples[:limit_train] if limit_train is not None else train_samples
    val_samples = val_samples[:limit_val] if limit_val is not None else val_samples
    train = ImageFolderClassification(
        train_samples, classes, image_size=size, mode="val" if augment == "none" else augment, uint8=uint8_train
    )
    val = ImageFolderClassification(val_samples, classes, image_size=size, mode="val")
    return train, val, classes, size
