"""The samples of any data the project reads, as ``visiontrain shard`` writes them: each image's
encoded bytes as they were, its labels and where it came from.

The splits are read by the readers training uses, with their checks, limits and bad-data policies
(``data.on_bad_image``, ``data.on_bad_annotation``, ``data.limit_*``), so a shard holds what a run
on the same ``data`` section would train on, in the reader's order. Detection labels are the
reader's: XYXY boxes in absolute pixels of the upright image (its EXIF orientation applied, as
the annotation tools drew them), contiguous labels, and the image's id, size and file; with
``masks`` each object's compressed RLE and crowd flag too. The in-memory sets (fashion-mnist, digits)
have no files: their uint8 pixels are written as PNG.

What a task trains on beyond the image goes in one way for every kind (``RawSample``): what is
small, or needed before the first step, in the sample's JSON, which the split's samples file collects
(``samples``: each object's mask as compressed RLE and crowd flag, an image's id and size); what is
per pixel in a member of the sample named ``KEY.ROLE.png`` (``RawSample.extra``;
``layout.LABEL_MAP_MEMBER``, ``PANOPTIC_MEMBER``), read with the image when the sample is loaded:

- semantic: the label map as the reader gives it to the task (``SemanticDataset.label_map``: each
  source's values already mapped to classes, by ``reduce_zero_label`` or Cityscapes' id table, or
  fashion-mosaic's painted from its masks), the ignore index written as 255, in a grey PNG
  (lossless). The mapped map rather than the raw file and its mapping: a run from shards then needs
  no key of the source (``data.reduce_zero_label``, ``data.label_kind``, ``data.ignore_index``),
  and the task, its checkpoint's ``predict`` and ``export`` know the ignore index without the shards
  (255, MMSeg's: any source's ignore index is at least its class count and at most 255, so moving it
  to 255 never meets a class);
- panoptic: the id PNG as the file was (COCO's format is already lossless and self-contained with
  its ``segments_info``, which goes in the JSON), checked against each other when loaded, as from
  the files.
"""
from __future__ import annotations

import dataclasses
import io
import os
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from visiontrain.data.datasets.classification import digits_split
from visiontrain.data.datasets.fashion_mnist import CLASS_NAMES, load_fashion_mnist
from visiontrain.data.datasets.sources import DigitsDataConfig, ImageFolderDataConfig, reader_args
from visiontrain.data.detection.sources import DetectionDataConfig
from visiontrain.data.section import DataConfig
from visiontrain.data.segmentation.sources import IGNORE_INDEX, LabelMapDataConfig, PanopticDataConfig, ignore_index
from visiontrain.data.shards.layout import LABEL_MAP_MEMBER, PANOPTIC_MEMBER


class RawSample(NamedTuple):
    """One sample as a shard holds it: its image file's ``ext`` and bytes, its ``labels`` (the JSON
    member) and the label files its kind adds (``extra``: ``(("seg.png", bytes),)``, the module docstring)."""

    ext: str
    image: bytes
    labels: dict[str, Any]
    extra: tuple[tuple[str, bytes], ...] = ()


@dataclass
class RawSplit:
    """One split: ``count`` samples; ``source(i)`` names sample i (its file), ``load(i)`` gives its
    ``RawSample`` and raises ValueError naming the sample if it cannot."""

    name: str
    count: int
    source: Callable[[int], str]
    load: Callable[[int], RawSample]


@dataclass
class RawData:
    kind: str                                   # classification | detection | semantic | panoptic
    class_names: list[str]
    splits: list[RawSplit]
    category_ids: list[int] | None = None       # detection: the source's category id of each label
    pixel_max: int = 255                        # the white of an in-memory set's pixels (digits: 16)
    index_keys: dict[str, Any] = dataclasses.field(default_factory=dict)  # what else the index says of the kind


