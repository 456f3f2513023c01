"""Label maps and the datasets that give them. A sample is

    image:  tv_tensors.Image, uint8 [3, H, W]
    labels: tv_tensors.Mask, uint8 [H, W]: each pixel's class (0..num_classes-1) or the ignore index

before transforms, so that every v2 transform moves the labels with the image (nearest neighbour:
a resized label map holds no value that is no class).

A label PNG holds one class index a pixel: a grey PNG its values, a palette PNG (as VOC writes them)
its palette indices, never its colours. ``reduce_zero_label`` is MMSeg's: 0 becomes the ignore
index and every other value v the class v - 1. Every label map is read and checked when its
split is read (``check_pair``), so that a bad one follows ``data.on_bad_annotation`` before the first
step: a size other than its image's, a value that is no class and not the ignore index, a file that
is missing or is no PNG; the message names the file and the value.
"""
from __future__ import annotations

import abc
import copy
from typing import Any, Callable, Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from visiontrain.core._tv_compat import ensure_torchvision
from visiontrain.data.detection.base import BadDataPolicy, DetectionDataset
from visiontrain.data.detection.images import BadAnnotationError, read_rgb
from visiontrain.data.image_check import MISSING
from visiontrain.data.image_verdicts import Verdict

#: The class fashion-mosaic's label maps give the pixels no item covers.
BACKGROUND = "background"
#: The one-channel modes whose values are class indices (``P``: the palette's indices).
INDEX_MODES = ("P", "L", "1", "I", "I;16", "I;16B", "I;16L")


def read_label_png(path: str) -> np.ndarray:
    """int64 [H, W] class indices of a label PNG: a grey PNG's values, a palette PNG's indices. A
    colour image is refused: its colours would have to be mapped to classes, which VOC's own PNGs
    (palette) never need."""
    try:
        with Image.open(path) as im:
            if im.mode not in INDEX_MODES:
                raise BadAnnotationError(f"label map {path} is a {im.mode} image; expected one channel of class "
                                         f"indices (a grey or palette PNG)")
            return np.asarray(im).astype(np.int64)
    except FileNotFoundError:
        raise BadAnnotationError(f"label map {path} does not exist") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        if isinstance(err, BadAnnotationError):
            raise
        raise BadAnnotationError(f"label map {path} cannot be read: {err}") from None


def to_classes(raw: np.ndarray, ignore: int, reduce_zero_label: bool) -> np.ndarray:
    """The label values as classes: unchanged, or under ``reduce_zero_label`` (MMSeg's) 0 -> ignore
    and v -> v - 1, the ignore index staying itself."""
    if not reduce_zero_label:
        return raw
    return np.where((raw == 0) | (raw == ignore), ignore, raw - 1)


def check_pair(policy: BadDataPolicy, image: str, label: str, verdict: Verdict, num_classes: int, ignore: int,
               reduce_zero_label: bool) -> bool:
    """Whether an image and its label map can be trained on; what is wrong goes to ``policy`` (an
    error or a count under ``data.on_bad_annotation``) in one line naming the file and the value.
    ``verdict``: the image's check (``image_check.inspect_images``: its problem, or its size)."""
    problem, size = verdict
    if problem is not None or size is None:
        reason = "missing image" if problem == MISSING else "unreadable image"
        policy.bad(reason, f"image file {image} {problem}")
        return False
    try:
        classes = to_classes(read_label_png(label), ignore, reduce_zero_label)
    except BadAnnotationError as err:
        policy.bad("missing annotation" if "does not exist" in str(err) else "unreadable annotation", str(err))
        return False
    if (classes.shape[1], classes.shape[0]) != size:
        policy.bad("image size mismatch", f"label map {label} is {classes.shape[1]}x{classes.shape[0]} (WxH) but its "
                                          f"image {image} is {size[0]}x{size[1]}")
        return False
    values = np.unique(classes)
    bad = values[((values < 0) | (values >= num_classes)) & (values != ignore)]
    if len(bad):
        policy.bad("bad label value", f"label map {label}: value {int(bad[0])} is no class (0..{num_classes - 1}) and "
                                      f"not the ignore index {ignore}" + (f" ({len(bad)} such values)" if len(bad) > 1
                                                                          else ""))
        return False
    return True


class SemanticDataset(Dataset, abc.ABC):
    """(image, label map) samples (the module docstring) and an optional v2 transform on both."""

    class_names: list[str]
    transform: Callable[[Any, Any], tuple[Any, Any]] | None = None

    @abc.abstractmethod
    def load(self, index: int) -> tuple[Any, Any]:
        """The untransformed sample: tv_tensors.Image uint8 [3, H, W], tv_tensors.Mask uint8 [H, W]."""

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def with_transform(self, transform: Callable | None) -> SemanticDataset:
        out = copy.copy(self)
        out.transform = transform
        return out

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        image, labels = self.load(index)
        return (image, labels) if self.transform is None else self.transform(image, labels)


class LabelMapDataset(SemanticDataset):
    """Image files with label PNGs (``pairs``: (image, label map) paths, checked by the reader)."""

    def __init__(self, pairs: Sequence[tuple[str, str]], class_names: Sequence[str], *, ignore: int,
                 reduce_zero_label: bool, source: str, policy: BadDataPolicy) -> None:
        self.pairs, self.class_names = list(pairs), list(class_names)
        self.ignore, self.reduce_zero_label, self.source, self.policy = ignore, reduce_zero_label, source, policy

    def __len__(self) -> int:
        return len(self.pairs)

    def load(self, index: int) -> tuple[Any, Any]:
        ensure_torchvision()
        from torchvision import tv_tensors

        image, label = self.pairs[index]
        classes = to_classes(read_label_png(label), self.ignore, self.reduce_zero_label)
        return tv_tensors.Image(read_rgb(image)), tv_tensors.Mask(torch.from_numpy(classes.astype(np.uint8)))


class PaintedLabelMaps(SemanticDataset):
    """A detection dataset read with its instance masks (fashion-mosaic's visible pixels), as label
    maps: class 0 ``background`` where no object is, and each object's pixels its class + 1, later
    objects over earlier ones (fashion-mosaic's visible masks never overlap). Nothing is rebuilt:
    the maps come from the masks the dataset already holds, so its cache and files stay valid."""

    def __init__(self, objects: DetectionDataset) -> None:
        self.objects = objects
        self.class_names = [BACKGROUND, *objects.class_names]

    def __len__(self) -> int:
        return len(self.objects)

    def load(self, index: int) -> tuple[Any, Any]:
        from torchvision import tv_tensors

        image, target = self.objects.load(index)
        labels = torch.zeros(image.shape[-2:], dtype=torch.uint8)
        for mask, label in zip(target["masks"], target["labels"].tolist()):
            labels[mask.as_subclass(torch.Tensor).bool()] = label + 1
        return image, tv_tensors.Mask(labels)
