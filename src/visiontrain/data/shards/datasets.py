"""The datasets of a shard directory, as the tasks train on them: the same dataset classes and
transforms as the map-style data the shards were written from.

Classification shards are read as an image folder (``ImageFolderClassification``: RGB, ImageNet's
normalisation, ``data.augment``'s image-folder transforms), whatever they were written from; the
pixels of an in-memory set (digits' 0..16) are scaled to 0..255 first, and its native side is the
default ``data.image_size``. Detection shards are a ``DetectionDataset`` whose records come from the
samples file and whose images are read from the shards, so the detectors' transforms, the
decoded-image cache (``data.cache``) and COCO evaluation work as with the files; each object's mask
and crowd flag come from the samples file too, for a task that trains on masks. Semantic and panoptic
shards: ``shards/segmentation.py``.

No image is opened before training (that is what shards avoid on object storage, and ``shard``
checked every image when it wrote them): an image that cannot be decoded is an error naming its
shard and key when it is loaded, or under ``data.on_bad_image=skip`` the next image stands in.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from visiontrain.data.datasets.image_folder import DEFAULT_IMAGE_SIZE, ImageFolderClassification
from visiontrain.data.datasets.in_memory import check_augment
from visiontrain.data.datasets.sources import ClassificationReader
from visiontrain.data.detection import masks as rle
from visiontrain.data.detection.base import BadDataPolicy, DetectionDataset
from visiontrain.data.detection.images import BadAnnotationError
from visiontrain.data.detection.record_index import ImageRecord
from visiontrain.data.images import UnreadableImageError, decode_rgb, image_tensor
from visiontrain.data.shards.reader import ShardSpec, ShardSplit, shard_index
from visiontrain.data.shards.samples import MASK_BYTES

IN_MEMORY_SOURCES = ("fashion-mnist", "digits")


def index_of_kind(location: str, kind: str) -> dict[str, Any]:
    """The index of shards of ``kind``; shards of the other kind are an error naming both."""
    index = shard_index(location)
    if index["kind"] != kind:
        raise ValueError(f"data.shards={location}: holds {index['kind']} shards (written from data.name="
                         f"{index['source']['data'].get('name')}); this task trains on {kind} shards")
    return index


class ShardClassification(ImageFolderClassification):
    """An image folder's items, read from a split of shards."""

    def __init__(self, split: ShardSplit, classes: list[str], *, image_size: int, mode: str, uint8: bool = False,
                 pixel_max: int = 255) -> None:
        super().__init__([], classes, image_size=image_size, mode=mode, uint8=uint8,
                         source=f"{split.store.location} split {split.split}")
        self.split, self.pixel_max = split, int(pixel_max)
        self.labels = split.samples.labels["label"]

    @property
    def targets(self) -> list[int]:
        return self.labels.tolist()

    def __len__(self) -> int:
        return len(self.labels)

    def decoded_item(self, index: int) -> tuple[Any, int]:
        image = decode_rgb(self.split.image_bytes(index), self.split.where(index))
        if self.pixel_max != 255:  # an in-memory set's white (digits: 16) becomes 255, as in training
            scale = 255.0 / self.pixel_max
            image = image.point(lambda v: min(255, round(v * scale)))
        return image, int(self.labels[index])

    def check_files(self, on_bad_image: str, max_skipped_share: float, check: str = "changed") -> None:
        """Nothing is opened up front (module docstring), whatever ``check`` says: only the policy is kept."""
        self.on_bad_image = on_bad_image


def build_shards_classification(reader: ClassificationReader) -> tuple[ShardClassification, ShardClassification,
                                                                      list[str], int]:
    """``(train, val, class_names, image_size)`` of classification shards (``data.name=shards``, which
    ``reader.shards`` locates), as ``build_image_folder`` gives them for a folder."""
    spec, image_size, augment = reader.shards, reader.image_size, reader.augment
    check_augment(augment)
    index = index_of_kind(spec.location, "classification")
    train = ShardSplit(spec, reader.train_split, reader.limit_train)
    val = ShardSplit(spec, reader.val_split, reader.limit_val)
    if image_size is None:  # an in-memory set's native side (its first image's), else an image folder's default
        in_memory = index["source"]["data"].get("name") in IN_MEMORY_SOURCES
        image_size = max(decode_rgb(train.image_bytes(0), train.where(0)).size) if in_memory else DEFAULT_IMAGE_SIZE
    classes = list(index["class_names"])
    common = {"image_size": int(image_size), "pixel_max": int(index.get("pixel_max", 255))}
    train_set = ShardClassification(train, classes, mode="val" if augment == "none" else augment,
                                    uint8=reader.uint8_train, **common)
    val_set = ShardClassification(val, classes, mode="val", **common)
    return train_set, val_set, classes, int(image_size)


