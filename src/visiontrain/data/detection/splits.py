"""``data.name`` -> (train, val) DetectionDatasets, for every detection format and embedded set."""
from __future__ import annotations

from pathlib import Path

from visiontrain.core.typed_config import did_you_mean
from visiontrain.data.bad_data import check_skipped_share, class_difference
from visiontrain.data.cache_dir import data_cache_dir
from visiontrain.data.detection import embedded
from visiontrain.data.detection.base import IMAGE_REASONS, DetectionDataset
from visiontrain.data.detection.coco import read_coco
from visiontrain.data.detection.sources import DetectionDataConfig
from visiontrain.data.detection.voc import read_voc
from visiontrain.data.detection.yolo import read_yolo
from visiontrain.data.image_cache import open_caches
from visiontrain.data.shards.datasets import read_shards_detection

FORMATS = ("coco", "voc", "yolo", "fashion-mosaic", "neon-trees")
MASK_FORMATS = ("coco", "yolo", "fashion-mosaic")  # the sources with instance masks (polygons or RLE)


def _need_root(name: str, root: str | None, layout: str) -> Path:
    if not root:
        raise FileNotFoundError(f"data.name={name} needs data.root (expected layout: {layout})")
    path = Path(root)
    if not path.is_dir():
        raise FileNotFoundError(f"data.root={root} does not exist (expected layout for {name}: {layout})")
    return path


def check_not_empty(name: str, split: str, ds: DetectionDataset) -> None:
    """A split without images would train on nothing or score NaN silently: an error naming its file."""
    if len(ds):
        return
    skipped = ", ".join(f"{n} {reason}" for reason, n in sorted(ds.policy.skipped.items()))
    why = f"; skipped under data.on_bad_annotation=skip: {skipped}" if skipped else ""
    raise ValueError(f"{name}: split {split!r} ({ds.source}) has no usable images{why}; "
                     f"expected at least one (data.train_split / data.val_split name the splits)")


def check_skipped(name: str, split: str, ds: DetectionDataset, max_share: float) -> None:
    """``data.max_skipped_share``, for the split's images and for its boxes apart: a split that loses
    more is more likely read wrongly than dirty, and the error says what the readers think the cause is."""
    where, skipped = f"{name} {split} ({ds.source})", ds.policy.skipped
    lost_images = sum(n for reason, n in skipped.items() if reason in IMAGE_REASONS)
    lost_boxes = sum(skipped.values()) - lost_images
    kept_boxes = ds.records.num_boxes
    for unit, lost, total in (("images", lost_images, len(ds) + lost_images),
                              ("boxes", lost_boxes, kept_boxes + lost_boxes)):
        reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items())
                            if (reason in IMAGE_REASONS) == (unit == "images"))
        causes = {cause: n for (of, cause), n in ds.policy.causes.items() if of == unit}
        check_skipped_share(where, f"{unit} are bad data", lost, total, max_share, causes, detail=reasons)


def build_detection_splits(data: DetectionDataConfig, *, masks: bool = False) -> tuple[DetectionDataset,
                                                                                        DetectionDataset]:
    """(train, val) of the source ``data`` names, read as its keys say; ``data.cache=ram`` gives both a
    decoded-image cache, refused before anything is written when they do not fit ``data.cache_gb``.
    ``data.max_skipped_share``: see ``check_skipped``. ``data.name=shards`` reads its
    ``shard_spec()``. ``masks``: read each object's mask too (instance segmentation), from the sources
    that have them."""
    name, root, train_split, val_split = data.name, data.root, data.train_split, data.val_split
    limit_train, limit_val = data.limit_train, data.limit_val
    if masks and name not in (*MASK_FORMATS, "shards"):  # shards: those written with masks (read_shards_detection)
        raise ValueError(f"data.name={name}: this source has no instance masks; a task that trains on masks reads "
                         f"{', '.join(MASK_FORMATS)}")
    policy = dict(on_bad_annotation=data.on_bad_annotation, on_bad_image=data.on_bad_image)
    check = data.check_images  # the file readers' up-front check (shards hold no files to check)
    if name in ("coco", "fashion-mosaic", "neon-trees"):
        if name == "coco":
            base = _need_root(name, root, "ROOT/annotations/instances_<split>.json and ROOT/<split>/*.jpg")
            ann = lambda split: base / "annotations" / f"instances_{split}.json"  # noqa: E731
        else:
            build = embedded.build_fashion_mosaic if name == "fashion-mosaic" else embedded.build_neon_trees
            base = Path(build(Path(root) if root else data_cache_dir()))
            ann = lambda split: base / "annotations" / f"{split}.json"  # noqa: E731
        for split in (train_split, val_split):
            if not ann(split).is_file():
                raise FileNotFoundError(f"{name}: annotation file {ann(split)} does not exist")
        train = read_coco(str(ann(train_split)), str(base / train_split), limit=limit_train, masks=masks,
                          check_images=check, **policy)
        val = read_coco(str(ann(val_split)), str(base / val_split), limit=limit_val, masks=masks,
                        check_images=check, **policy)
    elif name == "shards":
        train, val = (read_shards_detection(data.shard_spec(), split, limit=limit, masks=masks, **policy)
                      for split, limit in ((train_split, limit_train), (val_split, limit_val)))
    elif name == "voc":
        base = _need_root(name, root, "ROOT/ImageSets/Main/<split>.txt, ROOT/Annotations, ROOT/JPEGImages")
        train = read_voc(str(base), train_split, limit=limit_train, check_images=check, **policy)
        val = read_voc(str(base), val_split, class_names=train.class_names, limit=limit_val, check_images=check,
                       **policy)
    elif name == "yolo":
        base = _need_root(name, root, "ROOT/images/<split>/*.jpg, ROOT/labels/<split>/*.txt, ROOT/data.yaml")
        train = read_yolo(str(base), train_split, limit=limit_train, masks=masks, check_images=check, **policy)
        val = read_yolo(str(base), val_split, limit=limit_val, masks=masks, check_images=check, **policy)
    else:
        raise ValueError(f"data.name: unknown detection dataset {name!r}{did_you_mean(name, list(FORMATS))}; "
                         f"expected one of {', '.join(FORMATS)}")
    for split, ds in ((train_split, train), (val_split, val)):
        check_skipped(name, split, ds, data.max_skipped_share)
        check_not_empty(name, split, ds)
    if train.class_names != val.class_names:
        raise ValueError(f"{name}: the classes of split {val_split!r} ({len(val.class_names):,}) must be those of "
                         f"split {train_split!r} ({len(train.class_names):,}), in the same order: "
                         f"{class_difference(train.class_names, val.class_names, train_split, val_split)}")
    if data.cache == "ram":
        caches = open_caches({"train": train.image_shapes(), "val": val.image_shapes()}, budget_gb=data.cache_gb,
                             directory=data.cache_dir)
        train, val = train.with_cache(caches["train"]), val.with_cache(caches["val"])
    elif data.cache != "none":
        raise ValueError(f"data.cache: expected none or ram, got {data.cache!r}")
    return train, val
