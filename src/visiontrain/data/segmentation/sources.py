"""The ``data`` keys of the semantic segmentation sources read from files: ``segmentation-folder``
(images and label PNGs of matching names), ``voc-segmentation`` (Pascal VOC's ``SegmentationClass``),
``cityscapes`` (``leftImg8bit`` and ``gtFine``) and ``ade20k`` (MMSeg's ``ADEChallengeData2016``).
fashion-mosaic, built in, keeps its detection keys (``data/detection/sources.py``): the semantic task
paints its label maps from its instance masks. And the panoptic ones: ``coco-panoptic`` (COCO's panoptic
format; fashion-mosaic has it built in too) and ``cityscapes-panoptic`` (the same format in Cityscapes'
folders), read by ``data/segmentation/panoptic.py``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from visiontrain.core.config import register_kind
from visiontrain.core.typed_config import did_you_mean, doc
from visiontrain.data.section import DataConfig, DecodedCacheKeys, ImageFileKeys, SplitKeys

#: The label value that is no class (MMSeg's): its pixels count in no loss and no metric.
IGNORE_INDEX = 255
FOLDER, VOC, CITYSCAPES, ADE20K = "segmentation-folder", "voc-segmentation", "cityscapes", "ade20k"
#: Every source a semantic task reads: the four read from files and the built-in fashion-mosaic.
SEMANTIC_SOURCES = (FOLDER, VOC, CITYSCAPES, ADE20K, "fashion-mosaic")


@dataclass
class LabelMapDataConfig(ImageFileKeys, SplitKeys, DataConfig):
    """A source of images with label PNGs: which one is data.name."""

    name: str = doc("dataset: segmentation-folder | voc-segmentation | cityscapes | ade20k (read from data.root)",
                    FOLDER)
    root: str | None = doc("dataset directory (segmentation-folder: ROOT/images/<split>/*.jpg|png and "
                           "ROOT/labels/<split>/<same stem>.png; voc-segmentation: the VOC2012 directory, with "
                           "ImageSets/Segmentation/<split>.txt, JPEGImages and SegmentationClass; cityscapes: "
                           "ROOT/leftImg8bit/<split>/<city>/*_leftImg8bit.png and ROOT/gtFine/<split>/<city>/; "
                           "ade20k: ADEChallengeData2016, ROOT/images/<split>/*.jpg and "
                           "ROOT/annotations/<split>/<same stem>.png)", None)
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


@dataclass
class CityscapesDataConfig(LabelMapDataConfig):
    """cityscapes: Cityscapes' fine annotations, its 19 train classes (``class_tables.py``)."""

    label_kind: Literal["labelIds", "labelTrainIds"] = doc(
        "cityscapes: the gtFine PNG read for each image: labelIds (*_gtFine_labelIds.png, as downloaded: each id "
        "mapped to its train class by cityscapesscripts' labels.py, an id of no train class to the ignore index) "
        "or labelTrainIds (*_gtFine_labelTrainIds.png, written by cityscapesscripts' createTrainIdLabelImgs or "
        "MMSeg's tools/dataset_converters/cityscapes.py, and read by MMSeg: the train ids as they are, 255 ignored)",
        "labelIds")


@dataclass
class Ade20kDataConfig(LabelMapDataConfig):
    """ade20k: MMSeg's ADEChallengeData2016, whose splits are training and validation and whose label 0
    is "other" (no class), so reduce_zero_label is on, as MMSeg's ADE20KDataset fixes it."""

    train_split: str = doc("split name of the training set (ade20k: the directory under images/ and "
                           "annotations/)", "training")
    val_split: str = doc("split name of the validation set (ade20k: the directory under images/ and annotations/)",
                         "validation")
    reduce_zero_label: bool = doc("MMSeg's reduce_zero_label: label 0 becomes the ignore index and every other "
                                  "value v the class v - 1 (ade20k: on, its 0 is 'other')", True)


register_kind("data", FOLDER, SegmentationFolderDataConfig)
register_kind("data", VOC, LabelMapDataConfig)
register_kind("data", CITYSCAPES, CityscapesDataConfig)
register_kind("data", ADE20K, Ade20kDataConfig)


