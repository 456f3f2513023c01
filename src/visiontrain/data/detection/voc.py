"""Pascal VOC reader: ``ImageSets/Main/{split}.txt`` + ``Annotations/*.xml`` -> ``DetectionDataset``.

VOC box coordinates are 1-based pixel indices, inclusive at both ends: a box covering the whole
W x H image is (xmin=1, ymin=1, xmax=W, ymax=H). In the continuous XYXY pixel space every other
reader uses, that box is (0, 0, W, H), so xmin and ymin lose 1 and xmax, ymax are kept (as
Detectron2 does). Without it every VOC box would be shifted by a pixel against COCO / YOLO boxes.

Class names come from the data: by default the sorted set of object names found in this split, so
the caller reads train first and passes ``train.class_names`` to val (a val-only name is then bad
data instead of silently shifting every label). ``category_ids`` are 1..C, like COCO's. A name is
taken without the spaces around it (``tree `` is ``tree``); names equal but for case or spacing
(``Tree`` and ``tree``) stay two classes, with a warning naming both spellings and their files.
"""
from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass

import numpy as np

from visiontrain.data.bad_data import alike_in, leaves_its_directory, listed, warn_spelled_alike
from visiontrain.data.detection.base import (OUTSIDE, BadAnnotationError, BadDataPolicy, DetectionDataset,
                                             ImageRecord, check_box)
from visiontrain.data.detection.coco import Probe, probe_images
from visiontrain.data.detection.images import size_text

LAYOUT = ("expected the Pascal VOC layout root/ImageSets/Main/{split}.txt (one image id a line), "
          "root/Annotations/{id}.xml and root/JPEGImages/{id}.jpg")


@dataclass
class _Object:
    index: int          # 1-based position in the XML, the annotation id in messages
    name: str
    box: np.ndarray     # float32 XYXY, already converted and checked
    difficult: bool
    where: str


@dataclass
class _Image:
    image_id: int
    path: str
    height: int
    width: int
    objects: list[_Object]


def _text(node: ET.Element, tag: str) -> str:
    return (node.findtext(tag) or "").strip()


def _annotation(xml_path: str, stem: str, root: str, policy: BadDataPolicy) -> tuple[ET.Element, str] | None:
    """One image's parsed annotation and the path of its image file; None when it was skipped.

    A missing or broken XML file only loses that image, so it follows the policy (unlike a broken
    COCO file, which loses the whole dataset and always raises)."""
    if not os.path.isfile(xml_path):
        policy.bad("missing annotation", f"annotation file {xml_path} does not exist ({LAYOUT})")
        return None
    try:
        tree = ET.parse(xml_path).getroot()
    except ET.ParseError as err:
        policy.bad("unreadable annotation", f"annotation file {xml_path} is not valid XML: {err}")
        return None
    name = _text(tree, "filename") or f"{stem}.jpg"
    if leaves_its_directory(name):
        policy.bad(OUTSIDE, f"annotation file {xml_path}: <filename> {name!r} is outside {root}/JPEGImages (an "
                            f"absolute path or a '..' step; expected a file name in it)")
        return None
    return tree, os.path.join(root, "JPEGImages", name)


def _parse(xml_path: str, image_id: int, tree: ET.Element, path: str, probe: Probe,
           policy: BadDataPolicy) -> _Image | None:
    """One image's annotation, with its image file checked (``probe``); None when it was skipped."""
    size, reason, message = probe
    if size is None:
        policy.bad(reason, f"{message} (annotation {xml_path})")
        return None
    height, width = size
    try:  # <size> is optional; 0 is what some tools write when they do not know it
        declared = (int(float(_text(tree, "size/height") or 0)), int(float(_text(tree, "size/width") or 0)))
    except ValueError:
        declared = (0, 0)
    if declared[0] and declared[1] and declared != (height, width):
        policy.bad("image size mismatch", f"image file {path}: {xml_path} says {declared[1]}x{declared[0]} "
                                          f"(WxH), the file is {size_text(path, width, height)}")
        return None
    objects = []
    for k, obj in enumerate(tree.findall("object"), 1):
        where = f"{xml_path} object {k}"
        name = _text(obj, "name")
        try:
            xmin, ymin, xmax, ymax = (float(_text(obj, f"bndbox/{t}")) for t in ("xmin", "ymin", "xmax", "ymax"))
        except ValueError:
            policy.bad("malformed annotation", f"{where} ({name!r}): bndbox needs numeric xmin, ymin, xmax, ymax")
            continue
        if not name:
            policy.bad("malformed annotation", f"{where}: object has no <name>")
            continue
        box = np.array([xmin - 1, ymin - 1, xmax, ymax], dtype=np.float32)  # 1-based inclusive -> XYXY
        if check_box(policy, box, width, height, where):
            objects.append(_Object(k, name, box, _text(obj, "difficult") in ("1", "true"), where))
    return _Image(image_id, path, height, width, objects)


