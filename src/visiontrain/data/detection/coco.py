"""COCO JSON reader: ``instances_*.json`` + an image folder -> ``DetectionDataset``.

Labels are the categories sorted by id, made contiguous (0..C-1); ``category_ids`` keeps the
original ids so results can be written back in COCO format. Crowd annotations (``iscrowd=1``) are
left out, as DETR and torchvision's references do: they mark regions, not countable objects, and
are not bad data (where masks are read they are kept, flagged, as COCO's evaluation's ignore
regions). Every image file is opened once here (``visiontrain.data.image_check``: its header
and that it is whole), so a missing, unreadable or truncated file is found when the dataset is built
rather than hours into training; the checks run on a small thread pool because on network file
systems they are latency-bound (118k files for COCO train). Category names are taken without the
spaces around them; names equal but for case or spacing are a warning (``data.bad_data``). A large
split read once is kept, packed, in the data cache directory (``detection.record_cache``): a re-run
whose files are all unchanged loads it instead of parsing the JSON and stat's each image instead of
opening it.
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from visiontrain.data import image_check
from visiontrain.data.bad_data import leaves_its_directory, warn_spelled_alike
from visiontrain.data.detection import record_cache
from visiontrain.data.detection.base import (OUTSIDE, BadAnnotationError, BadDataPolicy, DetectionDataset,
                                             ImageRecord, check_box)
from visiontrain.data.detection.images import size_text
from visiontrain.data.detection.masks import segmentation_rle
from visiontrain.data.detection.record_index import annotation_ids

Probe = tuple[tuple[int, int] | None, str, str]  # ((height, width) or None, reason, message)


XYXY_CAUSE = "boxes look like x1,y1,x2,y2: COCO's bbox is x,y,w,h"


def _probe(path: str, verdict: tuple[str | None, tuple[int, int] | None]) -> Probe:
    """(size, "", "") for an image that can be read whole; (None, reason, message) for a missing or
    unreadable one (a truncated file included: its header alone reads)."""
    problem, size = verdict
    if problem == image_check.MISSING:
        return None, "missing image", f"image file {path} does not exist"
    if problem is not None or size is None:
        return None, "unreadable image", f"image file {path} {problem}"
    width, height = size
    return (height, width), "", ""


def probe_images(paths: Sequence[str], chunk: int = 256, check: str = "changed") -> Iterator[Probe]:
    """The probe of each path, in order: the whole file checked and its header's size, from one
    opening of it or from its recorded verdict (``image_check.inspect_images``, ``data.check_images``).
    Lazy by chunks so that ``limit`` stops early."""
    verdicts = image_check.inspect_images(paths, size=True, check=check, chunk=chunk)
    return (_probe(path, verdict) for path, verdict in zip(paths, verdicts))


def keep_boxes(policy: BadDataPolicy, boxes: np.ndarray, width: int, height: int,
               where: Callable[[int], str]) -> np.ndarray:
    """Bool mask of usable rows of float32 XYXY ``boxes`` (clipped in place where ``check_box`` clips).

    Boxes plainly inside the image are accepted in one vectorised test (``check_box`` would accept
    them unchanged); only the rest go through ``check_box``, so its rules and messages stay the one
    source of truth while a COCO-sized file (860k boxes) is not checked one Python call at a time."""
    x1, y1, x2, y2 = boxes.T
    ok = (np.isfinite(boxes).all(axis=1) & (x1 >= 0) & (y1 >= 0) & (x2 <= width) & (y2 <= height)
          & (x2 > x1) & (y2 > y1))
    for i in np.flatnonzero(~ok):
        ok[i] = check_box(policy, boxes[i], width, height, where(int(i)))  # boxes[i] is a view
    return ok


def count_xyxy(boxes: np.ndarray, width: int, height: int) -> int:
    """How many of these rejected boxes (XYXY made from a COCO [x, y, w, h]) would be boxes inside
    the image if the file's four numbers were x1, y1, x2, y2: the likely cause when most are."""
    x1, y1 = boxes[:, 0], boxes[:, 1]
    x2, y2 = boxes[:, 2] - x1, boxes[:, 3] - y1  # the file's third and fourth numbers
    return int(((x2 > x1) & (y2 > y1) & (x2 <= width + 1) & (y2 <= height + 1)).sum())


def ids_text(ids: Sequence[Any], most: int = 20) -> str:
    """A list of valid ids for an error message, shortened for datasets with many classes."""
    shown = ", ".join(str(i) for i in ids[:most])
    return shown + (f", ... ({len(ids)} in all)" if len(ids) > most else "")


