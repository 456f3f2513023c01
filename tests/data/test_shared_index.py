"""A dataset's index in one file every DataLoader worker maps (``data.shared_arrays``): it pickles as
the file's path, a worker of every start method reads the records its parent reads, the file goes
with the process that made it (after a kill -9, with the next run), and where no file can be
written, or the index is small, the buffers stay in memory as before."""
from __future__ import annotations

import gc
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DataLoader

from index_items import IndexItems
from visiontrain.data import shared_arrays
from visiontrain.data.detection.record_index import ImageRecord, RecordIndex
from visiontrain.data.packed import PackedSamples
from visiontrain.data.shards.samples import SplitSamples
from visiontrain.data.shared_arrays import SharedArrays, mapped_file
from visiontrain.engine.setup.loaders import worker_context
from visiontrain.engine.step.source import stop_workers

MIB = 2 ** 20


def coco_records(n: int, masks: bool = False) -> list[ImageRecord]:
    """``n`` records with COCO's 7.27 boxes an image on average (its 118,287: 32 MiB packed)."""
    rng = np.random.default_rng(0)
    counts = rng.poisson(7.27, n)
    xy = rng.uniform(0, 600, (int(counts.sum()), 2)).astype(np.float32)
    boxes = np.concatenate([xy, xy + rng.uniform(1, 50, xy.shape).astype(np.float32)], 1)
    labels = rng.integers(0, 80, len(boxes))
    starts = np.concatenate([[0], np.cumsum(counts)])
    return [ImageRecord(f"/data/coco/train2017/{i:012d}.jpg", i + 1, 480, 640, boxes[a:b], labels[a:b],
                        np.arange(a, b), masks=[f"rle{k}" for k in range(a, b)] if masks else None)
            for i, (a, b) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist()))]


def split_samples(n: int) -> SplitSamples:
    rng = np.random.default_rng(1)
    start = np.sort(rng.integers(0, 10 ** 9, n)).astype(np.int64)
    return SplitSamples(rng.integers(0, 1000, n).astype(np.int32), start, start + 1024,
                        {"label": rng.integers(0, 1000, n).astype(np.int64)})


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob(f"{shared_arrays.PREFIX}*{shared_arrays.SUFFIX}"))


def test_a_coco_sized_index_pickles_as_its_file_not_its_bytes():
    index = RecordIndex(coco_records(118_287))
    assert index.nbytes > 30 * MIB and mapped_file(index.boxes) is not None
    data = pickle.dumps(index)
    assert len(data) < 4096  # what a forkserver or spawned worker is sent: was the 32 MiB itself
    copy = pickle.loads(data)
    assert mapped_file(copy.boxes) == mapped_file(index.boxes) == mapped_file(copy.paths.data)
    for i in (0, 5_000, len(index) - 1):
        a, b = index[i], copy[i]
        assert (a.path, a.image_id) == (b.path, b.image_id) and np.array_equal(a.boxes, b.boxes)
    with pytest.raises(ValueError, match="read-only"):
        index.boxes[0, 0] = 1.0  # the index is never written: every worker reads the same pages
    imagenet = split_samples(1_281_167)  # a samples file of ImageNet's size, and its 1.28 M paths
    shared, extra = imagenet.shared(positions=np.arange(len(imagenet)))
    assert len(pickle.dumps((shared, extra))) < 4096
    assert np.array_equal(shared.start, imagenet.start) and np.array_equal(extra["positions"][-3:], [1281164, 1281165, 1281166])
    assert shared.first(5).start.tolist() == imagenet.start[:5].tolist()  # a subset is plain arrays again
    folder = PackedSamples((f"/data/imagenet/train/n{i % 1000:08d}/{i:08d}.JPEG", i % 1000) for i in range(200_000))
    assert mapped_file(folder.labels) is not None and len(pickle.dumps(folder)) < 4096


@pytest.mark.parametrize("start", ["fork", "forkserver", "spawn"])
def test_workers_read_the_records_their_parent_reads_from_the_same_file(start, monkeypatch):
    monkeypatch.setattr(shared_arrays, "MIN_BYTES", 0)  # a small index mapped, as a large one is
    records = RecordIndex(coco_records(40, masks=True))
    samples, _ = split_samples(40).shared()
    folder = PackedSamples((f"/d/n{i % 3}/{i}.jpg", i % 3) for i in range(40))
    dataset = IndexItems(records, samples, folder)
    files = {mapped_file(records.boxes), mapped_file(samples.start), mapped_file(folder.labels)}
    assert None not in files and len(files) == 3 and all(os.path.exists(f) for f in files)
    loader = DataLoader(dataset, batch_size=8, collate_fn=list, num_workers=2, persistent_workers=True,
                        multiprocessing_context=worker_context(start))
    try:
        for _ in range(2):  # the persistent workers' second epoch reads the same
            items = [item for batch in loader for item in batch]
            assert len(items) == len(dataset)
            for i, item in enumerate(items):
                mine = dataset[i]
                assert item["pid"] != os.getpid() and not item["writeable"]
                assert {k: v for k, v in item.items() if k != "pid"} == {k: v for k, v in mine.items() if k != "pid"}
                assert set(item["files"]) == files
    finally:
        stop_workers(loader)
    del loader, dataset, records, samples, folder
    gc.collect()
    assert not any(os.path.exists(f) for f in files)  # the owner dropped its index: its files are gone