def _name_files(parsed: list[_Image], xml_of: list[str]) -> dict[str, list[str]]:
    """Each object name and the annotation files that use it, in split order."""
    files: dict[str, list[str]] = {}
    for image in parsed:
        for name in dict.fromkeys(o.name for o in image.objects):
            files.setdefault(name, []).append(xml_of[image.image_id - 1])
    return files


def read_voc(root: str, split: str, *, on_bad_annotation: str = "error", on_bad_image: str | None = None,
             class_names: list[str] | None = None, limit: int | None = None,
             check_images: str = "changed") -> DetectionDataset:
    """Read one VOC split. Image ids are 1-based positions in the split file; ``limit`` keeps the
    first N images that survive the checks; ``difficult`` flags go to ``ImageRecord.difficult``;
    ``check_images``: ``data.check_images`` (``image_check.inspect_images``)."""
    split_file = os.path.join(root, "ImageSets", "Main", f"{split}.txt")
    policy = BadDataPolicy(on_bad_annotation, split_file, on_bad_image)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"VOC root {root} does not exist; {LAYOUT}")
    if not os.path.isfile(split_file):
        raise FileNotFoundError(f"VOC split file {split_file} does not exist; {LAYOUT}")
    with open(split_file, encoding="utf-8") as f:
        stems = [line.split()[0] for line in f if line.strip()]

    xml_of = [os.path.join(root, "Annotations", f"{stem}.xml") for stem in stems]
    annotated: list[tuple[int, ET.Element, str]] = []  # (image id, annotation, image path)
    for image_id, stem in enumerate(stems, 1):
        if leaves_its_directory(stem):
            policy.bad(OUTSIDE, f"line {image_id}: image id {stem!r} is outside {root} (an absolute path or a '..' "
                                f"step; expected a name in Annotations/ and JPEGImages/)")
            continue
        found = _annotation(xml_of[image_id - 1], stem, root, policy)
        if found is not None:
            annotated.append((image_id, *found))
    parsed: list[_Image] = []
    probes = probe_images([path for _, _, path in annotated], check=check_images)  # lazy: limit stops it
    for (image_id, tree, path), probe in zip(annotated, probes):
        if limit is not None and len(parsed) >= limit:
            break
        image = _parse(xml_of[image_id - 1], image_id, tree, path, probe, policy)
        if image is not None:
            parsed.append(image)
    policy.raise_unreadable()

    if class_names is None:
        files = _name_files(parsed, xml_of)
        warn_spelled_alike(split_file, [(name, listed(f, 3)) for name, f in sorted(files.items())])
        class_names = sorted(files)
        if not class_names:
            raise BadAnnotationError(f"{split_file}: no objects in this split to take class names from; "
                                     f"pass class_names")
    label_of = {name: label for label, name in enumerate(class_names)}
    records: list[ImageRecord] = []
    for image in parsed:
        kept = []
        for o in image.objects:
            if o.name in label_of:
                kept.append(o)
            else:
                policy.bad("unknown category", f"{o.where}: unknown category {o.name!r}"
                                               f"{alike_in(o.name, class_names)} (known: {', '.join(class_names)})")
        records.append(ImageRecord(
            path=image.path, image_id=image.image_id, height=image.height, width=image.width,
            boxes=np.array([o.box for o in kept], dtype=np.float32).reshape(-1, 4),
            labels=np.array([label_of[o.name] for o in kept], dtype=np.int64),
            ann_ids=np.array([o.index for o in kept], np.int64),
            difficult=np.array([o.difficult for o in kept], dtype=bool)))
    return DetectionDataset(records, list(class_names), list(range(1, len(class_names) + 1)),
                            source=split_file, policy=policy)
