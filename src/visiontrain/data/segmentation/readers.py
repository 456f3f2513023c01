"""``data.name`` -> (train, val) semantic datasets: a segmentation folder, Pascal VOC's
``SegmentationClass``, Cityscapes' ``gtFine``, ADE20K's ``ADEChallengeData2016``, or fashion-mosaic's
label maps painted from its instance masks, or the shards ``visiontrain shard`` wrote of any of them
(``data/shards/segmentation.py``). Each file source is its pairs of (image, label map)
paths, its classes and how its label values become classes (``label_maps.LabelValues``); reading,
checking and the bad-data policy are the same for all (``read_label_maps``)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from visiontrain.data.bad_data import leaves_its_directory, listed
from visiontrain.data.detection.base import BadDataPolicy
from visiontrain.data.detection.splits import build_detection_splits
from visiontrain.data.image_check import inspect_images
from visiontrain.data.segmentation.class_tables import (ADE20K_CLASSES, CITYSCAPES_CLASSES, CITYSCAPES_LABEL_IDS,
                                                        CITYSCAPES_LAST_ID, VOC_CLASSES)
from visiontrain.data.segmentation.label_maps import (LabelMapDataset, LabelValues, PaintedLabelMaps,
                                                      SemanticDataset, check_pair)
from visiontrain.data.segmentation.sources import (ADE20K, CITYSCAPES, FOLDER, SHARDS, VOC, CityscapesDataConfig,
                                                   LabelMapDataConfig, semantic_source)
from visiontrain.data.section import DataConfig
from visiontrain.data.shards.segmentation import read_shards_semantic

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp")
LAYOUTS = {
    FOLDER: "ROOT/images/<split>/*.jpg|png and ROOT/labels/<split>/<same stem>.png",
    VOC: "ROOT/ImageSets/Segmentation/<split>.txt, ROOT/JPEGImages/<id>.jpg, ROOT/SegmentationClass/<id>.png",
    CITYSCAPES: "ROOT/leftImg8bit/<split>/<city>/<stem>_leftImg8bit.png and "
                "ROOT/gtFine/<split>/<city>/<stem>_gtFine_labelIds.png (or _labelTrainIds.png)",
    ADE20K: "ADEChallengeData2016: ROOT/images/<split>/*.jpg and ROOT/annotations/<split>/<same stem>.png",
}
CITYSCAPES_IMAGE = "_leftImg8bit.png"
MOST_CLASSES = 255  # label maps are kept as uint8, the ignore index among the values
Pairs = list[tuple[str, str]]


def split_dirs(source: str, *dirs: Path) -> tuple[Path, ...]:
    """``dirs``, each checked to exist: a missing one is the layout's error, not one per image."""
    for d in dirs:
        if not d.is_dir():
            raise FileNotFoundError(f"{source}: {d} does not exist (expected layout: {LAYOUTS[source]})")
    return dirs


def folder_pairs(root: Path, split: str, source: str = FOLDER, labels: str = "labels") -> Pairs:
    """(image, label map) paths of a split by file name: ROOT/images/<split>/<stem>.<image suffix> and
    ROOT/<labels>/<split>/<stem>.png (a segmentation folder's ``labels``, ADE20K's ``annotations``)."""
    images, maps = split_dirs(source, root / "images" / split, root / labels / split)
    files = sorted(p for p in images.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith("."))
    return [(str(p), str(maps / f"{p.stem}.png")) for p in files]


def voc_pairs(root: Path, split: str) -> Pairs:
    """(image, label map) paths of the ids VOC's ``ImageSets/Segmentation/<split>.txt`` lists."""
    listing = root / "ImageSets" / "Segmentation" / f"{split}.txt"
    if not listing.is_file():
        raise FileNotFoundError(f"{VOC}: {listing} does not exist (expected layout: {LAYOUTS[VOC]})")
    ids = listing.read_text().split()
    outside = [i for i in ids if leaves_its_directory(i)]
    if outside:
        raise ValueError(f"{VOC}: {listing} names files outside the dataset: {listed(outside)}")
    return [(str(root / "JPEGImages" / f"{i}.jpg"), str(root / "SegmentationClass" / f"{i}.png")) for i in ids]


def cityscapes_pairs(root: Path, split: str, kind: str) -> Pairs:
    """(image, label map) paths of a Cityscapes split: each city's ``<stem>_leftImg8bit.png`` with its
    ``<stem>_gtFine_<kind>.png`` (kind: labelIds or labelTrainIds)."""
    images, maps = split_dirs(CITYSCAPES, root / "leftImg8bit" / split, root / "gtFine" / split)
    files = sorted(p for p in images.glob(f"*/*{CITYSCAPES_IMAGE}") if not p.name.startswith("."))
    return [(str(p), str(maps / p.parent.name / f"{p.name[:-len(CITYSCAPES_IMAGE)]}_gtFine_{kind}.png"))
            for p in files]


