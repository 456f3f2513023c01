"""A split's samples file: where each sample lies in its shard, and its labels.

A run reads a sample as one byte range of its shard (``start`` to ``end``: the sample's tar members,
headers included), so it can begin anywhere: a resumed run, a worker's share of an epoch, a
validation batch. It needs no pass over the shards first, which on object storage would mean
downloading them, and the labels a run needs before its first step (the class of every sample for
the k-NN bank, every box for COCO evaluation, every image's size) come from this one file.

``visiontrain shard`` reads each shard's tar headers and ``KEY.json`` members back as soon as it is
written (a sidecar per shard, ``write_shard_scan``) and writes the file from them once the split's
shards are all there: the file says what the shards hold, not what the writer meant to put there.
"""
from __future__ import annotations

import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from visiontrain.data.shards.layout import padded, write_atomically
from visiontrain.data.shared_arrays import share_arrays

PER_BOX = ("boxes", "labels", "ann_ids", "difficult", "crowd", "mask_length")  # detection: one row a box
MASK_BYTES = "mask_bytes"  # every box's compressed RLE (ASCII) end to end, ``mask_length`` bytes each
PER_IMAGE = {"detection": ("image_id", "height", "width"), "semantic": ("height", "width"),
             "panoptic": ("image_id", "height", "width")}  # int64 [N] from each sample's JSON
DETECTION_ARRAYS = (*PER_IMAGE["detection"], "box_start", "boxes", "labels", "ann_ids")
#: The arrays a samples file of each kind has besides the byte ranges (a detection file may add
#: ``difficult``, ``crowd``, ``mask_length`` and ``mask_bytes``).
KIND_ARRAYS = {"classification": ("label",), "detection": DETECTION_ARRAYS, "semantic": PER_IMAGE["semantic"],
               "panoptic": PER_IMAGE["panoptic"]}


def ragged_rows(starts: np.ndarray, items: np.ndarray) -> np.ndarray:
    """The rows of ``items``' runs, in their order: item i owns rows ``starts[i]:starts[i + 1]`` (a
    sample its boxes, a box its mask's bytes). One vectorised pass: a million boxes are no Python loop."""
    items = np.asarray(items, dtype=np.int64)
    first, lengths = starts[items], starts[items + 1] - starts[items]
    before = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return np.arange(int(lengths.sum()), dtype=np.int64) + np.repeat(first - before, lengths)


@dataclass
class SplitSamples:
    """A split's samples: ``shard`` (int32 [N], the shard's number in the split), ``start`` and ``end``
    (int64 [N], the byte range in it) and ``labels``: ``{"label": int64 [N]}`` for classification;
    for detection ``image_id``, ``height``, ``width`` [N], ``box_start`` [N + 1], ``boxes`` float32
    [M, 4] (XYXY pixels), ``labels`` and ``ann_ids`` int64 [M], ``difficult`` bool [M] where the
    source flags boxes (Pascal VOC), and where masks were written ``crowd`` bool [M] (COCO's iscrowd),
    ``mask_length`` int64 [M] and ``mask_bytes`` uint8 (each box's compressed RLE, end to end); for
    semantic ``height``, ``width`` [N]; for panoptic ``image_id``, ``height``, ``width`` [N] (its
    segments_info is in each sample's JSON member, read with its id PNG)."""

    shard: np.ndarray
    start: np.ndarray
    end: np.ndarray
    labels: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.shard)

    def shared(self, **extra: np.ndarray) -> tuple["SplitSamples", dict[str, np.ndarray]]:
        """These samples, and ``extra`` arrays of their reader's, in one ``share_arrays``: at ImageNet's
        size (1.28 M samples, 36 MB) a file every DataLoader worker maps, where each had its own copy."""
        shared = share_arrays({"shard": self.shard, "start": self.start, "end": self.end,
                               **{f"labels.{k}": v for k, v in self.labels.items()},
                               **{f"extra.{k}": v for k, v in extra.items()}})
        labels = {k: shared[f"labels.{k}"] for k in self.labels}
        return (SplitSamples(shared["shard"], shared["start"], shared["end"], labels),
                {k: shared[f"extra.{k}"] for k in extra})

    def first(self, n: int | None) -> "SplitSamples":
        """The first ``n`` samples (``data.limit_*``); all of them where ``n`` is None or larger."""
        if n is None or n >= len(self):
            return self
        return self._rows(np.arange(n, dtype=np.int64))

    def take(self, keep: np.ndarray) -> "SplitSamples":
        """The samples where ``keep`` (bool [N]) is true, in their order."""
        return self._rows(np.flatnonzero(keep))

    def _rows(self, items: np.ndarray) -> "SplitSamples":
        """The samples ``items`` (indices, in order), each with its boxes and their masks' bytes."""
        labels = dict(self.labels)
        if "box_start" in labels:
            starts = labels.pop("box_start")
            boxes = ragged_rows(starts, items)
            if MASK_BYTES in labels:
                mask_starts = np.concatenate([[0], np.cumsum(labels["mask_length"])]).astype(np.int64)
                labels[MASK_BYTES] = labels[MASK_BYTES][ragged_rows(mask_starts, boxes)]
            labels = {k: v[boxes] if k in PER_BOX else v if k == MASK_BYTES else v[items] for k, v in labels.items()}
            counts = starts[items + 1] - starts[items]
            labels["box_start"] = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        else:
            labels = {k: v[items] for k, v in labels.items()}
        return SplitSamples(self.shard[items], self.start[items], self.end[items], labels)


