"""YOLO (Ultralytics) reader: ``images/{split}/`` + ``labels/{split}/*.txt`` -> ``DetectionDataset``.

Each label line is ``cls cx cy w h`` with the box normalised to [0, 1] by the image size, so the
size is read from each image's header here (which also finds missing / unreadable files up front).
A label file that does not exist means the image has no objects: Ultralytics treats it as a
background (negative) image, and so do we. Class names come from ``data.yaml`` (``names:`` as a
list or an ``{id: name}`` dict) or ``classes.txt``, without the spaces around them (names equal but
for case or spacing are a warning); ``category_ids`` are YOLO's own class indices.

A line with more than 4 numbers after the class is an Ultralytics segmentation polygon, ``class x1 y1
x2 y2 ...`` normalised the same way. Read for boxes (``masks=False``), its box is the polygon's
bounding box, as Ultralytics trains its detectors on segmentation labels, so a YOLO-seg dataset
trains every detector. Read for instance masks (``masks=True``), each polygon is turned into pixels
and into a compressed RLE (``masks.polygon_rle``, which checks it); there a box line is bad data, as
it has no mask. A bad mask (an odd coordinate count, coordinates outside the image, no pixel inside
it) follows ``on_bad_annotation`` with a message naming the file and line.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import yaml

from visiontrain.core import safe_yaml
from visiontrain.data.bad_data import warn_spelled_alike
from visiontrain.data.detection.base import (BadAnnotationError, BadDataPolicy, DetectionDataset, ImageRecord)
from visiontrain.data.detection.coco import ids_text, keep_boxes, probe_images
from visiontrain.data.detection.masks import polygon_rle

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp")
PIXELS_CAUSE = "labels look like pixel coordinates: YOLO's cx cy w h are divided by the image width and height"
ONE_BASED_CAUSE = "class indices look 1-based: YOLO's first class (the first name in data.yaml) is 0"
LAYOUT = ("expected the YOLO layout root/images/{split}/*.jpg|png, root/labels/{split}/<stem>.txt "
          "and root/data.yaml (names: [...]) or root/classes.txt")


def _class_names(root: str) -> tuple[list[int], list[str]]:
    """(sorted class indices, names as written but for the spaces around them, with a warning for
    names equal but for case or spacing). A dict with gaps keeps its indices; labels are made contiguous."""
    ids, names, source = _written_class_names(root)
    warn_spelled_alike(source, [(name, f"class {i}") for i, name in zip(ids, names)])
    return ids, [name.strip() for name in names]


def _written_class_names(root: str) -> tuple[list[int], list[str], str]:
    """(sorted class indices, names as written, the file they come from)."""
    yaml_path, txt_path = os.path.join(root, "data.yaml"), os.path.join(root, "classes.txt")
    if os.path.isfile(yaml_path):
        try:
            with open(yaml_path, encoding="utf-8") as f:
                data = safe_yaml.load(f)
        except yaml.YAMLError as err:
            raise BadAnnotationError(f"{yaml_path}: not valid YAML: {err}") from None
        names = data.get("names") if isinstance(data, dict) else None
        if isinstance(names, list) and names:
            return list(range(len(names))), [str(n) for n in names], yaml_path
        if isinstance(names, dict) and names:
            try:
                by_id = {int(k): str(v) for k, v in names.items()}
            except (TypeError, ValueError):
                raise BadAnnotationError(f"{yaml_path}: 'names' keys must be class indices, got "
                                         f"{list(names)[:10]}") from None
            ids = sorted(by_id)
            return ids, [by_id[i] for i in ids], yaml_path
        raise BadAnnotationError(f"{yaml_path}: 'names' is missing or empty (expected a list of class "
                                 f"names or an {{index: name}} mapping)")
    if os.path.isfile(txt_path):
        with open(txt_path, encoding="utf-8") as f:
            names_txt = [line.rstrip("\r\n") for line in f if line.strip()]
        if not names_txt:
            raise BadAnnotationError(f"{txt_path}: no class names (expected one a line)")
        return list(range(len(names_txt))), names_txt, txt_path
    raise FileNotFoundError(f"no class names: neither {yaml_path} nor {txt_path} exists; {LAYOUT}")


def _parse_line(line: str) -> tuple[int, list[float]] | None:
    """(class index, the numbers after it: a box's cx cy w h, or a polygon's x1 y1 x2 y2 ...), or None
    when the line is not numbers with an integral class and at least 4 numbers after it."""
    fields = line.split()
    if len(fields) < 5:
        return None
    try:
        cls, *values = (float(v) for v in fields)
    except ValueError:
        return None
    if not cls.is_integer():
        return None
    return int(cls), values


def _malformed(line: str) -> str:
    """What a line that ``_parse_line`` refused should have been: a box line, or a polygon line where
    it has more fields than a box."""
    if len(line.split()) <= 5:
        return f"{line.strip()[:80]!r} is not 'class cx cy w h' (5 numbers, integer class)"
    return f"{line.strip()[:80]!r} is not 'class x1 y1 x2 y2 ...' (a polygon: numbers, integer class)"


def _line_object(values: list[float], width: int, height: int, masks: bool, where: str,
                 policy: BadDataPolicy) -> tuple[tuple[float, float, float, float], str | None] | None:
    """(XYXY box in pixels, compressed RLE mask or None) of a line's numbers after its class: a box
    (4 numbers) or a polygon (more; its box is its bounding box); None for bad data (reported)."""
    if len(values) == 4:
        if masks:
            policy.bad("bad mask", f"{where}: a box line has no polygon (instance masks need "
                                   f"'class x1 y1 x2 y2 ...', at least 3 points)")
            return None
        cx, cy, w, h = values
        return ((cx - w / 2) * width, (cy - h / 2) * height, (cx + w / 2) * width, (cy + h / 2) * height), None
    if not masks and len(values) % 2:
        policy.bad("malformed line", f"{where}: a polygon of {len(values)} coordinates (needs x, y pairs)")
        return None
    xy = np.array(values) * np.where(np.arange(len(values)) % 2 == 0, width, height)  # to pixels
    rle = None
    if masks:
        rle, problem = polygon_rle([xy], height, width)
        if rle is None:
            policy.bad("bad mask", f"{where}: segmentation {problem}")
            return None
    x, y = xy[0::2], xy[1::2]
    return (float(x.min()), float(y.min()), float(x.max()), float(y.max())), rle


def _read_labels(label_path: str, width: int, height: int, label_of: dict[int, int],
                 category_ids: list[int], policy: BadDataPolicy, masks: bool = False
                 ) -> tuple[np.ndarray, np.ndarray, list[int], list[str]] | None:
    """(boxes [N, 4], labels [N], line numbers, compressed RLE masks: [N] with ``masks``, else []) of
    one label file, empty when it does not exist (a negative image); None when the file cannot be
    read and was skipped."""
    if not os.path.isfile(label_path):
        return np.zeros((0, 4), np.float32), np.zeros(0, np.int64), [], []
    try:
        with open(label_path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        policy.bad("unreadable annotation", f"label file {label_path} cannot be read: {err}")
        return None
    boxes: list[tuple[float, ...]] = []
    labels, line_numbers, in_pixels, rles = [], [], [], []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{label_path} line {n}"
        parsed = _parse_line(line)
        if parsed is None:
            policy.bad("malformed line", f"{where}: {_malformed(line)}")
            continue
        cls, values = parsed
        if cls not in label_of:
            policy.bad("unknown category", f"{where}: unknown class index {cls} "
                                           f"(valid: {ids_text(category_ids)})")
            if cls == category_ids[-1] + 1:
                policy.note("boxes", ONE_BASED_CAUSE)
            continue
        read = _line_object(values, width, height, masks, where, policy)
        if read is None:
            continue
        boxes.append(read[0])
        rles.append(read[1])
        labels.append(label_of[cls])
        line_numbers.append(n)
        in_pixels.append(max(values) > 1.0)
    xyxy = np.array(boxes, dtype=np.float32).reshape(-1, 4)
    keep = keep_boxes(policy, xyxy, width, height, lambda i: f"{label_path} line {line_numbers[i]}")
    policy.note("boxes", PIXELS_CAUSE, int((~keep & np.array(in_pixels, dtype=bool)).sum()))
    return (xyxy[keep], np.array(labels, dtype=np.int64)[keep], [n for n, k in zip(line_numbers, keep) if k],
            [m for m, k in zip(rles, keep) if k and m is not None])


def read_yolo(root: str, split: str, *, on_bad_annotation: str = "error", on_bad_image: str | None = None,
              limit: int | None = None, masks: bool = False, check_images: str = "changed") -> DetectionDataset:
    """Read one YOLO split. Images (searched recursively) are taken in sorted path order and their
    ids are 1-based positions in that order; ``limit`` keeps the first N that survive the checks.
    ``masks``: read each line's polygon as its instance mask too (the module docstring)."""
    image_dir, label_dir = os.path.join(root, "images", split), os.path.join(root, "labels", split)
    policy = BadDataPolicy(on_bad_annotation, label_dir, on_bad_image)
    if not os.path.isdir(image_dir):
        raise FileNotFoundError(f"YOLO image folder {image_dir} does not exist; {LAYOUT}")
    if not os.path.isdir(label_dir):  # every image a negative is almost surely a wrong path
        raise FileNotFoundError(f"YOLO label folder {label_dir} does not exist; {LAYOUT}")
    category_ids, class_names = _class_names(root)
    label_of = {cid: label for label, cid in enumerate(category_ids)}
    rel_paths = sorted(p.relative_to(image_dir) for p in Path(image_dir).rglob("*")
                       if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not rel_paths:
        raise FileNotFoundError(f"no images ({', '.join(IMAGE_SUFFIXES)}) under {image_dir}; {LAYOUT}")
    paths = [os.path.join(image_dir, p) for p in rel_paths]

    records: list[ImageRecord] = []
    for image_id, (rel, path, (size, reason, message)) in enumerate(
            zip(rel_paths, paths, probe_images(paths, check=check_images)), 1):
        if limit is not None and len(records) >= limit:
            break
        if size is None:
            policy.bad(reason, message)
            continue
        height, width = size
        label_path = os.path.join(label_dir, rel.with_suffix(".txt"))
        read = _read_labels(label_path, width, height, label_of, category_ids, policy, masks)
        if read is None:
            continue
        boxes, labels, line_numbers, rles = read
        records.append(ImageRecord(path=path, image_id=image_id, height=height, width=width,
                                   boxes=boxes, labels=labels, ann_ids=np.array(line_numbers, np.int64),
                                   masks=rles if masks else None))
    policy.raise_unreadable()
    return DetectionDataset(records, class_names, category_ids, source=label_dir, policy=policy)
