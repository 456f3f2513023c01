"""A detection split's annotations: ``ImageRecord`` as a reader makes it, ``RecordIndex`` as a dataset keeps it.

A reader builds one ``ImageRecord`` an image while it checks the annotations; the dataset then packs
them into a ``RecordIndex``: a handful of numpy buffers (per-image ids and sizes, every box of the
split in one array with each image's offsets, the paths in one byte buffer). It reads as the list of
records it was made from, but a DataLoader worker's copy of it is the size of its numbers, not of
a million Python objects, and a forked worker never writes to its pages (``visiontrain.data.packed``).
At COCO's size (118,287 images, about 860,000 boxes) the buffers are 32 MiB, against 340 MiB of
records, and they lie in one file every worker maps (``visiontrain.data.shared_arrays``): a
forkserver or spawned worker is sent its path, a few hundred bytes, not the 32 MiB.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from visiontrain.data.packed import PackedStrings, offsets_of, position
from visiontrain.data.shared_arrays import share_arrays

__all__ = ["ImageRecord", "RecordIndex"]


@dataclass
class ImageRecord:
    path: str                                  # image file
    image_id: int
    height: int
    width: int
    boxes: np.ndarray                          # float32 [N, 4], XYXY absolute pixels
    labels: np.ndarray                         # int64 [N], contiguous 0..C-1
    ann_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # int64 [N]: each box's annotation in its source (COCO id, YOLO line, VOC object index); -1: none
    difficult: np.ndarray | None = None        # bool [N] (VOC's flag; None = none difficult)
    masks: list[str] | None = None             # [N] compressed COCO RLE at (height, width); None = no masks read
    crowd: np.ndarray | None = None            # bool [N] COCO's iscrowd regions (None = none): scored as
    #                                            ignore regions, never trained on (kept only where masks are read)


def annotation_ids(ids: Sequence[object]) -> np.ndarray:
    """A source's annotation ids as ``ImageRecord.ann_ids``: int64, -1 where an id is not an integer."""
    return np.array([i if isinstance(i, (int, np.integer)) and not isinstance(i, bool) else -1 for i in ids],
                    dtype=np.int64)


def _flags(flags: list[np.ndarray | None], counts: list[int]) -> np.ndarray | None:
    """One bool a box from per-record flags, or None where no record has any (none is set)."""
    if all(f is None for f in flags):
        return None
    return np.concatenate([np.zeros(0, bool), *(np.zeros(n, bool) if f is None else f.reshape(-1)
                                                for f, n in zip(flags, counts))]).astype(bool, copy=False)


NUMBERS = ("image_ids", "heights", "widths", "box_starts", "boxes", "labels", "ann_ids", "difficult", "crowd")