OWNER = """
import sys
import numpy as np
from visiontrain.data.shared_arrays import SharedArrays
held = SharedArrays({"a": np.arange(1000)}, directory=sys.argv[1], min_bytes=0)
print(held.path, flush=True)
sys.stdin.readline()
"""


def start_owner(directory: Path) -> tuple[subprocess.Popen, str]:
    """A process that keeps a mapped file in ``directory`` until a line on its stdin; (it, the path)."""
    proc = subprocess.Popen([sys.executable, "-c", OWNER, str(directory)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, proc.stdout.readline().strip()


def test_the_file_goes_with_its_owner_and_a_killed_owners_with_the_next_run(tmp_path, monkeypatch):
    ended, killed, living = start_owner(tmp_path), start_owner(tmp_path), start_owner(tmp_path)
    try:
        assert files_in(tmp_path) == sorted(Path(p).name for _, p in (ended, killed, living))
        ended[0].communicate("\n", timeout=60)  # its interpreter exits: the file goes with it
        assert ended[0].returncode == 0 and not os.path.exists(ended[1])
        os.kill(killed[0].pid, signal.SIGKILL)
        killed[0].wait(timeout=60)
        assert os.path.exists(killed[1])  # nothing ran in it to remove the file
        monkeypatch.setattr(shared_arrays, "_swept", set())  # as a new process would
        new = SharedArrays({"a": np.arange(10)}, directory=str(tmp_path), min_bytes=0)
        assert not os.path.exists(killed[1]) and os.path.exists(living[1])  # a living owner's file is left
        assert sorted(files_in(tmp_path)) == sorted([Path(new.path).name, Path(living[1]).name])
        living[0].communicate("\n", timeout=60)
        assert not os.path.exists(living[1])
    finally:  # no owner outlives the test, even when a check above fails
        for proc, _ in (ended, killed, living):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def assert_in_memory(shared: SharedArrays, arrays: dict[str, np.ndarray]) -> None:
    assert shared.path is None and all(mapped_file(shared[k]) is None for k in arrays)
    assert all(np.array_equal(shared[k], a) and not shared[k].flags.writeable for k, a in arrays.items())
    assert len(pickle.dumps(shared)) > sum(a.nbytes for a in arrays.values())  # the bytes themselves, as before


def test_an_unwritable_directory_or_a_small_index_stays_in_memory(tmp_path, monkeypatch):
    arrays = {"a": np.arange(300_000), "b": np.ones((1000, 4), np.float32)}
    not_a_directory = tmp_path / "file"
    not_a_directory.write_bytes(b"")
    assert_in_memory(SharedArrays(dict(arrays), directory=str(not_a_directory), min_bytes=0), arrays)
    assert_in_memory(SharedArrays(dict(arrays), directory=str(tmp_path / "absent"), min_bytes=0), arrays)
    assert_in_memory(SharedArrays({"a": np.arange(10)}), {"a": np.arange(10)})  # below MIN_BYTES: no file
    monkeypatch.setattr(tempfile, "tempdir", str(not_a_directory))  # TMPDIR unusable: a dataset's index too
    index = RecordIndex(coco_records(20_000))
    assert index.nbytes > shared_arrays.MIN_BYTES and mapped_file(index.boxes) is None
    assert len(pickle.dumps(index)) > index.nbytes and pickle.loads(pickle.dumps(index))[7].path == index[7].path
    assert files_in(tmp_path) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_directory_stays_in_memory(tmp_path):
    tmp_path.chmod(0o555)
    try:
        assert_in_memory(SharedArrays({"a": np.arange(1000)}, directory=str(tmp_path), min_bytes=0),
                         {"a": np.arange(1000)})
    finally:
        tmp_path.chmod(0o755)


FULL = """
import os, resource, signal, sys
import numpy as np
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), as one to a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
from visiontrain.data.shared_arrays import SharedArrays
shared = SharedArrays({"a": np.arange(100_000)}, directory=sys.argv[1], min_bytes=0)
print(shared.path, int(shared["a"].sum()), sorted(os.listdir(sys.argv[1])))
"""


def test_a_write_that_fails_half_way_leaves_no_file_and_the_index_in_memory(tmp_path):
    done = subprocess.run([sys.executable, "-c", FULL, str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", str(sum(range(100_000))), "[]"]
