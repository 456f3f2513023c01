"""The packed index a dataset keeps (``data.packed``, ``data.detection.record_index``): it reads as
the records and samples it was made from, and a worker's pickle of it holds their numbers, not one
Python object per image (benchmarks/scale/worker_memory.py measures what that saves)."""
from __future__ import annotations

import os
import pickle
import tracemalloc

import numpy as np
import pytest

from visiontrain.data.detection.base import BadDataPolicy, DetectionDataset
from visiontrain.data.detection.record_index import ImageRecord, RecordIndex, annotation_ids
from visiontrain.data.packed import PackedSamples, PackedStrings


def records(n: int, seed: int = 0, difficult: bool = False) -> list[ImageRecord]:
    """``n`` records with 0..5 boxes each, odd file names among them."""
    rng = np.random.default_rng(seed)
    names = ["a.jpg", "dir with space/ü.png", os.fsdecode(b"\xff\xfe.jpg"), ""]
    out = []
    for i in range(n):
        k = int(rng.integers(0, 6))
        xy = rng.uniform(0, 50, (k, 2)).astype(np.float32)
        boxes = np.concatenate([xy, xy + rng.uniform(1, 10, (k, 2)).astype(np.float32)], 1)
        out.append(ImageRecord(path=f"/data/{i}/{names[i % len(names)]}", image_id=int(rng.integers(1, 10**9)),
                               height=int(rng.integers(10, 900)), width=int(rng.integers(10, 900)), boxes=boxes,
                               labels=rng.integers(0, 80, k).astype(np.int64), ann_ids=np.arange(k, dtype=np.int64) + i,
                               difficult=rng.random(k) < 0.3 if difficult else None))
    return out


def assert_same(a: ImageRecord, b: ImageRecord) -> None:
    assert (a.path, a.image_id, a.height, a.width) == (b.path, b.image_id, b.height, b.width)
    for name in ("boxes", "labels", "ann_ids"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), name
    assert (a.difficult is None) == (b.difficult is None)
    if a.difficult is not None:
        assert np.array_equal(a.difficult, b.difficult)


@pytest.mark.parametrize("difficult", [False, True])
def test_the_index_reads_as_its_records(difficult: bool) -> None:
    made = records(200, difficult=difficult)
    index = RecordIndex(made)
    assert len(index) == 200 and index.num_boxes == sum(len(r.labels) for r in made)
    for original, packed in zip(made, index, strict=True):
        assert_same(original, packed)
    assert_same(index[-1], made[-1])
    assert [r.image_id for r in index[3:9:2]] == [r.image_id for r in made[3:9:2]]
    with pytest.raises(IndexError):
        index[200]
    index[0].boxes[:] = -1  # a record's arrays are copies: a transform cannot write into the index
    assert_same(index[0], made[0])


def test_an_empty_split_and_mixed_difficult_flags() -> None:
    empty = RecordIndex([])
    assert len(empty) == 0 and empty.boxes.shape == (0, 4) and empty.box_sizes.shape == (0, 2)
    mixed = records(3) + records(3, seed=1, difficult=True)
    index = RecordIndex(mixed)
    assert index[0].difficult is not None and not index[0].difficult.any()  # None: none difficult
    assert_same(index[4], mixed[4])


def test_whole_split_statistics_equal_the_per_record_ones() -> None:
    made = records(100)
    ds = DetectionDataset(made, [f"c{i}" for i in range(80)], list(range(1, 81)), source="fixture",
                          policy=BadDataPolicy("error", "fixture"))
    assert ds.aspect_ratios() == [r.width / r.height for r in made]
    assert ds.image_shapes().tolist() == [[3, r.height, r.width] for r in made]
    assert ds.records.box_sizes.tolist() == [[r.height, r.width] for r in made for _ in r.labels]
    assert np.array_equal(ds.records.boxes, np.concatenate([r.boxes for r in made]))
    gt = ds.coco_ground_truth()
    xywh = [[float(x1), float(y1), float(x2) - float(x1), float(y2) - float(y1)]
            for r in made for x1, y1, x2, y2 in r.boxes]
    assert [a["bbox"] for a in gt["annotations"]] == xywh


def unpickled_bytes(obj: object) -> int:
    """What a worker allocates when it unpickles ``obj`` (numpy reports its buffers to tracemalloc)."""
    data = pickle.dumps(obj)
    tracemalloc.start()
    try:
        copy = pickle.loads(data)
        return tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
        del copy


def test_a_workers_copy_holds_numbers_not_objects() -> None:
    # what a forkserver or spawned DataLoader worker is sent and unpickles: about the index's own bytes
    index = RecordIndex(records(5_000))
    assert unpickled_bytes(index) < 1.1 * index.nbytes + 16_384
    assert unpickled_bytes(list(index)) > 5 * unpickled_bytes(index)  # the same records as Python objects
    for original, packed in zip(index, pickle.loads(pickle.dumps(index)), strict=True):
        assert_same(original, packed)


def test_packed_strings_and_samples_round_trip() -> None:
    names = ["x.jpg", "", "ü/ß.png", os.fsdecode(b"bad\xffname.jpg")]
    assert list(PackedStrings(names)) == names and PackedStrings(names)[-2] == "ü/ß.png"
    assert list(PackedStrings([])) == []
    shared = ["/data/train/n01/a.jpg", "/data/train/n01", "/data/train/n02/b.jpg"]  # the prefix is kept once
    assert list(PackedStrings(shared)) == shared
    assert PackedStrings(shared).data.nbytes == len("1/a.jpg1") + len("2/b.jpg")
    samples = [(f"/d/{i}.jpg", i % 7) for i in range(50)]
    packed = PackedSamples(samples)
    assert list(packed) == samples and packed[-1] == samples[-1] and isinstance(packed[3][1], int)
    assert list(packed.take([5, 1, 9])) == [samples[5], samples[1], samples[9]]
    assert unpickled_bytes(packed) < 1.1 * packed.nbytes + 16_384
    imagenet = [(f"/data/imagenet/train/n{i % 1000:08d}/n{i % 1000:08d}_{i}.JPEG", i % 1000) for i in range(5_000)]
    assert unpickled_bytes(imagenet) > 2 * unpickled_bytes(PackedSamples(imagenet))  # tuples of str and int


def test_annotation_ids_keep_integers() -> None:
    assert annotation_ids([7, None, "a", True, np.int64(3)]).tolist() == [7, -1, -1, -1, 3]
