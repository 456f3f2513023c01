"""The ``data`` keys of the detection sources, read by ``build_detection_splits``: coco, voc and yolo
read a tree under data.root, fashion-mosaic and neon-trees are built into one (data.root, or the data
cache directory); all of them read their splits' names, what a bad annotation or image file does,
and the decoded-image cache."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from visiontrain.core.config import register_kind
from visiontrain.core.typed_config import did_you_mean, doc
from visiontrain.data.section import DataConfig, DecodedCacheKeys, ImageFileKeys, SplitKeys

DETECTION_SOURCES = ("coco", "voc", "yolo", "fashion-mosaic", "neon-trees")


@dataclass
class DetectionDataConfig(DecodedCacheKeys, ImageFileKeys, SplitKeys, DataConfig):
    """A detection source: which one is data.name."""

    name: str = doc("dataset: coco | voc | yolo (read from data.root) | fashion-mosaic | neon-trees (built in)",
                    "coco")
    root: str | None = doc("dataset directory (coco: ROOT/annotations, ROOT/<split>; voc: ROOT/ImageSets, "
                           "ROOT/Annotations, ROOT/JPEGImages; yolo: ROOT/images, ROOT/labels; fashion-mosaic, "
                           "neon-trees: where they are built, default the data cache directory)", None)
    on_bad_annotation: Literal["error", "skip"] = doc(
        "detection: a bad box or category (or image file, unless data.on_bad_image says otherwise) is an error "
        "naming it, or is skipped and counted", "error")

    def image_policy(self) -> str:
        """What an image file that cannot be read does: ``on_bad_image``, or where it is unset
        ``on_bad_annotation``, which says it for detection."""
        return self.on_bad_image or self.on_bad_annotation


for _name in DETECTION_SOURCES:
    register_kind("data", _name, DetectionDataConfig)


def detection_source(data: DataConfig) -> DetectionDataConfig:
    """A detector's data section; a classification source's name is an unknown detection dataset."""
    if not isinstance(data, DetectionDataConfig):
        hint = did_you_mean(data.name, DETECTION_SOURCES)
        raise ValueError(f"data.name: unknown detection dataset {data.name!r}{hint}; "
                         f"expected one of {', '.join(DETECTION_SOURCES)}")
    return data
