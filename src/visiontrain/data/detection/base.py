"""What every detection reader produces, and the dataset every detector trains on.

A reader (COCO JSON, Pascal VOC XML, YOLO txt) turns annotation files into ``ImageRecord``s, which
the dataset keeps packed as a ``RecordIndex`` (``visiontrain.data.detection.record_index``: a few
numpy buffers, so each DataLoader worker's copy is small and a forked one stays shared); images
are decoded only when a sample is loaded. A sample is

    image:  tv_tensors.Image, uint8 [3, H, W]
    target: {"boxes": tv_tensors.BoundingBoxes (XYXY, absolute pixels, canvas_size=(H, W)),
             "labels": int64 [N] (contiguous 0..num_classes-1),
             "image_id": int, "orig_size": int64 tensor [2] = (H, W) of the file,
             "masks": tv_tensors.Mask uint8 [N, H, W], only where the reader read masks}

before transforms. Class names and their count come from the data; ``category_ids[label]`` is the
original category id, used to write COCO-format results. With an ``ImageCache`` (``data.cache=ram``,
``visiontrain.data.image_cache``) an image is decoded once per run and read back from the cache
after that, as the same tensor; transforms run after it, so augmentation is unchanged.

Bad data follows ``on_bad_annotation``: ``error`` raises ``BadAnnotationError`` naming the file
and the annotation id; ``skip`` drops the annotation (or the whole image, when its annotation file is
unusable) and counts it in ``skipped`` by reason. An image file that is missing or cannot be read
follows ``on_bad_image`` (``data.on_bad_image``, by default the same): the readers open every file
up front (``visiontrain.data.image_check``) and under ``error`` name all such files in one error,
with their count, once the split is read (``raise_unreadable``). An image with no boxes is a valid
negative.
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from visiontrain.core._tv_compat import ensure_torchvision
from visiontrain.data.bad_data import check_skipped_share, listed
from visiontrain.data.detection import masks
from visiontrain.data.detection.images import BadAnnotationError, read_rgb
from visiontrain.data.detection.record_index import ImageRecord, RecordIndex
from visiontrain.data.image_cache import ImageCache
from visiontrain.data.image_check import problem_kind

__all__ = ["BAD_POLICIES", "BadAnnotationError", "DetectionDataset", "ImageRecord", "RecordIndex"]

BAD_POLICIES = ("error", "skip")
IMAGE_FILE_REASONS = ("missing image", "unreadable image")  # data.on_bad_image's
#: An annotation's file name that leaves its directory (data.on_bad_annotation's: the file is never opened).
OUTSIDE = "image outside its directory"
#: What loses a whole image (the rest lose one box): the two shares data.max_skipped_share bounds.
IMAGE_REASONS = (*IMAGE_FILE_REASONS, "image size mismatch", "missing annotation", "unreadable annotation",
                 OUTSIDE)


class BadDataPolicy:
    """Applies ``error | skip`` and counts what was skipped, by reason; ``image_policy`` (default:
    ``policy``) is what an image file that is missing or cannot be read does."""

    def __init__(self, policy: str, source: str, image_policy: str | None = None) -> None:
        image_policy = image_policy or policy
        for key, value in (("data.on_bad_annotation", policy), ("data.on_bad_image", image_policy)):
            if value not in BAD_POLICIES:
                raise ValueError(f"{key}: expected one of {', '.join(BAD_POLICIES)}, got {value!r}")
        self.policy, self.image_policy, self.source = policy, image_policy, source
        self.skipped: Counter[str] = Counter()
        self.causes: Counter[tuple[str, str]] = Counter()  # (images | boxes, likely cause) -> count
        self.unreadable: list[str] = []  # the messages of the image files that cannot be read

    def bad(self, reason: str, message: str) -> None:
        """Raise under ``error``; count under ``skip``. ``message`` names the file and annotation.
        An image file that cannot be read is kept for ``raise_unreadable`` instead of raising."""
        if reason in IMAGE_FILE_REASONS:
            self.unreadable.append(message)
            self.note("images", problem_kind(message))
            if self.image_policy == "skip":
                self.skipped[reason] += 1
            return
        if self.policy == "error":
            raise BadAnnotationError(f"{self.source}: {message} (set data.on_bad_annotation=skip to drop it)")
        self.skipped[reason] += 1

    def note(self, unit: str, cause: str, count: int = 1) -> None:
        """A likely cause of what was skipped (``unit``: images or boxes), for the error when a split
        loses more than data.max_skipped_share (``visiontrain.data.bad_data``)."""
        if count > 0:
            self.causes[unit, cause] += count

    def counts(self) -> dict[str, Any]:
        """What this policy has counted, as JSON: kept with a split's records between runs
        (``detection.record_cache``), so that a re-run skips and reports as the first run did."""
        return {"skipped": dict(self.skipped), "causes": [[unit, cause, n] for (unit, cause), n in self.causes.items()],
                "unreadable": list(self.unreadable)}

    def add_counts(self, counts: dict[str, Any]) -> None:
        """Count what ``counts()`` gave as if the split had been read here; all of it or, where
        ``counts`` is not of that shape (TypeError, ValueError, KeyError, AttributeError), nothing."""
        skipped = {str(reason): int(n) for reason, n in counts["skipped"].items()}
        causes = {(str(unit), str(cause)): int(n) for unit, cause, n in counts["causes"]}
        unreadable = [str(message) for message in counts["unreadable"]]
        self.skipped.update(skipped)
        self.causes.update(causes)
        self.unreadable.extend(unreadable)

    def raise_unreadable(self) -> None:
        """Under ``error``: every image file of the split that cannot be read, in one error (a reader
        calls it once the split is read, so the count is the split's)."""
        if self.unreadable and self.image_policy == "error":
            n = len(self.unreadable)
            raise BadAnnotationError(f"{self.source}: {n:,} image file{'s' if n > 1 else ''} cannot be read: "
                                     f"{listed(self.unreadable, sep='; ')} (set data.on_bad_image=skip to drop "
                                     f"{'them' if n > 1 else 'it'})")

    def finish_split(self, kept: int, max_share: float) -> None:
        """Once a split of files is read with its ``kept`` usable images: the unreadable files raised
        (under error), the share skipped checked against data.max_skipped_share, a split with
        nothing usable refused."""
        self.raise_unreadable()
        skipped = sum(self.skipped.values())
        check_skipped_share(self.source, "images are bad data", skipped, kept + skipped, max_share,
                            {cause: n for (_, cause), n in self.causes.items()},
                            ", ".join(f"{n} {reason}" for reason, n in sorted(self.skipped.items())))
        if not kept:
            raise ValueError(f"{self.source}: no usable image (data.train_split / data.val_split name the splits)")

    def load_or_next(self, load: Callable[[int], Any], index: int, count: int,
                     key: Callable[[BadAnnotationError], str] = lambda err: "on_bad_image") -> Any:
        """``load(index)``; a sample found bad only when loaded in full (the readers opened every file
        up front) is raised under ``error`` and under ``skip`` replaced by the next one (deterministic,
        so exact resume holds) with a warning naming the file. ``key(err)``: the data key whose policy
        applies (``on_bad_image`` by default)."""
        for offset in range(count):
            try:
                return load((index + offset) % count)
            except BadAnnotationError as err:
                name = key(err)
                if (self.image_policy if name == "on_bad_image" else self.policy) == "error":
                    raise BadAnnotationError(f"{self.source}: {err} (set data.{name}=skip to drop it)") from None
                logging.getLogger("visiontrain").warning("skipping %s", err)
        raise BadAnnotationError(f"{self.source}: no image of this split can be loaded")


def check_box(policy: BadDataPolicy, box: np.ndarray, width: int, height: int, where: str) -> bool:
    """True if an XYXY box is usable. Degenerate (x2 <= x1 or y2 <= y1) and out-of-image boxes are
    bad data; a box that only grazes the border by rounding (up to 1 px) is clipped, not rejected."""
    x1, y1, x2, y2 = (float(v) for v in box)
    if not np.isfinite([x1, y1, x2, y2]).all() or x2 <= x1 or y2 <= y1:
        policy.bad("degenerate box", f"{where}: degenerate box {[x1, y1, x2, y2]} (needs x2 > x1 and y2 > y1)")
        return False
    if x1 < -1 or y1 < -1 or x2 > width + 1 or y2 > height + 1:
        policy.bad("box outside image", f"{where}: box {[x1, y1, x2, y2]} is outside the "
                                        f"{width}x{height} image")
        return False
    box[:] = np.clip(box, 0, [width, height, width, height])
    return True


def training_target(r: ImageRecord) -> dict[str, Any]:
    """A record's target as the transforms take it (the module docstring), with ``masks`` as a
    ``tv_tensors.Mask`` uint8 [N, H, W] where the reader read masks. Crowd regions are left out:
    they are ignore regions of the evaluation, not objects to learn."""
    from torchvision import tv_tensors

    keep = np.ones(len(r.labels), bool) if r.crowd is None else ~r.crowd
    boxes = tv_tensors.BoundingBoxes(torch.as_tensor(r.boxes[keep], dtype=torch.float32).reshape(-1, 4),
                                     format="XYXY", canvas_size=(r.height, r.width))
    target = {"boxes": boxes, "labels": torch.as_tensor(r.labels[keep], dtype=torch.int64).reshape(-1),
              "image_id": r.image_id, "orig_size": torch.tensor([r.height, r.width])}
    if r.masks is not None:
        counts = [m for m, k in zip(r.masks, keep) if k]
        target["masks"] = tv_tensors.Mask(torch.from_numpy(masks.decode(counts, r.height, r.width)))
    return target


class DetectionDataset(Dataset):
    """Records packed in memory, images decoded per sample (or read from ``cache``, where one is
    kept), an optional v2 transform on (image, target)."""

    def __init__(self, records: Sequence[ImageRecord], class_names: list[str], category_ids: list[int], *,
                 source: str, policy: BadDataPolicy,
                 transform: Callable[[Any, dict], tuple[Any, dict]] | None = None,
                 cache: ImageCache | None = None, images: Callable[[int], torch.Tensor] | None = None) -> None:
        self.records = records if isinstance(records, RecordIndex) else RecordIndex(records)
        self.class_names, self.category_ids = class_names, category_ids
        self.source, self.policy, self.transform, self.cache = source, policy, transform, cache
        # images(i): image i decoded, uint8 [3, H, W], for a source without image files (shards); a
        # picklable callable, raising BadAnnotationError naming the image where it cannot be decoded
        self.images = images

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def __len__(self) -> int:
        return len(self.records)

    def aspect_ratios(self) -> list[float]:
        """width / height of every image, from the annotations (no decoding)."""
        return (self.records.widths / self.records.heights).tolist()

    def image_shapes(self) -> np.ndarray:
        """(3, height, width) of every image, from the annotations (no decoding): what a cache holds."""
        return np.stack([np.full(len(self.records), 3), self.records.heights, self.records.widths], 1)

    def with_transform(self, transform: Callable | None) -> "DetectionDataset":
        return DetectionDataset(self.records, self.class_names, self.category_ids, source=self.source,
                                policy=self.policy, transform=transform, cache=self.cache, images=self.images)

    def with_cache(self, cache: ImageCache | None) -> "DetectionDataset":
        """The same images, kept in ``cache`` once decoded (its slots are this dataset's indices)."""
        if cache is not None and len(cache) != len(self.records):
            raise ValueError(f"{self.source}: a cache of {len(cache)} images for {len(self.records)} images")
        return DetectionDataset(self.records, self.class_names, self.category_ids, source=self.source,
                                policy=self.policy, transform=self.transform, cache=cache, images=self.images)

    def load(self, index: int) -> tuple[Any, dict[str, Any]]:
        """The untransformed sample (see the module docstring)."""
        ensure_torchvision()
        from torchvision import tv_tensors

        r = self.records[index]
        image = self.cache.get(index) if self.cache is not None else None
        if image is None:
            # BadAnnotationError naming the file if it cannot be decoded
            image = read_rgb(r.path) if self.images is None else self.images(index)
            if self.cache is not None:
                self.cache.put(index, image)
        h, w = image.shape[-2:]
        if (h, w) != (r.height, r.width):  # the boxes were checked and placed in the header's frame
            raise BadAnnotationError(f"image file {r.path}: decoded as {w}x{h} (WxH), but its header said "
                                     f"{r.width}x{r.height} when the dataset was read (the file changed since?)")
        return tv_tensors.Image(image), training_target(r)

    def __getitem__(self, index: int) -> tuple[Any, dict[str, Any]]:
        image, target = self.policy.load_or_next(self.load, index, len(self.records))
        if self.transform is not None:
            image, target = self.transform(image, target)
        return image, target

    def coco_ground_truth(self) -> dict[str, Any]:
        """This split as a COCO dict (original category ids), for COCO evaluation: with each box's
        ``segmentation`` (compressed RLE) and crowd regions where the reader read masks."""
        images, annotations = [], []
        for r in self.records:
            images.append({"id": r.image_id, "file_name": r.path, "height": r.height, "width": r.width})
            for k, (box, label) in enumerate(zip(r.boxes.reshape(-1, 4), r.labels.reshape(-1))):
                x1, y1, x2, y2 = (float(v) for v in box)
                ann = {"id": len(annotations) + 1, "image_id": r.image_id, "category_id": self.category_ids[int(label)],
                       "bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1),
                       "iscrowd": int(r.crowd is not None and r.crowd[k])}
                if r.masks is not None:  # COCO's area is the mask's
                    ann["segmentation"] = masks.rle_dict(r.masks[k], r.height, r.width)
                    ann["area"] = masks.mask_area(r.masks[k], r.height, r.width)
                annotations.append(ann)
        categories = [{"id": c, "name": n} for c, n in zip(self.category_ids, self.class_names)]
        return {"images": images, "annotations": annotations, "categories": categories}