class ShardImages:
    """``DetectionDataset.images`` for a split of shards: image i decoded from its shard."""

    def __init__(self, split: ShardSplit) -> None:
        self.split = split

    def __call__(self, i: int) -> torch.Tensor:
        return decoded_image(self.split.image_bytes(i), self.split.where(i))


def decoded_image(data: bytes, where: str) -> torch.Tensor:
    """A shard sample's encoded image as uint8 [3, H, W]; one that cannot be decoded is a bad image
    (a ``BadAnnotationError``, which ``data.on_bad_image`` decides on)."""
    try:
        return image_tensor(decode_rgb(data, where), 3)
    except UnreadableImageError as err:
        raise BadAnnotationError(str(err)) from None


def _mask_strings(split: ShardSplit) -> list[str]:
    """Every box's compressed RLE from the samples file, each checked against its image's size before
    anything decodes it (``rle.segmentation_rle``: pycocotools writes past its buffer on runs that
    add up to more than the image); one that is not is an error naming its shard, key and object."""
    a = split.samples.labels
    ends = np.cumsum(a["mask_length"])
    data, starts = a[MASK_BYTES].tobytes(), (ends - a["mask_length"]).tolist()
    image_of = np.repeat(np.arange(len(split)), np.diff(a["box_start"]))
    out = []
    for k, (start, end, i) in enumerate(zip(starts, ends.tolist(), image_of.tolist())):
        h, w = int(a["height"][i]), int(a["width"][i])
        counts, problem = rle.segmentation_rle({"size": [h, w], "counts": data[start:end]}, h, w)
        if counts is None:
            raise ValueError(f"{split.where(i)}: the mask of object {k - int(a['box_start'][i])} {problem}")
        out.append(counts)
    return out


def _records(split: ShardSplit, with_masks: bool) -> list[ImageRecord]:
    """The split's records as a detection reader gives them: with each object's mask and crowd flag
    where ``with_masks``; without, crowd regions are left out, as the readers leave them out when
    they read no masks."""
    a = split.samples.labels
    starts, difficult, crowd = a["box_start"], a.get("difficult"), a.get("crowd")
    rles = _mask_strings(split) if with_masks else None
    kept = np.ones(len(a["labels"]), bool) if crowd is None or with_masks else ~crowd
    records = []
    for i in range(len(split)):
        rows = np.arange(starts[i], starts[i + 1])[kept[starts[i]:starts[i + 1]]]
        records.append(ImageRecord(
            path=split.where(i), image_id=int(a["image_id"][i]), height=int(a["height"][i]), width=int(a["width"][i]),
            boxes=a["boxes"][rows], labels=a["labels"][rows], ann_ids=a["ann_ids"][rows],
            difficult=None if difficult is None else difficult[rows],
            masks=None if rles is None else [rles[k] for k in rows.tolist()],
            crowd=None if crowd is None or not with_masks else crowd[rows]))
    return records


def read_shards_detection(spec: ShardSpec, split_name: str, *, limit: int | None, on_bad_annotation: str,
                          on_bad_image: str | None, masks: bool = False) -> DetectionDataset:
    """One detection split of shards as a ``DetectionDataset`` (``data.name=shards``); ``masks``: with
    each object's mask (a task that trains on masks), which the shards must hold."""
    index = index_of_kind(spec.location, "detection")
    split = ShardSplit(spec, split_name, limit)
    if masks and MASK_BYTES not in split.samples.labels:
        raise ValueError(f"data.shards={spec.location}: split {split_name!r} holds no instance masks (written for a "
                         f"task that reads boxes only); write the shards with the recipe of a task that trains on "
                         f"masks (`visiontrain shard segment-mask-rcnn ...`)")
    source = f"{spec.location} split {split_name}"
    return DetectionDataset(_records(split, masks), list(index["class_names"]),
                            [int(c) for c in index["category_ids"]], source=source,
                            policy=BadDataPolicy(on_bad_annotation, source, on_bad_image), images=ShardImages(split))
