"""``data.name`` -> (train, val) semantic datasets: a segmentation folder, Pascal VOC's
``SegmentationClass``, or fashion-mosaic's label maps painted from its instance masks."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from visiontrain.data.bad_data import check_skipped_share, leaves_its_directory, listed
from visiontrain.data.detection.base import BadDataPolicy
from visiontrain.data.detection.splits import build_detection_splits
from visiontrain.data.image_check import inspect_images
from visiontrain.data.segmentation.label_maps import LabelMapDataset, PaintedLabelMaps, SemanticDataset, check_pair
from visiontrain.data.segmentation.sources import FOLDER, VOC, LabelMapDataConfig, semantic_source
from visiontrain.data.section import DataConfig

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp")
FOLDER_LAYOUT = "ROOT/images/<split>/*.jpg|png and ROOT/labels/<split>/<same stem>.png"
VOC_LAYOUT = "ROOT/ImageSets/Segmentation/<split>.txt, ROOT/JPEGImages/<id>.jpg, ROOT/SegmentationClass/<id>.png"
#: Pascal VOC's 21 classes in their label values' order (255: the objects' borders, ignored).
VOC_CLASSES = ("background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair", "cow",
               "diningtable", "dog", "horse", "motorbike", "person", "pottedplant", "sheep", "sofa", "train",
               "tvmonitor")
MOST_CLASSES = 255  # label maps are kept as uint8, the ignore index among the values


def folder_pairs(root: Path, split: str) -> list[tuple[str, str]]:
    """(image, label map) paths of a segmentation folder's split, by file name."""
    images = root / "images" / split
    if not images.is_dir():
        raise FileNotFoundError(f"{FOLDER}: {images} does not exist (expected layout: {FOLDER_LAYOUT})")
    files = sorted(p for p in images.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith("."))
    return [(str(p), str(root / "labels" / split / f"{p.stem}.png")) for p in files]


def voc_pairs(root: Path, split: str) -> list[tuple[str, str]]:
    """(image, label map) paths of the ids VOC's ``ImageSets/Segmentation/<split>.txt`` lists."""
    listing = root / "ImageSets" / "Segmentation" / f"{split}.txt"
    if not listing.is_file():
        raise FileNotFoundError(f"{VOC}: {listing} does not exist (expected layout: {VOC_LAYOUT})")
    ids = listing.read_text().split()
    outside = [i for i in ids if leaves_its_directory(i)]
    if outside:
        raise ValueError(f"{VOC}: {listing} names files outside the dataset: {listed(outside)}")
    return [(str(root / "JPEGImages" / f"{i}.jpg"), str(root / "SegmentationClass" / f"{i}.png")) for i in ids]


def folder_classes(data: LabelMapDataConfig, root: Path) -> list[str]:
    """segmentation-folder's classes: data.class_names, else ROOT/classes.txt (one a line)."""
    if data.class_names:
        return list(data.class_names)
    listing = root / "classes.txt"
    if not listing.is_file():
        raise FileNotFoundError(f"{FOLDER}: no class names: set data.class_names or write {listing} (one a line, "
                                f"in the order of the label values)")
    return [line.strip() for line in listing.read_text().splitlines() if line.strip()]


def read_label_maps(pairs: Sequence[tuple[str, str]], class_names: list[str], data: LabelMapDataConfig,
                    where: str, limit: int | None) -> LabelMapDataset:
    """The first ``limit`` of the split's pairs that pass ``check_pair`` (under the bad-data policy),
    as the detection readers keep the first N usable images; only those and the bad ones before them
    are read."""
    ignore = data.ignore_index
    if len(class_names) > MOST_CLASSES or ignore > MOST_CLASSES or ignore < len(class_names):
        raise ValueError(f"{data.name}: {len(class_names)} classes and data.ignore_index={ignore}: the ignore index "
                         f"must be no class (>= the class count) and at most {MOST_CLASSES}")
    policy = BadDataPolicy(data.on_bad_annotation, where, data.on_bad_image)
    kept: list[tuple[str, str]] = []
    verdicts = inspect_images([image for image, _ in pairs], size=True, check=data.check_images)  # lazy, by chunks
    for (image, label), verdict in zip(pairs, verdicts):
        if limit is not None and len(kept) == limit:
            break
        if check_pair(policy, image, label, verdict, len(class_names), ignore, data.reduce_zero_label):
            kept.append((image, label))
    policy.raise_unreadable()
    skipped = sum(policy.skipped.values())
    check_skipped_share(where, "images are bad data", skipped, len(kept) + skipped, data.max_skipped_share,
                        {cause: n for (_, cause), n in policy.causes.items()},
                        ", ".join(f"{n} {reason}" for reason, n in sorted(policy.skipped.items())))
    if not kept:
        raise ValueError(f"{where}: no usable image (data.train_split / data.val_split name the splits)")
    return LabelMapDataset(kept, class_names, ignore=ignore, reduce_zero_label=data.reduce_zero_label, source=where,
                           policy=policy)


def build_semantic_splits(data: DataConfig) -> tuple[SemanticDataset, SemanticDataset]:
    """(train, val) of the source ``data`` names (``sources.SEMANTIC_SOURCES``)."""
    data = semantic_source(data)
    if not isinstance(data, LabelMapDataConfig):  # fashion-mosaic: its instance masks painted
        train, val = build_detection_splits(data, masks=True)
        return PaintedLabelMaps(train), PaintedLabelMaps(val)
    if not data.root or not Path(data.root).is_dir():
        raise FileNotFoundError(f"data.name={data.name} needs data.root, a directory (expected layout: "
                                f"{FOLDER_LAYOUT if data.name == FOLDER else VOC_LAYOUT}; got {data.root})")
    root = Path(data.root)
    if data.name == FOLDER:
        pairs, classes = folder_pairs, folder_classes(data, root)
    else:
        pairs, classes = voc_pairs, list(VOC_CLASSES)
    return tuple(read_label_maps(pairs(root, split), classes, data, f"{data.name} {split} ({root})", limit)
                 for split, limit in ((data.train_split, data.limit_train), (data.val_split, data.limit_val)))