def file_bytes(split: str, position: int, path: str, what: str = "image file") -> tuple[str, bytes]:
    """(extension, bytes) of a file of a sample (``what``: its image file, its id PNG ...), or a
    ValueError naming the sample and the file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise ValueError(f"{split} sample {position}: {what} {path} cannot be read: "
                         f"{err.strerror or err}") from None
    return os.path.splitext(path)[1].lstrip(".").lower() or "img", data


def png_bytes(pixels: np.ndarray) -> bytes:
    """uint8 [H, W] or [C, H, W] pixels as a PNG file, losslessly."""
    from PIL import Image

    array = np.asarray(pixels, dtype=np.uint8)
    image = Image.fromarray(array[0] if array.ndim == 3 and array.shape[0] == 1 else
                            array.transpose(1, 2, 0) if array.ndim == 3 else array)
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


#: The splits `visiontrain shard` can write, by role: each is the source's ``data.<role>_split``.
ROLES = ("train", "val", "test")


def raw_data(data: DataConfig, roles: Sequence[str] | None = None, *, masks: bool = False,
             labels: str | None = None) -> tuple[RawData, list[str]]:
    """The splits of ``data`` that ``roles`` names (train, val, test: its ``train_split``,
    ``val_split``, ``test_split``) as samples, and lines to tell the user. ``roles`` None: train and
    val, and test where the source has that split (fashion-mnist and digits have none). ``masks``
    (detection): read each object's mask too, as a task that trains on masks reads them, and give
    them in the labels (``masks``: compressed RLE counts, ``crowd``: COCO's crowd flags). ``labels``:
    ``semantic`` or ``panoptic`` to write what a task of that family reads (fashion-mosaic has boxes,
    label maps and panoptic PNGs); None, the source's own (a label map source's: ``semantic``)."""
    asked = list(roles) if roles is not None else list(ROLES)
    if "train" not in asked or any(r not in ROLES for r in asked):
        raise ValueError(f"--splits {','.join(asked)}: expected train and any of val and test, comma-separated")
    lines: list[str] = []
    optional = lines if roles is None else None  # the test split where the source has one: said if not
    if labels is None:
        labels = "semantic" if isinstance(data, LabelMapDataConfig) else \
            "panoptic" if isinstance(data, PanopticDataConfig) else None
    if labels == "semantic":
        return _semantic(data, asked, optional), lines
    if labels == "panoptic":
        return _panoptic(data, asked, optional), lines
    if isinstance(data, DetectionDataConfig):
        return _detection(data, asked, optional, masks), lines
    if isinstance(data, ImageFolderDataConfig):
        return _image_folder(data, asked, optional), lines
    if isinstance(data, DigitsDataConfig):
        if "test" in asked and roles is not None:
            raise ValueError(f"--splits test: {data.name} has two fixed splits, train and val, and no test split")
        return _in_memory(data, [r for r in asked if r != "test"]), lines
    raise ValueError(f"data.name={data.name}: `visiontrain shard` reads the image folder, detection, segmentation and "
                     f"in-memory sources; this one it cannot read")


def _with_test(data: Any, roles: list[str], read: Callable[[Any], tuple[Any, Any]],
               optional: list[str] | None) -> dict[str, Any]:
    """{role: dataset} of ``roles``: ``read(data)`` gives (train, val); the test split is read as the
    val split of ``data`` with ``val_split`` set to ``test_split`` (the same checks, classes and order).
    ``optional``: a test split the source lacks is left out, with a line appended here."""
    train, val = read(data)
    sets = {"train": train, "val": val}
    if "test" in roles:
        try:
            sets["test"] = read(dataclasses.replace(data, val_split=data.test_split))[1]
        except FileNotFoundError as err:
            if optional is None:
                raise
            optional.append(f"no test split written: {err} (data.test_split={data.test_split}; "
                            f"--splits train,val says so)")
    return {role: sets[role] for role in roles if role in sets}


def _detection(data: DetectionDataConfig, roles: list[str], optional: list[str] | None, masks: bool) -> RawData:
    from visiontrain.data.detection.splits import build_detection_splits

    def read(d: DetectionDataConfig) -> tuple[Any, Any]:
        return build_detection_splits(d, masks=masks)

    sets = _with_test(dataclasses.replace(data, cache="none"), roles, read, optional)  # bytes
    train = sets["train"]
    splits = []
    for name, ds in ((getattr(data, f"{role}_split"), ds) for role, ds in sets.items()):
        def load(i: int, ds=ds, name=name) -> RawSample:
            r = ds.records[i]
            ext, image = file_bytes(name, i, r.path)
            labels = {"image_id": r.image_id, "height": r.height, "width": r.width, "boxes": r.boxes.tolist(),
                      "labels": r.labels.tolist(), "ann_ids": r.ann_ids.tolist(), "source": r.path}
            if r.difficult is not None:  # Pascal VOC's flags, which its evaluation reads
                labels["difficult"] = r.difficult.tolist()
            if r.masks is not None:
                labels["masks"] = list(r.masks)
            if r.crowd is not None:  # read with the masks (COCO's crowd regions; a YOLO source has none)
                labels["crowd"] = r.crowd.tolist()
            return RawSample(ext, image, labels)
        splits.append(RawSplit(name, len(ds), ds.records.paths.__getitem__, load))
    return RawData("detection", list(train.class_names), splits, category_ids=list(train.category_ids))


def _image_folder(data: ImageFolderDataConfig, roles: list[str], optional: list[str] | None) -> RawData:
    from visiontrain.data.datasets.image_folder import build_image_folder

    def read(d: ImageFolderDataConfig) -> tuple[Any, Any]:
        return build_image_folder(dataclasses.replace(reader_args(d), augment="none", uint8_train=False))[:2]

    sets = _with_test(data, roles, read, optional)
    classes = sets["train"].classes
    splits = []
    for name, ds in ((getattr(data, f"{role}_split"), ds) for role, ds in sets.items()):
        ds.check_files(data.image_policy(), data.max_skipped_share)

        def load(i: int, ds=ds, name=name) -> RawSample:
            path, label = ds.samples[i]
            ext, image = file_bytes(name, i, path)
            return RawSample(ext, image, {"label": label, "source": path})
        splits.append(RawSplit(name, len(ds), ds.samples.paths.__getitem__, load))
    return RawData("classification", list(classes), splits)


def _in_memory(data: DigitsDataConfig, roles: list[str]) -> RawData:
    if data.name == "fashion-mnist":
        (tx, ty), (vx, vy) = load_fashion_mnist(getattr(data, "root", None), getattr(data, "download", False))
        arrays, classes, white = ((tx.numpy(), ty.numpy()), (vx.numpy(), vy.numpy())), list(CLASS_NAMES), 255
    else:
        a, b, c, d = digits_split()
        arrays, classes, white = ((a, b), (c, d)), [str(i) for i in range(10)], 16
    splits = []
    for name, (images, labels), limit in zip(("train", "val"), arrays, (data.limit_train, data.limit_val)):
        if name not in roles:
            continue
        count = len(labels) if limit is None else min(limit, len(labels))  # the first N, as training takes

        def load(i: int, images=images, labels=labels, name=name) -> RawSample:
            labels_i = {"label": int(labels[i]), "source": f"{data.name} {name} #{i}"}
            return RawSample("png", png_bytes(images[i]), labels_i)
        splits.append(RawSplit(name, count, lambda i, name=name: f"{data.name} {name} #{i}", load))
    return RawData("classification", classes, splits, pixel_max=white)


def _without_cache(data: DataConfig) -> DataConfig:
    """``data`` with no decoded-image cache (``data.cache``, where the source has one): a write reads bytes."""
    return dataclasses.replace(data, cache="none") if isinstance(data, DetectionDataConfig) else data


def _semantic(data: DataConfig, roles: list[str], optional: list[str] | None) -> RawData:
    """Label maps (module docstring): the image file as it was and the reader's label map as a PNG."""
    from visiontrain.data.segmentation.readers import build_semantic_splits

    ignore = ignore_index(data)
    sets = _with_test(_without_cache(data), roles, build_semantic_splits, optional)
    splits = []
    for name, ds in ((getattr(data, f"{role}_split"), ds) for role, ds in sets.items()):
        def load(i: int, ds=ds, name=name) -> RawSample:
            path = ds.image_file(i)
            ext, image = file_bytes(name, i, path)
            classes = ds.label_map(i)
            classes[classes == ignore] = IGNORE_INDEX
            labels = {"height": int(classes.shape[0]), "width": int(classes.shape[1]), "source": path}
            return RawSample(ext, image, labels, ((LABEL_MAP_MEMBER, png_bytes(classes)),))
        splits.append(RawSplit(name, len(ds), ds.image_file, load))
    return RawData("semantic", list(sets["train"].class_names), splits, index_keys={"ignore_index": IGNORE_INDEX})


