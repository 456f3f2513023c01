"""Panoptic data: COCO's panoptic format (``annotations/panoptic_<split>.json`` and a PNG of segment
ids per image, ``annotations/panoptic_<split>/``), read from a tree under ``data.root``
(``data.name=coco-panoptic``: COCO panoptic 2017 as it unzips; ``data.name=cityscapes-panoptic``: the
same format in Cityscapes' folders, string image ids and images found by id, ``cityscapes_image_name``)
or built in (fashion-mosaic, whose panoptic files sit beside its instance json), or the shards
``visiontrain shard`` wrote of any of them (``data.name=shards``: each image and its id PNG read from
the shards, ``ShardPanopticFiles``).

A sample is what Panoptic FPN trains on, made from the image's id map when it is loaded (nothing
per pixel is read up front, so COCO's 118k PNGs cost nothing until used):

- ``boxes``, ``labels``, ``masks``: each thing segment (a category with ``isthing: 1``) as an
  instance, its mask the segment's pixels and its box their tight box; crowd segments are no
  instance (they mark a region, as the detection readers treat COCO's crowds);
- ``semantic``: a ``tv_tensors.Mask`` uint8 [H, W] for the semantic head, Detectron2's convention:
  0 where any thing is (``THINGS``, crowds included), 1 + k for the k-th stuff category, and the
  ignore index 255 where the PNG has no segment (VOID).

Every transform moves the masks and the semantic map with the image (nearest neighbour); the
thing masks and boxes are sanitized together while the semantic map is set aside
(``SanitizeThings``), since torchvision's sanitizer would index every mask by the boxes kept.
The ground truth PQ is scored against is the PNG itself at its own size (``truth``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from visiontrain.core._tv_compat import ensure_torchvision
from visiontrain.core.panoptic_format import Segment, parse_segments, read_panoptic
from visiontrain.data.bad_data import leaves_its_directory
from visiontrain.data.cache_dir import data_cache_dir
from visiontrain.data.detection.base import BadAnnotationError, BadDataPolicy
from visiontrain.data.detection.embedded import build_fashion_mosaic
from visiontrain.data.detection.images import read_rgb
from visiontrain.data.image_cache import ImageCache, open_caches
from visiontrain.data.image_check import MISSING, inspect_images
from visiontrain.data.section import DataConfig
from visiontrain.data.segmentation.sources import (CITYSCAPES_PANOPTIC, CITYSCAPES_PANOPTIC_LAYOUT, COCO_PANOPTIC,
                                                   IGNORE_INDEX, LAYOUT, SHARDS, panoptic_source)
from visiontrain.data.shards.layout import PANOPTIC_MEMBER
from visiontrain.data.shards.segmentation import ShardPanopticFiles, shard_panoptic_split

THINGS = "things"  # the semantic head's class 0: every thing's pixels


class BadIdPng(BadAnnotationError):
    """An id PNG that cannot be read, is of another size than its image, or disagrees with its
    segments_info: bad annotation (``data.on_bad_annotation``), where an image that cannot be
    decoded is a bad image (``data.on_bad_image``)."""


@dataclass(frozen=True)
class PanopticRecord:
    image: str
    png: str
    image_id: int
    height: int
    width: int
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class Categories:
    """A panoptic dataset's categories split as the model sees them: the things (the detector's
    classes, 0-based) and the stuff (the semantic head's classes 1..S, after ``THINGS``)."""
    things: tuple[int, ...]          # category ids
    stuff: tuple[int, ...]
    names: dict[int, str]            # category id -> name
    raw: tuple[dict, ...]            # as the JSON lists them (for PanopticQuality)

    @classmethod
    def from_json(cls, categories: Sequence[dict], where: str) -> Categories:
        for c in categories:
            if "id" not in c or c.get("isthing") not in (0, 1):
                raise ValueError(f"{where}: category {c} needs an id and isthing 0 or 1")
        ordered = sorted(categories, key=lambda c: int(c["id"]))
        things = tuple(int(c["id"]) for c in ordered if c["isthing"])
        stuff = tuple(int(c["id"]) for c in ordered if not c["isthing"])
        if not things:
            raise ValueError(f"{where}: no category has isthing 1: panoptic segmentation needs things to detect")
        return cls(things, stuff, {int(c["id"]): str(c.get("name", c["id"])).strip() for c in ordered},
                   tuple(dict(c) for c in ordered))

    @property
    def thing_names(self) -> list[str]:
        return [self.names[c] for c in self.things]

    @property
    def semantic_names(self) -> list[str]:
        return [THINGS, *(self.names[c] for c in self.stuff)]


class PanopticDataset(Dataset):
    """(image, target) samples of a panoptic split (the module docstring) and an optional v2 transform."""

    def __init__(self, records: Sequence[PanopticRecord], categories: Categories, *, source: str,
                 policy: BadDataPolicy, transform: Callable | None = None, cache: ImageCache | None = None,
                 files: ShardPanopticFiles | None = None) -> None:
        self.records, self.categories, self.source, self.policy = list(records), categories, source, policy
        # files: where sample i's image and id PNG are read when not from the files its record names (shards)
        self.transform, self.cache, self.files = transform, cache, files
        self._thing_label = {c: i for i, c in enumerate(categories.things)}
        self._stuff_class = {c: 1 + i for i, c in enumerate(categories.stuff)}
        self.index_of = {r.image_id: i for i, r in enumerate(self.records)}

    @property
    def class_names(self) -> list[str]:
        return self.categories.thing_names

    @property
    def num_classes(self) -> int:
        return len(self.categories.things)

    def __len__(self) -> int:
        return len(self.records)

    def aspect_ratios(self) -> list[float]:
        return [r.width / r.height for r in self.records]

    def image_shapes(self) -> np.ndarray:
        """(3, height, width) of every image, from the JSON's sizes (no decoding): what a cache holds."""
        return np.array([(3, r.height, r.width) for r in self.records], dtype=np.int64).reshape(-1, 3)

    def with_transform(self, transform: Callable | None) -> PanopticDataset:
        return PanopticDataset(self.records, self.categories, source=self.source, policy=self.policy,
                               transform=transform, cache=self.cache, files=self.files)

    def with_cache(self, cache: ImageCache | None) -> PanopticDataset:
        """The same images, kept in ``cache`` once decoded (``data.cache=ram``; its slots are the indices)."""
        return PanopticDataset(self.records, self.categories, source=self.source, policy=self.policy,
                               transform=self.transform, cache=cache, files=self.files)

    def truth(self, index: int) -> tuple[np.ndarray, list[Segment]]:
        """The ground truth PQ scores against: the id map [H, W] at the PNG's size and its segments,
        checked against the image's size first and then against each other (``read_panoptic``)."""
        r = self.records[index]
        try:
            png, segments = (r.png, r.segments) if self.files is None else self.files.id_png(index)
            with Image.open(png) as opened:
                width, height = opened.size
            if (height, width) != (r.height, r.width):
                raise BadAnnotationError(f"id PNG {r.png} is {width}x{height} (WxH) but its image {r.image} is "
                                         f"{r.width}x{r.height}")
            if not isinstance(png, str):
                png.seek(0)  # the bytes of a shard's member, read again whole
            return read_panoptic(png, segments, where=r.png)
        except UnidentifiedImageError:  # PIL names the file object it was given: a shard's says nothing
            raise BadIdPng(f"id PNG {r.png} cannot be read: not an image file") from None
        except (OSError, SyntaxError, ValueError) as err:  # PIL raises SyntaxError on a broken PNG chunk
            text = str(err)
            raise BadIdPng(text if r.png in text else f"id PNG {r.png} cannot be read: {text}") from None

    def load(self, index: int) -> tuple[Any, dict[str, Any]]:
        """The untransformed sample: tv_tensors.Image uint8 [3, H, W] and its target."""
        ensure_torchvision()
        from torchvision import tv_tensors

        r = self.records[index]
        image = self.cache.get(index) if self.cache is not None else None
        if image is None:
            image = read_rgb(r.image) if self.files is None else self.files.image(index)
            if self.cache is not None:
                self.cache.put(index, image)
        if tuple(image.shape[-2:]) != (r.height, r.width):
            raise BadAnnotationError(f"{self.source}: image file {r.image}: decoded as {image.shape[-1]}x"
                                     f"{image.shape[-2]} (WxH), but its header said {r.width}x{r.height} when the "
                                     f"dataset was read (the file changed since?)")
        ids, segments = self.truth(index)
        masks, labels, semantic = self.instances_and_semantic(ids, segments)
        boxes = masks_to_boxes(masks)
        target = {"boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=ids.shape),
                  "labels": labels, "masks": tv_tensors.Mask(masks), "semantic": tv_tensors.Mask(semantic),
                  "image_id": r.image_id, "orig_size": torch.tensor([r.height, r.width])}
        return tv_tensors.Image(image), target

    def instances_and_semantic(self, ids: np.ndarray, segments: Sequence[Segment]
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(masks uint8 [N, H, W], labels int64 [N], semantic uint8 [H, W]) of one id map."""
        semantic = np.full(ids.shape, IGNORE_INDEX, dtype=np.uint8)
        masks, labels = [], []
        for s in segments:
            pixels = ids == s.id
            if s.category_id in self._thing_label:
                semantic[pixels] = 0
                if not s.iscrowd:
                    masks.append(pixels)
                    labels.append(self._thing_label[s.category_id])
            elif s.category_id in self._stuff_class:
                semantic[pixels] = self._stuff_class[s.category_id]
            else:
                raise BadAnnotationError(f"{self.source}: segment {s.id} has category_id {s.category_id}, which is no "
                                         f"category of the JSON")
        stacked = np.stack(masks) if masks else np.zeros((0, *ids.shape), dtype=bool)
        return (torch.from_numpy(stacked.astype(np.uint8)), torch.tensor(labels, dtype=torch.int64),
                torch.from_numpy(semantic))

    def __getitem__(self, index: int) -> tuple[Any, dict[str, Any]]:
        image, target = self.policy.load_or_next(self.load, index, len(self.records), key=policy_key)
        return (image, target) if self.transform is None else self.transform(image, target)


def policy_key(err: BadAnnotationError) -> str:
    """The data key whose policy a sample bad when loaded follows: an id PNG is an annotation."""
    return "on_bad_annotation" if isinstance(err, BadIdPng) else "on_bad_image"


def masks_to_boxes(masks: torch.Tensor) -> torch.Tensor:
    """float32 [N, 4] XYXY pixel-edge boxes of uint8 [N, H, W] masks (torchvision's ``masks_to_boxes``
    gives the last pixel's index as x2, a box one pixel short of the mask's edge)."""
    if not len(masks):
        return torch.zeros((0, 4), dtype=torch.float32)
    rows, cols = masks.any(2), masks.any(1)
    first = lambda m: m.float().argmax(1)  # noqa: E731
    last = lambda m: m.shape[1] - m.flip(1).float().argmax(1)  # noqa: E731
    return torch.stack([first(cols), first(rows), last(cols), last(rows)], 1).float()


def coco_image_name(image: dict) -> str:
    """The file of an ``images`` entry under the split's image folder, as COCO names it: its file_name."""
    return str(image.get("file_name", ""))


def cityscapes_image_name(image: dict) -> str:
    """The file of an ``images`` entry under ``leftImg8bit/<split>``, found as Detectron2 finds it, by
    the image's id (``frankfurt_000000_000294``) in its city's folder (the id's first part): the
    entry's file_name (``..._gtFine_leftImg8bit.png``) is no file of the dataset."""
    image_id = str(image.get("id", ""))
    return f"{image_id.split('_')[0]}/{image_id}_leftImg8bit.png"


def read_panoptic_split(ann_file: Path, image_dir: Path, png_dir: Path, data: DataConfig, limit: int | None,
                        where: str, image_name: Callable[[dict], str] = coco_image_name) -> PanopticDataset:
    """One split's records from its panoptic JSON: the first ``limit`` whose image and id PNG pass the
    up-front check (the images opened through ``inspect_images``, the PNGs' presence). ``image_name``
    is the layout's: where under ``image_dir`` an ``images`` entry's file is."""
    try:
        coco = json.loads(ann_file.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{where}: cannot read {ann_file}: {err}") from None
    for key in ("images", "annotations", "categories"):
        if key not in coco:
            raise ValueError(f"{ann_file}: no {key!r} list; expected COCO's panoptic format")
    categories = Categories.from_json(coco["categories"], str(ann_file))
    numbers = _image_numbers(coco["images"], ann_file)
    images = {i["id"]: i for i in coco["images"]}
    for ann in coco["annotations"]:
        _check_names(ann, images, image_name, ann_file)
    policy = BadDataPolicy(data.on_bad_annotation, where, data.on_bad_image)
    anns = coco["annotations"]
    paths = [str(image_dir / image_name(images[a["image_id"]])) if a["image_id"] in images else "" for a in anns]
    kept: list[PanopticRecord] = []
    for ann, path, verdict in zip(anns, paths, inspect_images(paths, size=True, check=data.check_images)):
        if limit is not None and len(kept) == limit:
            break
        record = _record(ann, path, verdict, numbers, png_dir, policy, ann_file)
        if record is not None:
            kept.append(record)
    policy.finish_split(len(kept), data.max_skipped_share)
    return PanopticDataset(kept, categories, source=where, policy=policy)


def _image_numbers(images: Sequence[dict], ann_file: Path) -> dict[int | str, int]:
    """Each ``images`` entry's id -> the int a sample carries as its ``image_id`` (the evaluation finds
    its image by it, and a batch's targets hold it as a number): COCO's int ids as they are;
    string ids (Cityscapes' ``frankfurt_000000_000294``) by the image's position in the JSON, from 1,
    the name staying in the record's image path."""
    ids = [i.get("id") for i in images]
    for image_id in ids:
        if not isinstance(image_id, (int, str)) or isinstance(image_id, bool):
            raise ValueError(f"{ann_file}: image id {image_id!r} is neither an int nor a string")
    if all(isinstance(i, int) for i in ids):
        return {i: i for i in ids}
    return {image_id: n for n, image_id in enumerate(ids, start=1)}


def _check_names(ann: dict, images: dict[int | str, dict], image_name: Callable[[dict], str], ann_file: Path
                 ) -> None:
    """An annotation's keys, and the PNG and image it names inside the dataset, before any file is opened."""
    for key in ("file_name", "image_id", "segments_info"):
        if key not in ann:
            raise ValueError(f"{ann_file}: an annotation has no {key!r}: expected COCO's panoptic format")
    if not isinstance(ann["image_id"], (int, str)) or isinstance(ann["image_id"], bool):
        raise ValueError(f"{ann_file}: annotation {ann['file_name']!r} has image_id {ann['image_id']!r}, neither "
                         f"an int nor a string")
    image = images.get(ann["image_id"])
    for what, name in (("file_name", ann["file_name"]), *([("image", image_name(image))] if image is not None else [])):
        if leaves_its_directory(str(name)):
            raise ValueError(f"{ann_file}: {what} {name!r} names a file outside the dataset")


def _record(ann: dict, path: str, verdict: tuple, numbers: dict[int | str, int], png_dir: Path,
            policy: BadDataPolicy, ann_file: Path) -> PanopticRecord | None:
    """One annotation's record, or None (and the policy told) where its image or PNG is bad."""
    if ann["image_id"] not in numbers:
        policy.bad("missing image", f"{ann_file}: annotation {ann['file_name']} names image_id {ann['image_id']}, "
                                    f"which is in no 'images' entry")
        return None
    problem, size = verdict
    if problem is not None or size is None:
        policy.bad("missing image" if problem == MISSING else "unreadable image", f"image file {path} {problem}")
        return None
    png = png_dir / str(ann["file_name"])
    if not png.is_file():
        policy.bad("missing annotation", f"id PNG {png} does not exist")
        return None
    width, height = size
    segments = tuple(parse_segments(ann["segments_info"], where=f"{ann_file}: {ann['file_name']}"))
    return PanopticRecord(path, str(png), numbers[ann["image_id"]], height, width, segments)


def _split_files(name: str, base: Path, split: str) -> tuple[Path, Path, Path, Callable[[dict], str]]:
    """(JSON, images' folder, id PNGs' folder, image_name) of one split in a source's layout
    (``sources.py``: ``LAYOUT``, ``CITYSCAPES_PANOPTIC_LAYOUT``)."""
    if name == CITYSCAPES_PANOPTIC:
        gt = base / "gtFine"
        return (gt / f"cityscapes_panoptic_{split}.json", base / "leftImg8bit" / split,
                gt / f"cityscapes_panoptic_{split}", cityscapes_image_name)
    notes = base / "annotations"
    return notes / f"panoptic_{split}.json", base / split, notes / f"panoptic_{split}", coco_image_name


def build_panoptic_splits(data: DataConfig) -> tuple[PanopticDataset, PanopticDataset]:
    """(train, val) of the source ``data`` names: COCO or Cityscapes panoptic under data.root, or
    fashion-mosaic built (once) into data.root or the data cache dir."""
    data = panoptic_source(data)
    if data.name == SHARDS:
        train, val = (read_shards_panoptic(data, split, limit)
                      for split, limit in ((data.train_split, data.limit_train), (data.val_split, data.limit_val)))
        return _cached(data, train, val)
    layout = CITYSCAPES_PANOPTIC_LAYOUT if data.name == CITYSCAPES_PANOPTIC else LAYOUT
    if data.name in (COCO_PANOPTIC, CITYSCAPES_PANOPTIC):
        if not data.root or not Path(data.root).is_dir():
            raise FileNotFoundError(f"data.name={data.name} needs data.root, a directory ({layout}; got {data.root})")
        base = Path(data.root)
    else:
        base = Path(build_fashion_mosaic(Path(data.root) if data.root else data_cache_dir()))
    splits = []
    for split, limit in ((data.train_split, data.limit_train), (data.val_split, data.limit_val)):
        ann, image_dir, png_dir, image_name = _split_files(data.name, base, split)
        if not ann.is_file():
            raise FileNotFoundError(f"{data.name}: annotation file {ann} does not exist (expected layout: {layout})")
        splits.append(read_panoptic_split(ann, image_dir, png_dir, data, limit, f"{data.name} {split} ({base})",
                                          image_name))
    train, val = splits
    if train.categories != val.categories:
        raise ValueError(f"{data.name}: the categories of split {data.val_split!r} differ from those of "
                         f"{data.train_split!r}")
    return _cached(data, train, val)


def _cached(data: DataConfig, train: PanopticDataset, val: PanopticDataset) -> tuple[PanopticDataset, PanopticDataset]:
    """(train, val), each with its decoded-image cache where ``data.cache=ram`` (the detection sources' key,
    which fashion-mosaic and shards have)."""
    if getattr(data, "cache", "none") == "ram":
        caches = open_caches({"train": train.image_shapes(), "val": val.image_shapes()}, budget_gb=data.cache_gb,
                             directory=data.cache_dir)
        train, val = train.with_cache(caches["train"]), val.with_cache(caches["val"])
    return train, val


def read_shards_panoptic(data: DataConfig, split_name: str, limit: int | None) -> PanopticDataset:
    """One split of panoptic shards (``data.name=shards``): its records from the samples file (each
    image's id and size; its segments_info is read with its id PNG), its image and id PNG from the
    shards (``ShardPanopticFiles``), so that a sample is the one the files give."""
    split, categories = shard_panoptic_split(data.shard_spec(), split_name, limit)
    files, a = ShardPanopticFiles(split), split.samples.labels
    records = [PanopticRecord(files.where(i), f"{files.where(i)} {PANOPTIC_MEMBER}", int(a["image_id"][i]),
                              int(a["height"][i]), int(a["width"][i]), ()) for i in range(len(split))]
    where = f"{split.store.location} split {split_name}"
    return PanopticDataset(records, Categories.from_json(categories, where), source=where,
                           policy=BadDataPolicy(data.on_bad_annotation, where, data.on_bad_image), files=files)


class SanitizeThings:
    """torchvision's SanitizeBoundingBoxes on the things only (boxes a resize or crop left degenerate
    dropped with their labels and masks), the semantic map set aside meanwhile: the sanitizer indexes
    every ``Mask`` in the sample by the boxes kept."""

    def __init__(self) -> None:
        from visiontrain.data.detection.transforms import sanitize_boxes

        self.sanitize = sanitize_boxes()

    def __call__(self, image: Any, target: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        semantic = target["semantic"]
        image, things = self.sanitize(image, {k: v for k, v in target.items() if k != "semantic"})
        return image, {**things, "semantic": semantic}
