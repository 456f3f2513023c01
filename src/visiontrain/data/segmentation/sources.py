"""The ``data`` keys of the semantic segmentation sources read from files: ``segmentation-folder``
(images and label PNGs of matching names) and ``voc-segmentation`` (Pascal VOC's
``SegmentationClass``). fashion-mosaic, built in, keeps its detection keys
(``data/detection/sources.py``): the semantic task paints its label maps from its instance masks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from visiontrain.core.config import register_kind
from visiontrain.core.typed_config import did_you_mean, doc
from visiontrain.data.section import DataConfig, ImageFileKeys, SplitKeys

#: The label value that is no class (MMSeg's): its pixels count in no loss and no metric.
IGNORE_INDEX = 255
FOLDER, VOC = "segmentation-folder", "voc-segmentation"
#: Every source a semantic task reads: the two file formats and the built-in fashion-mosaic.
SEMANTIC_SOURCES = (FOLDER, VOC, "fashion-mosaic")


@dataclass
class LabelMapDataConfig(ImageFileKeys, SplitKeys, DataConfig):
    """A source of images with label PNGs: which one is data.name."""

    name: str = doc("dataset: segmentation-folder | voc-segmentation (read from data.root)", FOLDER)
    root: str | None = doc("dataset directory (segmentation-folder: ROOT/images/<split>/*.jpg|png and "
                           "ROOT/labels/<split>/<same stem>.png; voc-segmentation: the VOC2012 directory, with "
                           "ImageSets/Segmentation/<split>.txt, JPEGImages and SegmentationClass)", None)
    ignore_index: int = doc("the label value that is no class (MMSeg's 255; VOC's object borders): its pixels count "
                            "in no loss and no metric, and a training crop pads the label map with it",
                            IGNORE_INDEX, minimum=0)
    reduce_zero_label: bool = doc("MMSeg's reduce_zero_label: label 0 becomes the ignore index and every other "
                                  "value v the class v - 1 (ADE20K's 0 is 'other', no class)", False)
    on_bad_annotation: Literal["error", "skip"] = doc(
        "a bad label map (missing, unreadable, of another size than its image, or with a value that is no class "
        "and not data.ignore_index) is an error naming the file and the value, or its image is skipped and counted",
        "error")


@dataclass
class SegmentationFolderDataConfig(LabelMapDataConfig):
    """segmentation-folder: the class names come from the config or from ROOT/classes.txt."""

    class_names: list[str] = doc("segmentation-folder: the class of each label value, in order (value 0 the "
                                 "first; after reduce_zero_label, value 1 the first); empty: ROOT/classes.txt, "
                                 "one name a line", factory=list)


register_kind("data", FOLDER, SegmentationFolderDataConfig)
register_kind("data", VOC, LabelMapDataConfig)


def semantic_source(data: DataConfig) -> DataConfig:
    """A semantic task's data section, refused in one line when the source has no label maps."""
    if data.name not in SEMANTIC_SOURCES:
        raise ValueError(f"data.name: {data.name!r} has no label maps{did_you_mean(data.name, SEMANTIC_SOURCES)}; "
                         f"a semantic segmentation task reads {', '.join(SEMANTIC_SOURCES)}")
    return data


def ignore_index(data: DataConfig) -> int:
    """The source's ignore index: ``data.ignore_index`` for a file source, 255 for fashion-mosaic
    (which has none in its maps; crops pad with it)."""
    return data.ignore_index if isinstance(data, LabelMapDataConfig) else IGNORE_INDEX