def _panoptic(data: DataConfig, roles: list[str], optional: list[str] | None) -> RawData:
    """COCO panoptic samples (module docstring): the image and the id PNG as they were, the record's
    id, size and segments_info in the JSON."""
    from visiontrain.data.segmentation.panoptic import build_panoptic_splits

    sets = _with_test(_without_cache(data), roles, build_panoptic_splits, optional)
    splits = []
    for name, ds in ((getattr(data, f"{role}_split"), ds) for role, ds in sets.items()):
        def load(i: int, ds=ds, name=name) -> RawSample:
            r = ds.records[i]
            ext, image = file_bytes(name, i, r.image)
            _, png = file_bytes(name, i, r.png, "id PNG")
            segments = [{"id": s.id, "category_id": s.category_id, "iscrowd": int(s.iscrowd),
                         **({} if s.area is None else {"area": s.area})} for s in r.segments]
            labels = {"image_id": r.image_id, "height": r.height, "width": r.width, "segments_info": segments,
                      "source": r.image, "png_source": r.png}
            return RawSample(ext, image, labels, ((PANOPTIC_MEMBER, png),))
        splits.append(RawSplit(name, len(ds), lambda i, ds=ds: ds.records[i].image, load))
    categories = sets["train"].categories
    return RawData("panoptic", categories.thing_names, splits,
                   index_keys={"categories": [dict(c) for c in categories.raw]})