def _load(ann_file: str) -> dict[str, Any]:
    """The parsed file, with the three top-level lists checked; a broken file is never skippable."""
    try:
        with open(ann_file, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"COCO annotation file {ann_file} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadAnnotationError(f"{ann_file}: not valid JSON: {err}") from None
    except RecursionError:
        raise BadAnnotationError(f"{ann_file}: not valid COCO: nested too deeply for a JSON reader") from None
    if not isinstance(data, dict):
        raise BadAnnotationError(f"{ann_file}: expected a JSON object with images, annotations and "
                                 f"categories, got {type(data).__name__}")
    for key in ("images", "annotations", "categories"):
        if not isinstance(data.get(key), list):
            what = "missing" if key not in data else f"not a list ({type(data[key]).__name__})"
            raise BadAnnotationError(f"{ann_file}: top-level key {key!r} is {what}")
    return data


def _require(entry: Any, keys: Sequence[str], ann_file: str, where: str) -> None:
    """Raise naming the file, the entry and the missing key (structural errors are not skippable)."""
    if not isinstance(entry, dict):
        raise BadAnnotationError(f"{ann_file}: {where} is not a JSON object: {entry!r}")
    for key in keys:
        if key not in entry:
            raise BadAnnotationError(f"{ann_file}: {where} has no {key!r} key: {entry!r}"[:500])


def _categories(data: dict[str, Any], ann_file: str) -> tuple[list[int], list[str]]:
    """Sorted original ids and their names as written (``_class_names`` makes the classes' names of them)."""
    names: dict[int, str] = {}
    for i, cat in enumerate(data["categories"]):
        _require(cat, ("id",), ann_file, f"categories[{i}]")
        cid = cat["id"]
        if not isinstance(cid, int) or cid in names:
            raise BadAnnotationError(f"{ann_file}: categories[{i}] id {cid!r} is not a unique integer")
        names[cid] = str(cat.get("name", cid))
    if not names:
        raise BadAnnotationError(f"{ann_file}: 'categories' is empty")
    ids = sorted(names)
    return ids, [names[c] for c in ids]


def _class_names(ann_file: str, category_ids: list[int], written: list[str]) -> list[str]:
    """The categories' names without the spaces around them, a warning for names equal but for case
    or spacing; from the file or from the split's kept records alike, so a re-run warns as the first run."""
    warn_spelled_alike(ann_file, [(name, f"category id {c}") for c, name in zip(category_ids, written)])
    return [name.strip() for name in written]


def _images(data: dict[str, Any], ann_file: str) -> dict[int, dict[str, Any]]:
    images: dict[int, dict[str, Any]] = {}
    for i, img in enumerate(data["images"]):
        _require(img, ("id", "file_name"), ann_file, f"images[{i}]")
        if not isinstance(img["id"], int) or img["id"] in images:
            raise BadAnnotationError(f"{ann_file}: images[{i}] id {img['id']!r} is not a unique integer")
        images[img["id"]] = img
    return images


def _inside(image: dict[str, Any], image_dir: str, policy: BadDataPolicy) -> bool:
    """Whether the image's ``file_name`` stays under ``image_dir``; one that leaves it is bad data,
    and never opened."""
    name = str(image["file_name"])
    if not leaves_its_directory(name):
        return True
    policy.bad(OUTSIDE, f"image id {image['id']}: file_name {name!r} is outside the image directory {image_dir} "
                        f"(an absolute path or a '..' step; expected a path under it)")
    return False


def _group(data: dict[str, Any], ann_file: str, images: dict[int, Any], policy: BadDataPolicy,
           crowd: bool = False) -> dict[int, list[dict[str, Any]]]:
    """Annotations by image id, in file order: one pass, so loading stays O(N + M). Crowd ones only
    with ``crowd`` (where masks are read: the evaluation's ignore regions)."""
    by_image: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for i, ann in enumerate(data["annotations"]):
        _require(ann, ("image_id", "category_id", "bbox"), ann_file, f"annotations[{i}]")
        if ann.get("iscrowd", 0) and not crowd:
            continue
        if not isinstance(ann["image_id"], int) or ann["image_id"] not in images:
            policy.bad("unknown image", f"annotation id {ann.get('id', f'#{i}')}: image_id "
                                        f"{ann['image_id']!r} is not in 'images'")
            continue
        by_image[ann["image_id"]].append(ann)
    return by_image


def _boxes_of(anns: list[dict[str, Any]], path: str, label_of: dict[int, int], category_ids: list[int],
              policy: BadDataPolicy) -> tuple[np.ndarray, np.ndarray, list[dict[str, Any]]]:
    """An image's annotations as XYXY float32 boxes, int64 labels and the annotations kept. The common case (every
    category id a known integer, every bbox four numbers) is converted in one numpy call; an image
    with anything else goes annotation by annotation, naming each bad one (``_boxes_one_by_one``)."""
    cids = [a["category_id"] for a in anns]
    if all(type(c) is int and c in label_of for c in cids):
        try:
            xywh = np.array([a["bbox"] for a in anns], dtype=np.float64)
        except (TypeError, ValueError):
            xywh = None
        if xywh is not None and xywh.shape == (len(anns), 4):  # (0,) for an image without annotations
            boxes = np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], 1).astype(np.float32)
            return boxes, np.array([label_of[c] for c in cids], np.int64), anns
        if not anns:
            return np.zeros((0, 4), np.float32), np.zeros(0, np.int64), []
    return _boxes_one_by_one(anns, path, label_of, category_ids, policy)