def cityscapes_values(data: CityscapesDataConfig) -> LabelValues:
    """Cityscapes' label values as its 19 train classes: a labelId through labels.py's table (one of
    no train class -> the ignore index), a trainId as it is; 255 (no label, or license plate's -1
    in a byte) -> the ignore index; any other byte is no id (bad data)."""
    if data.reduce_zero_label:
        raise ValueError(f"data.reduce_zero_label: {CITYSCAPES} reads Cityscapes' own ids (data.label_kind="
                         f"{data.label_kind}), whose table already ignores what no train class is; leave it false")
    if data.label_kind == "labelTrainIds":
        ids = f"Cityscapes trainId (0..{len(CITYSCAPES_CLASSES) - 1}, or 255 for none)"
        return LabelValues.of_ids(data.ignore_index, {t: t for t in range(len(CITYSCAPES_CLASSES))}, [255], ids)
    class_of = {label_id: train_id for train_id, label_id in enumerate(CITYSCAPES_LABEL_IDS)}
    unlabelled = [i for i in range(CITYSCAPES_LAST_ID + 1) if i not in class_of] + [255]
    ids = f"Cityscapes labelId (0..{CITYSCAPES_LAST_ID}, or 255 for none)"
    return LabelValues.of_ids(data.ignore_index, class_of, unlabelled, ids)


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
                    where: str, limit: int | None, values: LabelValues | None = None) -> LabelMapDataset:
    """The first ``limit`` of the split's pairs that pass ``check_pair`` (under the bad-data policy),
    as the detection readers keep the first N usable images; only those and the bad ones before them
    are read. ``values``: how the label values become classes (default: as they are, or under
    data.reduce_zero_label)."""
    ignore = data.ignore_index
    if len(class_names) > MOST_CLASSES or ignore > MOST_CLASSES or ignore < len(class_names):
        raise ValueError(f"{data.name}: {len(class_names)} classes and data.ignore_index={ignore}: the ignore index "
                         f"must be no class (>= the class count) and at most {MOST_CLASSES}")
    values = values or LabelValues(ignore, data.reduce_zero_label)
    policy = BadDataPolicy(data.on_bad_annotation, where, data.on_bad_image)
    kept: list[tuple[str, str]] = []
    verdicts = inspect_images([image for image, _ in pairs], size=True, check=data.check_images)  # lazy, by chunks
    for (image, label), verdict in zip(pairs, verdicts):
        if limit is not None and len(kept) == limit:
            break
        if check_pair(policy, image, label, verdict, len(class_names), values):
            kept.append((image, label))
    policy.finish_split(len(kept), data.max_skipped_share)
    return LabelMapDataset(kept, class_names, values=values, source=where, policy=policy)


def file_source(data: LabelMapDataConfig, root: Path
                ) -> tuple[Callable[[str], Pairs], list[str], LabelValues | None]:
    """How ``data.name`` reads a split of ``root``: its pairs, its classes, its label values (None: as
    they are, or under data.reduce_zero_label)."""
    if data.name == FOLDER:
        return lambda split: folder_pairs(root, split), folder_classes(data, root), None
    if data.name == VOC:
        return lambda split: voc_pairs(root, split), list(VOC_CLASSES), None
    if data.name == ADE20K:
        return lambda split: folder_pairs(root, split, ADE20K, "annotations"), list(ADE20K_CLASSES), None
    return (lambda split: cityscapes_pairs(root, split, data.label_kind), list(CITYSCAPES_CLASSES),
            cityscapes_values(data))


def build_semantic_splits(data: DataConfig) -> tuple[SemanticDataset, SemanticDataset]:
    """(train, val) of the source ``data`` names (``sources.SEMANTIC_SOURCES``)."""
    data = semantic_source(data)
    if data.name == SHARDS:  # written by `visiontrain shard` for a semantic task
        policy = {"on_bad_annotation": data.on_bad_annotation, "on_bad_image": data.on_bad_image}
        return tuple(read_shards_semantic(data.shard_spec(), split, limit=limit, **policy)
                     for split, limit in ((data.train_split, data.limit_train), (data.val_split, data.limit_val)))
    if not isinstance(data, LabelMapDataConfig):  # fashion-mosaic: its instance masks painted
        train, val = build_detection_splits(data, masks=True)
        return PaintedLabelMaps(train), PaintedLabelMaps(val)
    if not data.root or not Path(data.root).is_dir():
        raise FileNotFoundError(f"data.name={data.name} needs data.root, a directory (expected layout: "
                                f"{LAYOUTS[data.name]}; got {data.root})")
    splits = {"data.train_split": data.train_split, "data.val_split": data.val_split}
    outside = [f"{key}={split!r}" for key, split in splits.items() if leaves_its_directory(split)]
    if outside:
        raise ValueError(f"{data.name}: {', '.join(outside)} points outside data.root; a split is a name under it")
    root = Path(data.root)
    pairs, classes, values = file_source(data, root)
    return tuple(read_label_maps(pairs(split), classes, data, f"{data.name} {split} ({root})", limit, values)
                 for split, limit in ((data.train_split, data.limit_train), (data.val_split, data.limit_val)))
