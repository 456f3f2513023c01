"""Label maps and the datasets that give them. A sample is

    image:  tv_tensors.Image, uint8 [3, H, W]
    labels: tv_tensors.Mask, uint8 [H, W]: each pixel's class (0..num_classes-1) or the ignore index

before transforms, so that every v2 transform moves the labels with the image (nearest neighbour:
a resized label map holds no value that is no class).

A label PNG holds one value a pixel: a grey PNG its values, a palette PNG (as VOC writes them)
its palette indices, never its colours. ``LabelValues`` turns the values into classes, one way for
every source: as they are; under ``reduce_zero_label`` (MMSeg's: 0 becomes the ignore index and every
other value v the class v - 1); or through a source's table of its own ids (Cityscapes' labelIds ->
its 19 train ids), applied when the PNG is read so that the rest sees classes only. Every label map
is read and checked when its split is read (``check_pair``), so that a bad one follows
``data.on_bad_annotation`` before the first step: a size other than its image's, a value that is no
class (or no id of the source's) and not the ignore index, a file that is missing or is no PNG; the
message names the file and the value the file holds.
"""
from __future__ import annotations

import abc
import copy
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from visiontrain.core._tv_compat import ensure_torchvision
from visiontrain.data.detection.base import BadDataPolicy, DetectionDataset, training_target
from visiontrain.data.detection.images import BadAnnotationError, read_rgb
from visiontrain.data.image_check import MISSING
from visiontrain.data.image_verdicts import Verdict

#: The class fashion-mosaic's label maps give the pixels no item covers.
BACKGROUND = "background"
#: The one-channel modes whose values are class indices (``P``: the palette's indices).
INDEX_MODES = ("P", "L", "1", "I", "I;16", "I;16B", "I;16L")
#: What a source's id table gives a value that is no id of the source's: no class, so bad data.
NOT_AN_ID = -1


class BadLabelMap(BadAnnotationError):
    """A label map that cannot be used: bad annotation (``data.on_bad_annotation``), where an image
    that cannot be decoded is a bad image (``data.on_bad_image``; ``policy_key``)."""


def policy_key(err: BadAnnotationError) -> str:
    """The data key whose policy a sample found bad when loaded follows: a label map is an annotation."""
    return "on_bad_annotation" if isinstance(err, BadLabelMap) else "on_bad_image"


def read_label_png(path: str | IO[bytes], where: str | None = None) -> np.ndarray:
    """int64 [H, W] class indices of a label PNG (a file, or its bytes in a file object that
    ``where`` names): a grey PNG's values, a palette PNG's indices. A colour image is refused: its
    colours would have to be mapped to classes, which VOC's own PNGs (palette) never need."""
    where = where or str(path)
    try:
        with Image.open(path) as im:
            if im.mode not in INDEX_MODES:
                raise BadLabelMap(f"label map {where} is a {im.mode} image; expected one channel of class "
                                  f"indices (a grey or palette PNG)")
            return np.asarray(im).astype(np.int64)
    except FileNotFoundError:
        raise BadLabelMap(f"label map {where} does not exist") from None
    except UnidentifiedImageError:  # PIL names the file object it was given, which says nothing here
        raise BadLabelMap(f"label map {where} cannot be read: not an image file") from None
    except (OSError, SyntaxError, ValueError) as err:
        if isinstance(err, BadAnnotationError):
            raise
        raise BadLabelMap(f"label map {where} cannot be read: {err}") from None


@dataclass(frozen=True, eq=False)
class LabelValues:
    """How a source's label values become classes (the module docstring): ``table[v]`` is value v's
    class or the ignore index, ``NOT_AN_ID`` where v is no id of the source's (``ids`` says which
    are, for the error line); without a table, the values are classes, shifted under
    ``reduce_zero_label``."""

    ignore: int
    reduce_zero_label: bool = False
    table: np.ndarray | None = None  # int64 [256]
    ids: str = ""

    @classmethod
    def of_ids(cls, ignore: int, class_of: Mapping[int, int], unlabelled: Iterable[int], ids: str) -> LabelValues:
        """A source that writes its own ids: ``class_of`` id -> class, every id of ``unlabelled`` (no
        class of the training set) -> the ignore index, any other byte no id."""
        table = np.full(256, NOT_AN_ID, np.int64)
        table[list(unlabelled)] = ignore
        table[list(class_of)] = list(class_of.values())
        return cls(ignore, table=table, ids=ids)

    def classes(self, raw: np.ndarray) -> np.ndarray:
        """int64 classes (or the ignore index; ``NOT_AN_ID`` for a value no id) of a label PNG's values."""
        if self.table is not None:
            inside = (raw >= 0) & (raw < len(self.table))
            return np.where(inside, self.table[np.where(inside, raw, 0)], NOT_AN_ID)
        if not self.reduce_zero_label:
            return raw
        return np.where((raw == 0) | (raw == self.ignore), self.ignore, raw - 1)

    def expected(self, num_classes: int) -> str:
        """What a label value should be, for the line that names one that is not."""
        if self.table is not None:
            return self.ids
        if self.reduce_zero_label:
            return (f"class (1..{num_classes} under data.reduce_zero_label) and not 0 or the ignore index "
                    f"{self.ignore}")
        return f"class (0..{num_classes - 1}) and not the ignore index {self.ignore}"