def _boxes_one_by_one(anns: list[dict[str, Any]], path: str, label_of: dict[int, int], category_ids: list[int],
                      policy: BadDataPolicy) -> tuple[np.ndarray, np.ndarray, list[dict[str, Any]]]:
    """``_boxes_of`` for an image with an unknown category or a malformed bbox: each one is bad data."""
    xyxy, labels, kept = [], [], []
    for ann in anns:
        cid = ann["category_id"]
        label = label_of.get(cid) if isinstance(cid, int) else None
        if label is None:
            policy.bad("unknown category", f"{path} annotation id {ann.get('id')}: unknown category "
                                           f"id {cid!r} (valid ids: {ids_text(category_ids)})")
            continue
        try:
            x, y, w, h = (float(v) for v in ann["bbox"])
        except (TypeError, ValueError):
            policy.bad("malformed annotation", f"{path} annotation id {ann.get('id')}: bbox "
                                               f"{ann['bbox']!r} is not [x, y, w, h]")
            continue
        xyxy.append((x, y, x + w, y + h))
        labels.append(label)
        kept.append(ann)
    return np.array(xyxy, dtype=np.float32).reshape(-1, 4), np.array(labels, dtype=np.int64), kept


def masks_of(anns: list[dict[str, Any]], path: str, height: int, width: int,
             policy: BadDataPolicy) -> tuple[np.ndarray, list[str]]:
    """Which annotations have a usable ``segmentation`` (bool [N]) and their compressed RLEs
    (``masks.segmentation_rle``); a bad one is bad data, named by file and annotation id."""
    ok, counts = np.ones(len(anns), bool), []
    for i, ann in enumerate(anns):
        rle, problem = (segmentation_rle(ann["segmentation"], height, width) if "segmentation" in ann
                        else (None, "is missing (no 'segmentation' key)"))
        if rle is None:
            policy.bad("bad mask", f"{path} annotation id {ann.get('id')}: segmentation {problem}")
            ok[i] = False
        else:
            counts.append(rle)
    return ok, counts


def read_coco(ann_file: str, image_dir: str, *, on_bad_annotation: str = "error", on_bad_image: str | None = None,
              limit: int | None = None, masks: bool = False, check_images: str = "changed") -> DetectionDataset:
    """Read a COCO detection file. Images are taken in id order (as torchvision's CocoDetection);
    ``limit`` keeps the first N images that survive the checks. Boxes: [x, y, w, h] -> XYXY.
    ``masks``: read each annotation's ``segmentation`` too (``masks_of``), and keep crowd regions
    (flagged ``crowd``: the evaluation ignores detections on them; training never sees them).
    A split read before, whose files are all unchanged, is loaded from its kept records instead
    (``split_cache``)."""
    policy = BadDataPolicy(on_bad_annotation, ann_file, on_bad_image)  # an invalid policy name fails first
    cache = split_cache(ann_file, image_dir, policy, masks=masks, limit=limit, check_images=check_images)
    kept = cache.load() if cache is not None else None
    dataset = _kept_dataset(kept, ann_file, policy) if kept is not None else None
    if dataset is not None:
        return dataset
    ann_stamp = record_cache.file_stamps([os.path.abspath(ann_file)]) if cache is not None else None
    data = _load(ann_file)
    category_ids, written = _categories(data, ann_file)
    class_names = _class_names(ann_file, category_ids, written)
    images = _images(data, ann_file)
    by_image = _group(data, ann_file, images, policy, crowd=masks)
    order = [i for i in sorted(images) if _inside(images[i], image_dir, policy)]
    paths = [os.path.join(image_dir, str(images[i]["file_name"])) for i in order]
    stamps = record_cache.file_stamps(paths) if cache is not None else None  # before any is checked
    records = _records(order, paths, images, by_image, category_ids, policy, limit=limit, masks=masks,
                       check_images=check_images)
    policy.raise_unreadable()
    dataset = DetectionDataset(records, class_names, category_ids, source=ann_file, policy=policy)
    if cache is not None:
        cache.save(dataset.records, [os.path.abspath(ann_file), *paths], np.concatenate([ann_stamp, stamps]),
                   {"category_ids": category_ids, "category_names": written, "policy": policy.counts()})
    return dataset