def scan_shard(path: Path, number: int) -> tuple[list[int], list[int], list[dict[str, Any]]]:
    """(starts, ends, labels) of each sample of one shard, from its headers and json members."""
    starts: list[int] = []
    ends: list[int] = []
    labels: list[dict[str, Any]] = []
    current = None
    with tarfile.open(path, mode="r:") as tar:
        for member in tar:  # reads each header and seeks past the data it does not extract
            key, _, ext = member.name.partition(".")
            if key != current:
                starts.append(member.offset)
                ends.append(0)
                labels.append({})
                current = key
            ends[-1] = member.offset_data + padded(member.size)
            if ext == "json":
                labels[-1] = json.loads(tar.extractfile(member).read())
    for key_labels, start in zip(labels, starts):
        if not key_labels:
            raise ValueError(f"{path}: the sample at byte {start} has no .json member (labels); shard {number} "
                             f"was not written by `visiontrain shard`")
    return starts, ends, labels


def _label_arrays(kind: str, labels: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    if kind == "classification":
        return {"label": np.array([s["label"] for s in labels], dtype=np.int64)}
    per_image = {key: np.array([s[key] for s in labels], dtype=np.int64) for key in PER_IMAGE[kind]}
    if kind != "detection":
        return per_image
    counts = [len(s["labels"]) for s in labels]
    arrays = {**per_image, "box_start": np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
              "boxes": np.array([b for s in labels for b in s["boxes"]], dtype=np.float32).reshape(-1, 4),
              "labels": np.array([v for s in labels for v in s["labels"]], dtype=np.int64),
              "ann_ids": np.array([v for s, n in zip(labels, counts) for v in s.get("ann_ids", [-1] * n)],
                                  dtype=np.int64)}
    for key in ("difficult", "crowd"):  # flags a source gives (VOC's difficult; COCO's crowd, with masks)
        if any(key in s for s in labels):
            arrays[key] = np.array([v for s, n in zip(labels, counts) for v in s.get(key, [False] * n)], dtype=bool)
    if any("masks" in s for s in labels):  # every box's RLE, as bytes end to end (a samples file holds no str)
        rles = [m.encode("ascii") for s, n in zip(labels, counts) for m in s.get("masks", [""] * n)]
        arrays["mask_length"] = np.array([len(m) for m in rles], dtype=np.int64)
        arrays[MASK_BYTES] = np.frombuffer(b"".join(rles), dtype=np.uint8).copy()
    return arrays


def shard_sidecar(shard: str) -> str:
    """The file that holds one written shard's scan until its split's samples file is written."""
    return f"{shard}.samples.json"


def write_shard_scan(out: Path, number: int, listed: dict[str, Any]) -> None:
    """Read one written shard back (``scan_shard``) into its sidecar, so that the shard itself can
    leave this directory (uploaded by ``shard --out URL``) before its split is complete."""
    starts, ends, labels = scan_shard(out / listed["name"], number)
    if len(starts) != listed["samples"]:
        raise ValueError(f"{out / listed['name']}: holds {len(starts)} samples; the index lists {listed['samples']}")
    write_atomically(out / shard_sidecar(listed["name"]),
                  json.dumps({"starts": starts, "ends": ends, "labels": labels}).encode())


def write_samples_file(out: Path, name: str, entry: dict[str, Any], kind: str) -> None:
    """A split's samples file from its shards' sidecars (``write_shard_scan``), written atomically."""
    shard: list[int] = []
    starts: list[int] = []
    ends: list[int] = []
    labels: list[dict[str, Any]] = []
    for number, listed in enumerate(entry["shards"]):
        scan = json.loads((out / shard_sidecar(listed["name"])).read_text(encoding="utf-8"))
        shard += [number] * len(scan["starts"])
        starts += scan["starts"]
        ends += scan["ends"]
        labels += scan["labels"]
    arrays = {"shard": np.array(shard, dtype=np.int32), "start": np.array(starts, dtype=np.int64),
              "end": np.array(ends, dtype=np.int64), **_label_arrays(kind, labels)}
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    write_atomically(out / name, buffer.getvalue())


def read_samples(data: bytes, where: str, kind: str) -> SplitSamples:
    """A samples file's bytes as ``SplitSamples``; a file that is not one is an error naming ``where``."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError) as err:
        raise ValueError(f"{where}: not a readable samples file ({err})") from None
    if kind not in KIND_ARRAYS:
        raise ValueError(f"{where}: samples of kind {kind!r}; this visiontrain reads {', '.join(KIND_ARRAYS)}")
    needed = ("shard", "start", "end", *KIND_ARRAYS[kind])
    missing = [k for k in needed if k not in arrays]
    if missing:
        raise ValueError(f"{where}: a {kind} samples file without {', '.join(missing)}")
    shard, start, end = arrays.pop("shard"), arrays.pop("start"), arrays.pop("end")
    return SplitSamples(shard, start, end, arrays)


def check_samples(samples: SplitSamples, entry: dict[str, Any], classes: int, where: str) -> None:
    """A samples file read back against its index entry, before any shard is read: each sample in a
    listed shard and within its bytes, each label a class. A downloaded set is data; one wrong number
    would otherwise be an ``IndexError`` mid-epoch, or a read of 2^40 bytes."""
    n, shards = len(samples), entry["shards"]
    if n != entry["samples"] or not len(samples.start) == len(samples.end) == n:
        raise ValueError(f"{where}: {n:,} samples with {len(samples.start):,} starts and {len(samples.end):,} ends; "
                         f"its index lists {entry['samples']:,}")
    sizes = np.array([int(s["bytes"]) for s in shards], dtype=np.int64)
    _first_bad(where, "shard", samples.shard, (samples.shard < 0) | (samples.shard >= len(shards)),
               f"a shard number 0-{len(shards) - 1}")
    outside = (samples.start < 0) | (samples.end <= samples.start) | (samples.end > sizes[samples.shard])
    _first_bad(where, "[start, end]", np.stack([samples.start, samples.end], 1), outside,
               "0 <= start < end <= the shard's bytes in the index")
    labels = samples.labels.get("label", samples.labels.get("labels"))
    if labels is not None:
        _first_bad(where, "label", labels, (labels < 0) | (labels >= classes), f"a class index 0-{classes - 1}")
    box_start = samples.labels.get("box_start")
    if box_start is not None and (len(box_start) != n + 1 or box_start[0] != 0 or np.any(np.diff(box_start) < 0)
                                  or box_start[-1] != len(samples.labels["boxes"])):
        raise ValueError(f"{where}: box_start does not split its {len(samples.labels['boxes']):,} boxes into "
                         f"{n:,} samples (expected {n + 1:,} rising offsets from 0)")
    _check_rows(samples, where)


def _check_rows(samples: SplitSamples, where: str) -> None:
    """Each label array one row a sample (or a box), each mask's bytes within ``mask_bytes``, each
    image at least a pixel: what indexing, a cache's sizes and a mask's decoding rely on."""
    a, n = samples.labels, len(samples)
    boxes = len(a["boxes"]) if "boxes" in a else 0
    for key, values in a.items():
        if key in ("box_start", MASK_BYTES):
            continue
        expected, unit = (boxes, "box") if key in PER_BOX else (n, "sample")
        if len(values) != expected:
            raise ValueError(f"{where}: {key} has {len(values):,} rows; expected {expected:,} (one a {unit})")
    if MASK_BYTES in a or "mask_length" in a:
        lengths, data = a.get("mask_length"), a.get(MASK_BYTES)
        if lengths is None or data is None or (lengths < 0).any() or int(lengths.sum()) != len(data):
            raise ValueError(f"{where}: mask_length and mask_bytes do not split {0 if data is None else len(data):,} "
                             f"bytes into the masks of {boxes:,} boxes")
    for key in ("height", "width"):
        if key in a:
            _first_bad(where, key, a[key], a[key] < 1, "an image side of at least 1 pixel")


def _first_bad(where: str, key: str, values: np.ndarray, bad: np.ndarray, expected: str) -> None:
    if bad.any():
        i, count = int(np.flatnonzero(bad)[0]), int(bad.sum())
        raise ValueError(f"{where}: {key} of sample {i:,} is {values[i].tolist()!r}; expected {expected} "
                         f"({count:,} such sample{'s' if count > 1 else ''})")
