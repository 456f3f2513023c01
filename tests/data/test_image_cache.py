"""The decoded-image cache (data.cache=ram): the same tensors as decoding, one copy shared by every
worker process, refused before anything is written when it does not fit, removed when its run ends
or, after a kill -9, by the next run; and a run with it trains bit-identically, resume included."""
from __future__ import annotations

import gc
import os
import pickle
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import dataset_trees
from visiontrain.core import config as C
from visiontrain.data import image_cache
from visiontrain.data.detection.images import image_size, read_rgb
from visiontrain.data.detection.sources import DetectionDataConfig
from visiontrain.data.detection.splits import build_detection_splits

SPLITS = {"coco": ("train2017", "val2017"), "voc": ("trainval", "test"), "yolo": ("train", "val")}


def tree(name: str, tmp_path_factory, mosaic_coco) -> tuple[str, Path, tuple[str, str]]:
    """(data.name, data.root, splits) of a tiny tree: COCO, VOC and YOLO JPEGs, or fashion-mosaic's
    PNGs laid out as COCO."""
    if name == "mosaic":  # a copy: the tests delete the files they cached, and the session's tree is shared
        copy = tmp_path_factory.mktemp(name) / "coco"
        shutil.copytree(mosaic_coco(4, 2), copy)
        return "coco", copy, ("train", "val")
    root = tmp_path_factory.mktemp(name)
    getattr(dataset_trees, f"build_{name}")(root)
    return name, root, SPLITS[name]


def cached_splits(name: str, root: Path, splits: tuple[str, str], directory: Path, **cache):
    return build_detection_splits(DetectionDataConfig(name=name, root=str(root), train_split=splits[0],
                                                      val_split=splits[1], on_bad_annotation="error", cache="ram",
                                                      cache_dir=str(directory), **cache))


def cache_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob(f"{image_cache.PREFIX}*"))


@pytest.mark.parametrize("fmt", ["coco", "voc", "yolo", "mosaic"])
def test_the_cache_returns_the_decoded_tensors(fmt, tmp_path, tmp_path_factory, mosaic_coco):
    """Every image, read twice: the first read decodes and fills, the second comes from the cache
    (the files are gone by then), and both equal what decoding the file gives, type and layout too."""
    name, root, splits = tree(fmt, tmp_path_factory, mosaic_coco)
    datasets = cached_splits(name, root, splits, tmp_path)
    assert len(cache_files(tmp_path)) == 2  # one file per split
    decoded = [[read_rgb(r.path) for r in ds.records] for ds in datasets]
    first = [[ds.load(i)[0] for i in range(len(ds))] for ds in datasets]
    for ds in datasets:
        assert ds.cache.filled() == len(ds)
        for r in ds.records:
            os.remove(r.path)
    second = [[ds.load(i)[0] for i in range(len(ds))] for ds in datasets]
    for reference, *reads in zip(decoded, first, second):
        for ref, *images in zip(reference, *reads):
            for image in images:
                assert type(image).__name__ == "Image" and image.dtype == torch.uint8
                assert image.shape == ref.shape and image.stride() == ref.stride()
                assert torch.equal(image.as_subclass(torch.Tensor), ref)


def reads_through(dataset, workers: int, context) -> list[torch.Tensor]:
    loader = DataLoader(dataset, batch_size=None, num_workers=workers, multiprocessing_context=context)
    return [image.as_subclass(torch.Tensor) for image, _ in loader]


def test_forkserver_workers_share_one_copy(tmp_path, tmp_path_factory, mosaic_coco):
    """Two forkserver workers fill the cache and the main process reads what they wrote; then, with
    the image files deleted, two new workers read what other processes filled. A worker that decoded
    into a private copy, or received the pixels with the dataset, would fail one of the three checks."""
    from visiontrain.engine.setup.loaders import worker_context

    name, root, splits = tree("coco", tmp_path_factory, mosaic_coco)
    train, _ = cached_splits(name, root, splits, tmp_path)
    reference = [read_rgb(r.path) for r in train.records]
    assert len(pickle.dumps(train)) < train.cache.nbytes / 20  # what a worker receives: the path and shapes
    context = worker_context("forkserver")
    filled_by_workers = reads_through(train, 2, context)
    assert train.cache.filled() == len(train)  # written by the workers, visible here
    for r in train.records:
        os.remove(r.path)
    read_here = [train.load(i)[0].as_subclass(torch.Tensor) for i in range(len(train))]
    read_by_workers = reads_through(train, 2, context)
    for images in (filled_by_workers, read_here, read_by_workers):
        assert all(torch.equal(a, b) for a, b in zip(images, reference, strict=True))