def _kept_dataset(kept: record_cache.KeptSplit, ann_file: str, policy: BadDataPolicy) -> DetectionDataset | None:
    """The dataset of a split kept by an earlier ``read_coco``, its skips counted again in ``policy``;
    None where what was kept beside the records is not what ``read_coco`` keeps (then it reads the file)."""
    try:
        category_ids = [int(c) for c in kept.extra["category_ids"]]
        written = [str(name) for name in kept.extra["category_names"]]
        labels = kept.records.labels
        if not written or len(written) != len(category_ids) or (len(labels) and labels.max() >= len(written)):
            raise ValueError("classes that do not fit the kept records")
        policy.add_counts(kept.extra["policy"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return DetectionDataset(kept.records, _class_names(ann_file, category_ids, written), category_ids,
                            source=ann_file, policy=policy)


def split_cache(ann_file: str, image_dir: str, policy: BadDataPolicy, *, masks: bool, limit: int | None,
                check_images: str) -> record_cache.RecordCache | None:
    """Where this split's records are kept between runs (``detection.record_cache``), or None where
    they are not: under ``data.check_images=changed`` only (``full`` opens every file at each run,
    ``off`` promises no check), without ``limit`` (a part of a split), and for an annotation file
    of ``record_cache.MIN_BYTES`` or more (a small one parses in tens of milliseconds)."""
    try:
        big = os.path.getsize(ann_file) >= record_cache.MIN_BYTES
    except OSError:
        return None  # missing: _load says so
    if check_images != "changed" or limit is not None or not big:
        return None
    return record_cache.RecordCache.for_split({
        "reader": "coco", "annotations": os.path.abspath(ann_file), "image_dir": image_dir,
        "image_dir_abs": os.path.abspath(image_dir), "masks": masks, "on_bad_annotation": policy.policy,
        "on_bad_image": policy.image_policy})


def _records(order: list[int], paths: list[str], images: dict[int, dict[str, Any]],
             by_image: dict[int, list[dict[str, Any]]], category_ids: list[int], policy: BadDataPolicy, *,
             limit: int | None, masks: bool, check_images: str) -> list[ImageRecord]:
    """The record of each image of ``order`` (at ``paths``) that survives the checks, its file probed
    (``probe_images``) and its annotations converted and checked; the first ``limit`` only."""
    label_of = {cid: label for label, cid in enumerate(category_ids)}
    records: list[ImageRecord] = []
    for image_id, path, (size, reason, message) in zip(order, paths, probe_images(paths, check=check_images)):
        if limit is not None and len(records) >= limit:
            break
        if size is None:
            policy.bad(reason, message)
            continue
        height, width = size
        img = images[image_id]
        if (img.get("height", height), img.get("width", width)) != (height, width):
            policy.bad("image size mismatch", f"image file {path}: the annotation says "
                                              f"{img.get('width')}x{img.get('height')} (WxH), the file "
                                              f"is {size_text(path, width, height)}")
            continue
        boxes, labels, anns = _boxes_of(by_image.get(image_id, []), path, label_of, category_ids, policy)
        keep = keep_boxes(policy, boxes, width, height, lambda i: f"{path} annotation id {anns[i].get('id')}")
        if not keep.all():
            policy.note("boxes", XYXY_CAUSE, count_xyxy(boxes[~keep], width, height))
        rles = crowd = None
        if masks:
            keep[keep], rles = masks_of([a for a, k in zip(anns, keep) if k], path, height, width, policy)
            crowd = np.array([bool(a.get("iscrowd", 0)) for a, k in zip(anns, keep) if k], bool)
        kept = [a for a, k in zip(anns, keep) if k]
        records.append(ImageRecord(path=path, image_id=image_id, height=height, width=width, boxes=boxes[keep],
                                   labels=labels[keep], ann_ids=annotation_ids([a.get("id") for a in kept]),
                                   masks=rles, crowd=crowd))
    return records