def check_pair(policy: BadDataPolicy, image: str, label: str, verdict: Verdict, num_classes: int,
               values: LabelValues) -> bool:
    """Whether an image and its label map can be trained on; what is wrong goes to ``policy`` (an
    error or a count under ``data.on_bad_annotation``) in one line naming the file and the value it
    holds. ``verdict``: the image's check (``image_check.inspect_images``: its problem, or its size)."""
    problem, size = verdict
    if problem is not None or size is None:
        reason = "missing image" if problem == MISSING else "unreadable image"
        policy.bad(reason, f"image file {image} {problem}")
        return False
    try:
        raw = read_label_png(label)
    except BadAnnotationError as err:
        policy.bad("missing annotation" if "does not exist" in str(err) else "unreadable annotation", str(err))
        return False
    if (raw.shape[1], raw.shape[0]) != size:
        policy.bad("image size mismatch", f"label map {label} is {raw.shape[1]}x{raw.shape[0]} (WxH) but its "
                                          f"image {image} is {size[0]}x{size[1]}")
        return False
    present = present_values(raw)
    classes = values.classes(present)
    bad = present[((classes < 0) | (classes >= num_classes)) & (classes != values.ignore)]
    if len(bad):
        policy.bad("bad label value", f"label map {label}: value {int(bad[0])} is no {values.expected(num_classes)}"
                                      + (f" ({len(bad)} such values)" if len(bad) > 1 else ""))
        return False
    return True


def present_values(raw: np.ndarray) -> np.ndarray:
    """The values a label map holds, ascending: counted (one pass) where they are 8 or 16 bits, as
    every label PNG of a dataset is, so that checking a split of 2048 x 1024 maps sorts nothing."""
    if raw.size and 0 <= raw.min() and raw.max() < 1 << 16:
        return np.flatnonzero(np.bincount(raw.ravel()))
    return np.unique(raw)


class SemanticDataset(Dataset, abc.ABC):
    """(image, label map) samples (the module docstring) and an optional v2 transform on both."""

    class_names: list[str]
    transform: Callable[[Any, Any], tuple[Any, Any]] | None = None

    @abc.abstractmethod
    def load(self, index: int) -> tuple[Any, Any]:
        """The untransformed sample: tv_tensors.Image uint8 [3, H, W], tv_tensors.Mask uint8 [H, W]."""

    @abc.abstractmethod
    def image_file(self, index: int) -> str:
        """Where sample ``index``'s image is: its file (``visiontrain shard`` copies its bytes), or its
        shard and key."""

    @abc.abstractmethod
    def label_map(self, index: int) -> np.ndarray:
        """uint8 [H, W]: sample ``index``'s labels exactly as ``load`` gives them, without decoding its
        image (what ``visiontrain shard`` writes beside the image file)."""

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

    def __init__(self, pairs: Sequence[tuple[str, str]], class_names: Sequence[str], *, values: LabelValues,
                 source: str, policy: BadDataPolicy) -> None:
        self.pairs, self.class_names = list(pairs), list(class_names)
        self.values, self.source, self.policy = values, source, policy

    def __len__(self) -> int:
        return len(self.pairs)

    def load(self, index: int) -> tuple[Any, Any]:
        ensure_torchvision()
        from torchvision import tv_tensors

        labels = self.label_map(index)
        return tv_tensors.Image(read_rgb(self.image_file(index))), tv_tensors.Mask(torch.from_numpy(labels))

    def image_file(self, index: int) -> str:
        return self.pairs[index][0]

    def label_map(self, index: int) -> np.ndarray:
        return self.values.classes(read_label_png(self.pairs[index][1])).astype(np.uint8)


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
        ensure_torchvision()
        from torchvision import tv_tensors

        image, target = self.objects.load(index)
        return image, tv_tensors.Mask(painted(image.shape[-2:], target))

    def image_file(self, index: int) -> str:
        return self.objects.records.paths[index]

    def label_map(self, index: int) -> np.ndarray:
        """The map ``load`` paints, from the record's masks alone (its training target's: crowd
        regions left out), without decoding the image."""
        ensure_torchvision()
        r = self.objects.records[index]
        return painted((r.height, r.width), training_target(r)).numpy()


def painted(size: Sequence[int], target: Mapping[str, Any]) -> torch.Tensor:
    """uint8 [H, W] label map of a detection target's masks: 0 where no object is, each object's
    pixels its label + 1, later objects over earlier ones."""
    labels = torch.zeros(tuple(size), dtype=torch.uint8)
    for mask, label in zip(target["masks"], target["labels"].tolist()):
        labels[mask.as_subclass(torch.Tensor).bool()] = label + 1
    return labels