#: ``data.name`` of tar shards (``data/shards/source.py``): a semantic or panoptic task reads shards
#: written for its family (``visiontrain shard``), whose index says which they are.
SHARDS = "shards"


def semantic_source(data: DataConfig) -> DataConfig:
    """A semantic task's data section, refused in one line when the source has no label maps."""
    if data.name not in (*SEMANTIC_SOURCES, SHARDS):
        raise ValueError(f"data.name: {data.name!r} has no label maps{did_you_mean(data.name, SEMANTIC_SOURCES)}; "
                         f"a semantic segmentation task reads {', '.join(SEMANTIC_SOURCES)}")
    return data


def ignore_index(data: DataConfig) -> int:
    """The source's ignore index: ``data.ignore_index`` for a file source, 255 for fashion-mosaic
    (which has none in its maps; crops pad with it)."""
    return data.ignore_index if isinstance(data, LabelMapDataConfig) else IGNORE_INDEX


# ------------------------------------------------------------------------------------- panoptic
COCO_PANOPTIC, CITYSCAPES_PANOPTIC = "coco-panoptic", "cityscapes-panoptic"
#: Every source a panoptic task reads.
PANOPTIC_SOURCES = (COCO_PANOPTIC, CITYSCAPES_PANOPTIC, "fashion-mosaic")
LAYOUT = "ROOT/annotations/panoptic_<split>.json, ROOT/annotations/panoptic_<split>/*.png, ROOT/<split>/<images>"
CITYSCAPES_PANOPTIC_LAYOUT = ("ROOT/gtFine/cityscapes_panoptic_<split>.json, ROOT/gtFine/cityscapes_panoptic_<split>/"
                              "*_gtFine_panoptic.png, ROOT/leftImg8bit/<split>/<city>/<image_id>_leftImg8bit.png")


@dataclass
class PanopticDataConfig(DecodedCacheKeys, ImageFileKeys, SplitKeys, DataConfig):
    """COCO panoptic read from data.root."""

    name: str = doc("dataset: coco-panoptic (read from data.root)", COCO_PANOPTIC)
    root: str | None = doc(f"dataset directory: {LAYOUT}", None)
    train_split: str = doc("split name of the training set", "train2017")
    val_split: str = doc("split name of the validation set", "val2017")
    test_split: str = doc("split name of the test set, evaluated only by `visiontrain validate --split test`",
                          "test2017")
    on_bad_annotation: Literal["error", "skip"] = doc(
        "an id PNG that is missing, unreadable, of another size than its image, or whose colours disagree with its "
        "segments_info: an error naming the file, or its image is skipped and counted", "error")


@dataclass
class CityscapesPanopticDataConfig(PanopticDataConfig):
    """Cityscapes panoptic read from data.root: COCO's panoptic format as cityscapesscripts'
    createPanopticImgs writes it (string image ids, Cityscapes' label ids as category ids), in
    Cityscapes' folders, where Detectron2's ``cityscapes_panoptic.py`` reads it."""

    name: str = doc("dataset: cityscapes-panoptic (read from data.root)", CITYSCAPES_PANOPTIC)
    root: str | None = doc(f"dataset directory (Cityscapes, after `python -m cityscapesscripts.preparation."
                           f"createPanopticImgs`): {CITYSCAPES_PANOPTIC_LAYOUT}", None)
    train_split: str = doc("split name of the training set", "train")
    val_split: str = doc("split name of the validation set", "val")
    test_split: str = doc("split name of the test set, evaluated only by `visiontrain validate --split test` "
                          "(Cityscapes' test annotations are not public)", "test")


register_kind("data", COCO_PANOPTIC, PanopticDataConfig)
register_kind("data", CITYSCAPES_PANOPTIC, CityscapesPanopticDataConfig)


def panoptic_source(data: DataConfig) -> DataConfig:
    """A panoptic task's data section, refused in one line when the source has no panoptic annotation."""
    if data.name not in (*PANOPTIC_SOURCES, SHARDS):
        raise ValueError(f"data.name: {data.name!r} has no panoptic annotation"
                         f"{did_you_mean(data.name, PANOPTIC_SOURCES)}; a panoptic task reads "
                         f"{', '.join(PANOPTIC_SOURCES)}")
    return data
