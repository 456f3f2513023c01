"""Semantic and panoptic shards as the tasks train on them: the same samples as the files they were
written from (``raw``'s module docstring says what a sample holds).

- Semantic: ``ShardLabelMaps``, a ``SemanticDataset`` whose image and label map (``KEY.seg.png``,
  classes and the ignore index 255) come from one read of the sample's bytes.
- Panoptic: ``ShardPanopticFiles``, what a ``PanopticDataset`` reads for a sample instead of its
  files: the image, and the id PNG (``KEY.pan.png``) with the segments_info of its JSON member;
  the dataset (``data/segmentation/panoptic.py``) makes instances and the semantic map of them as
  it does from the files.

As for detection shards, nothing is opened before training (``shard`` read every label file when it
wrote it). What a downloaded sample holds is data: a label map that cannot be decoded, is of another
size than its image, or holds a value that is no class (a cross-entropy index out of range) is a bad
annotation when loaded, an error naming its shard and key or, under ``data.on_bad_annotation=skip``,
the next sample stands in.
"""
from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import torch

from visiontrain.core._tv_compat import ensure_torchvision
from visiontrain.data.detection.base import BadDataPolicy
from visiontrain.data.detection.images import BadAnnotationError
from visiontrain.data.segmentation.label_maps import (BadLabelMap, SemanticDataset, policy_key, present_values,
                                                      read_label_png)
from visiontrain.data.segmentation.sources import IGNORE_INDEX
from visiontrain.data.shards.datasets import ShardImages, decoded_image, index_of_kind
from visiontrain.data.shards.layout import LABEL_MAP_MEMBER, PANOPTIC_MEMBER
from visiontrain.data.shards.reader import ShardSpec, ShardSplit, image_member


def _member(members: dict[str, bytes], ext: str, where: str, error: type[BadAnnotationError]) -> bytes:
    if ext not in members:
        raise error(f"{where}: no {ext} member (written by `visiontrain shard` for another task?)")
    return members[ext]


class ShardLabelMaps(SemanticDataset):
    """A split of semantic shards: (image, label map) samples (``SemanticDataset``), checked when loaded."""

    def __init__(self, split: ShardSplit, class_names: list[str], policy: BadDataPolicy) -> None:
        self.split, self.class_names, self.policy = split, list(class_names), policy
        self.source = policy.source

    def __len__(self) -> int:
        return len(self.split)

    def image_file(self, index: int) -> str:
        return self.split.where(index)

    def _label_map(self, members: dict[str, bytes], index: int) -> np.ndarray:
        where = f"{self.split.where(index)} {LABEL_MAP_MEMBER}"
        data = _member(members, LABEL_MAP_MEMBER, self.split.where(index), BadLabelMap)
        classes = read_label_png(io.BytesIO(data), where)
        expected = (int(self.split.samples.labels["height"][index]), int(self.split.samples.labels["width"][index]))
        if classes.shape != expected:
            raise BadLabelMap(f"label map {where} is {classes.shape[1]}x{classes.shape[0]} (WxH) but its image is "
                              f"{expected[1]}x{expected[0]}")
        present = present_values(classes)
        bad = present[(present >= self.num_classes) & (present != IGNORE_INDEX)]
        if len(bad):
            raise BadLabelMap(f"label map {where}: value {int(bad[0])} is no class (0..{self.num_classes - 1}) and "
                              f"not the ignore index {IGNORE_INDEX}")
        return classes.astype(np.uint8)

    def label_map(self, index: int) -> np.ndarray:
        return self._label_map(self.split.members(index), index)

    def load(self, index: int) -> tuple[Any, Any]:
        ensure_torchvision()
        from torchvision import tv_tensors

        members, where = self.split.members(index), self.split.where(index)  # one read: image and label map
        labels = self._label_map(members, index)
        image = decoded_image(image_member(members, where), where)
        if tuple(image.shape[-2:]) != labels.shape:
            raise BadLabelMap(f"label map {where} {LABEL_MAP_MEMBER} is {labels.shape[1]}x"
                              f"{labels.shape[0]} (WxH) but its image decodes as {image.shape[-1]}x{image.shape[-2]}")
        return tv_tensors.Image(image), tv_tensors.Mask(torch.from_numpy(labels))

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        image, labels = self.policy.load_or_next(self.load, index, len(self), key=policy_key)
        return (image, labels) if self.transform is None else self.transform(image, labels)


def read_shards_semantic(spec: ShardSpec, split_name: str, *, limit: int | None, on_bad_annotation: str,
                         on_bad_image: str | None) -> ShardLabelMaps:
    """One split of semantic shards (``data.name=shards``), as ``build_semantic_splits`` gives a folder's."""
    index = index_of_kind(spec.location, "semantic")
    source = f"{spec.location} split {split_name}"
    return ShardLabelMaps(ShardSplit(spec, split_name, limit), list(index["class_names"]),
                          BadDataPolicy(on_bad_annotation, source, on_bad_image))


class ShardPanopticFiles:
    """What a ``PanopticDataset`` reads for sample i of a split of panoptic shards, in place of the
    files its records name: ``image(i)`` and ``id_png(i)`` (the id PNG's bytes and its segments_info)."""

    def __init__(self, split: ShardSplit) -> None:
        self.split = split

    def where(self, i: int) -> str:
        return self.split.where(i)

    def image(self, i: int) -> torch.Tensor:
        return ShardImages(self.split)(i)

    def id_png(self, i: int) -> tuple[io.BytesIO, list[Any]]:
        """(the id PNG, its segments_info); a member missing or a JSON without its list is a ValueError,
        which the dataset reports as a bad id PNG."""
        members, where = self.split.members(i), self.split.where(i)
        png = _member(members, PANOPTIC_MEMBER, where, BadAnnotationError)
        try:
            segments = json.loads(_member(members, "json", where, BadAnnotationError))["segments_info"]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{where}: its json member has no readable segments_info ({err})") from None
        if not isinstance(segments, list) or not all(isinstance(s, dict) for s in segments):
            raise ValueError(f"{where}: segments_info is not a list of segments")
        return io.BytesIO(png), segments


def shard_panoptic_split(spec: ShardSpec, split_name: str, limit: int | None
                         ) -> tuple[ShardSplit, list[dict[str, Any]]]:
    """One split of panoptic shards and the categories (as their JSON lists them) the index records."""
    index = index_of_kind(spec.location, "panoptic")
    return ShardSplit(spec, split_name, limit), [dict(c) for c in index["categories"]]