def test_a_cache_that_does_not_fit_is_refused_before_anything_is_written(tmp_path, tmp_path_factory, mosaic_coco,
                                                                           monkeypatch):
    name, root, splits = tree("coco", tmp_path_factory, mosaic_coco)
    shapes = [[(3, *image_size(str(p))) for p in sorted((root / s).iterdir())] for s in splits]
    need = sum(len(s) + (-len(s)) % 4096 + int(np.prod(s, axis=1).sum()) for s in shapes)  # flags, pages, pixels
    with pytest.raises(C.ConfigError) as err:
        cached_splits(name, root, splits, tmp_path, cache_gb=need / 2 ** 30 / 2)
    assert "data.cache=ram" in str(err.value) and f"need {need:,} bytes" in str(err.value)
    assert f"budget of {need // 2:,} bytes" in str(err.value) and "data.cache_gb=" in str(err.value)
    # the default budget: half the memory available, shared by torchrun's processes on the machine
    monkeypatch.setattr(image_cache, "available_memory", lambda: need)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(C.ConfigError, match=f"budget of {need // 4:,} bytes .*half of the .* over 2 processes.*"
                                            "data.cache_gb unset"):
        cached_splits(name, root, splits, tmp_path)
    monkeypatch.undo()
    # a directory with less room than the images need
    monkeypatch.setattr(image_cache, "free_bytes", lambda directory: 4096)
    with pytest.raises(C.ConfigError, match=f"{tmp_path} has 4,096 bytes free.*data.cache_dir"):
        cached_splits(name, root, splits, tmp_path)
    assert cache_files(tmp_path) == []
    # data.cache_dir unset: /dev/shm where it has room, else the temp directory; neither: refused naming both
    shm, temp = tmp_path / "shm", tmp_path / "temp"
    shm.mkdir(), temp.mkdir()
    monkeypatch.setattr(image_cache, "default_directories", lambda: [str(shm), str(temp)])
    monkeypatch.setattr(image_cache, "free_bytes", lambda directory: 4096 if directory == str(shm) else need)
    data = DetectionDataConfig(name=name, root=str(root), train_split=splits[0], val_split=splits[1],
                               on_bad_annotation="error", cache="ram")
    train, val = build_detection_splits(data)
    assert cache_files(shm) == [] and len(cache_files(temp)) == 2
    del train, val
    gc.collect()
    monkeypatch.setattr(image_cache, "free_bytes", lambda directory: 4096)
    with pytest.raises(C.ConfigError, match=f"{shm} has 4,096 bytes free .* and {temp} has 4,096 bytes free"):
        build_detection_splits(data)
    assert cache_files(shm) == cache_files(temp) == []


def test_files_are_removed_when_the_run_ends_and_after_a_kill(tmp_path):
    """The creator removes its file when it drops the cache; a file whose creator was killed (-9) is
    removed by the next run that opens a cache, and one whose creator lives is left alone."""
    shapes = np.array([(3, 4, 5)])
    cache = image_cache.ImageCache.create(str(tmp_path), shapes)
    assert cache_files(tmp_path) == [Path(cache.path).name]
    del cache
    gc.collect()
    assert cache_files(tmp_path) == []
    ready, release = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: holds a cache and waits, as a training process would, until killed
        try:
            held = image_cache.ImageCache.create(str(tmp_path), shapes)  # noqa: F841  (dropped, it is removed)
            os.write(release, b"x")
            signal.pause()
        finally:
            os._exit(1)
    try:
        assert os.read(ready, 1) == b"x"
        left = cache_files(tmp_path)
        assert len(left) == 1 and f"-{pid}-" in left[0]
        assert image_cache.remove_stale(str(tmp_path)) == [] and cache_files(tmp_path) == left  # its run lives
    finally:  # the child never outlives the test, even when a check above fails
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    caches = image_cache.open_caches({"train": shapes}, budget_gb=None, directory=str(tmp_path))
    assert cache_files(tmp_path) == [Path(caches["train"].path).name]  # the killed run's file is gone


def test_training_with_the_cache_is_bit_identical_and_resumes_exactly(tmp_path, mosaic_coco):
    """detect-yolov3 as shipped (its forkserver worker, bf16, transforms) on 8 mosaic images: a run
    with data.cache=ram ends with the weights of one without, and so does a run killed mid-epoch and
    resumed with it; epochs after the first read the images from the cache."""
    from resume_checks import assert_bit_identical, fit_and_crash_resume, state_of
    from visiontrain.engine.loop.trainer import Trainer
    from visiontrain.rundir.metrics_file import read_metrics
    from visiontrain.tasks import build_task

    root = mosaic_coco(8, 2)
    shipped = ["data.name=coco", f"data.root={root}", "data.batch_size=2", "trainer.max_steps=7"]
    extra = ["trainer.plots=false",  # the figures cost seconds a run and are not what is tested
             "checkpoint.every=2", "checkpoint.unit=steps"]  # a checkpoint mid-epoch, to resume from
    plain_cfg = C.load_config("detect-yolov3", shipped + extra)
    plain = Trainer(plain_cfg, build_task(plain_cfg), tmp_path / "plain")
    plain.fit()
    cfg = C.load_config("detect-yolov3", shipped + extra + ["data.cache=ram",  # the subject
                                                             f"data.cache_dir={tmp_path}"])  # not /dev/shm: per test
    full, resumed = fit_and_crash_resume(cfg, tmp_path, crash_at=4)  # after the checkpoint at step 4
    per_epoch = full.run.source.batches_per_epoch
    assert full.step == resumed.step == plain.step == 7 and per_epoch < 4 and 4 % per_epoch  # resumed mid-epoch
    for run in (full, resumed):
        assert run.task.train_set.cache.filled() >= 2 * per_epoch
        assert run.task.val_set.cache.filled() == len(run.task.val_set)  # evaluated at the end
    assert_bit_identical(state_of(plain), state_of(full))
    assert_bit_identical(state_of(full), state_of(resumed))
    logged = [read_metrics(run) for run in (tmp_path / "plain", tmp_path / "full")]
    losses = [[{k: v for k, v in row.items() if k.startswith("loss")} for row in m.train] for m in logged]
    assert losses[0] == losses[1] and len(losses[0]) >= 2 and all(losses[0])  # every logged loss, equal
    assert repr(logged[0].evals[-1]["AP50"]) == repr(logged[1].evals[-1]["AP50"])  # NaN too, early on