class RecordIndex(Sequence[ImageRecord]):
    """The records of a split packed into numpy buffers (this module's docstring). ``index[i]`` is
    the i-th record, its arrays copies (a transform cannot write into the index); the buffers are
    public for whole-split statistics: ``boxes`` [M, 4], ``labels`` [M], ``ann_ids`` [M],
    ``difficult`` [M] or None, ``crowd`` [M] or None, ``masks`` (M compressed RLE strings) or None,
    ``box_starts`` [N + 1], ``image_ids``, ``heights``, ``widths`` [N]."""

    def __init__(self, records: Sequence[ImageRecord]) -> None:
        self.paths = PackedStrings(r.path for r in records)
        self.image_ids = np.array([r.image_id for r in records], dtype=np.int64)
        self.heights = np.array([r.height for r in records], dtype=np.int64)
        self.widths = np.array([r.width for r in records], dtype=np.int64)
        self.box_starts = offsets_of([len(r.labels.reshape(-1)) for r in records])
        self.boxes = np.concatenate([np.zeros((0, 4), np.float32), *(r.boxes.reshape(-1, 4) for r in records)])
        self.boxes = self.boxes.astype(np.float32, copy=False)
        self.labels = np.concatenate([np.zeros(0, np.int64), *(r.labels.reshape(-1) for r in records)])
        self.labels = self.labels.astype(np.int64, copy=False)
        self.ann_ids = np.concatenate([np.zeros(0, np.int64), *(r.ann_ids.reshape(-1) for r in records)])
        self.ann_ids = self.ann_ids.astype(np.int64, copy=False)
        # VOC flags every box; where no record has flags, none is difficult and none is stored
        self.difficult = _flags([r.difficult for r in records], [len(r.labels) for r in records])
        self.crowd = _flags([r.crowd for r in records], [len(r.labels) for r in records])
        # one compressed RLE a box where the reader read masks (every record, or none)
        self.masks = None if any(r.masks is None for r in records) or not len(records) else PackedStrings(
            m for r in records for m in r.masks)
        self._share()

    def saved(self) -> dict[str, np.ndarray]:
        """Every buffer by name (the paths' and masks' prefixes too): what ``restored`` makes this
        index again from, so that it can be kept on disk between runs (``detection.record_cache``)."""
        strings = {"paths": self.paths, **({} if self.masks is None else {"masks": self.masks})}
        return {**{k: getattr(self, k) for k in NUMBERS if getattr(self, k) is not None},
                **{key: a for name, s in strings.items() for key, a in s.saved(name).items()}}

    @classmethod
    def restored(cls, arrays: Mapping[str, np.ndarray]) -> RecordIndex:
        """The index ``saved()`` was taken from, shared as a new one is (``_share``). ValueError (or
        KeyError, for a buffer that is not there) where the buffers do not fit together: a copy on
        disk is checked, not trusted."""
        index = cls.__new__(cls)
        for k in NUMBERS:
            setattr(index, k, arrays.get(k))
        index.paths = PackedStrings.restored(arrays, "paths")
        index.masks = PackedStrings.restored(arrays, "masks") if "masks.data" in arrays else None
        index._check()
        index._share()
        return index

    def _check(self) -> None:
        """ValueError unless every buffer has the dtype and length its role gives it (N images, M boxes)."""
        n, m = len(self.image_ids), len(self.labels)
        expected = {"image_ids": ("<i8", (n,)), "heights": ("<i8", (n,)), "widths": ("<i8", (n,)),
                    "box_starts": ("<i8", (n + 1,)), "boxes": ("<f4", (m, 4)), "labels": ("<i8", (m,)),
                    "ann_ids": ("<i8", (m,)), "difficult": ("|b1", (m,)), "crowd": ("|b1", (m,))}
        for k, (dtype, shape) in expected.items():
            a = getattr(self, k)
            if a is None and k in ("difficult", "crowd"):
                continue  # no box flagged
            if a is None or a.dtype.str != dtype or a.shape != shape:
                raise ValueError(f"record index: {k} is not {dtype} {shape}")
        starts = self.box_starts
        if starts[0] != 0 or starts[-1] != m or (np.diff(starts) < 0).any():
            raise ValueError("record index: box_starts do not run from 0 to the number of boxes")
        if len(self.paths) != n or (self.masks is not None and len(self.masks) != m):
            raise ValueError("record index: a path an image and a mask a box expected")

    def _share(self) -> None:
        """Every buffer, the paths' and masks' too, into one ``share_arrays`` (a mapped file past its
        threshold), read from there on: what a worker is then sent is the file's path, not the bytes."""
        names = [k for k in NUMBERS if getattr(self, k) is not None]
        strings = {"paths": self.paths, **({} if self.masks is None else {"masks": self.masks})}
        shared = share_arrays({**{k: getattr(self, k) for k in names},
                               **{key: a for name, s in strings.items() for key, a in s.buffers(name).items()}})
        for k in names:
            setattr(self, k, shared[k])
        for name, packed in strings.items():
            packed.adopt(shared, name)

    def __len__(self) -> int:
        return len(self.image_ids)

    def __getitem__(self, index: int | slice) -> ImageRecord | list[ImageRecord]:  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = position(index, len(self))
        a, b = self.box_starts[i], self.box_starts[i + 1]
        return ImageRecord(path=self.paths[i], image_id=int(self.image_ids[i]), height=int(self.heights[i]),
                           width=int(self.widths[i]), boxes=self.boxes[a:b].copy(), labels=self.labels[a:b].copy(),
                           ann_ids=self.ann_ids[a:b].copy(),
                           difficult=None if self.difficult is None else self.difficult[a:b].copy(),
                           masks=None if self.masks is None else [self.masks[k] for k in range(a, b)],
                           crowd=None if self.crowd is None else self.crowd[a:b].copy())

    def __iter__(self) -> Iterator[ImageRecord]:
        return (self[i] for i in range(len(self)))

    @property
    def num_boxes(self) -> int:
        return len(self.labels)

    @property
    def box_sizes(self) -> np.ndarray:
        """int64 [M, 2]: the (height, width) of the image each box is in."""
        counts = np.diff(self.box_starts)
        return np.stack([np.repeat(self.heights, counts), np.repeat(self.widths, counts)], 1).reshape(-1, 2)

    @property
    def nbytes(self) -> int:
        """What the index holds, in bytes (a worker's copy of it)."""
        arrays = [getattr(self, k) for k in NUMBERS]
        return (self.paths.nbytes + sum(a.nbytes for a in arrays if a is not None)
                + (0 if self.masks is None else self.masks.nbytes))
