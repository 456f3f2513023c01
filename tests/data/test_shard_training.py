"""Training from tar shards (`data.name=shards`): the order shards are read in, each sample once an
epoch across ranks and workers, the three task families through the CLI, and kill -9 then
`--resume auto` ending with the straight run's weights, with workers and with 2 ranks."""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader, Dataset, get_worker_info

import shard_helpers
from procs import COMMAND_ENV, finish, in_process, popen, wait_for
from procs import run as procs_run
from s3_server import CREDENTIALS, FlakyProxy, s3_server
from shard_helpers import start_cli, stop
from visiontrain.data.datasets.sources import ClassificationReader
from visiontrain.data.images import UnreadableImageError
from visiontrain.data.shards.datasets import build_shards_classification
from visiontrain.data.shards.layout import expand_braces, split_pattern
from visiontrain.data.shards.reader import ShardSpec, ShardSplit, shard_index
from visiontrain.data.shards.samples import SplitSamples
from visiontrain.data.shards.sampler import ShardBatchSampler, buffer_shuffle
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.engine.state.checkpoint import load_checkpoint

SIZES = [7, 13, 5, 11, 9, 3, 8, 12, 4]  # 72 samples in 9 shards of uneven sizes


def epoch_of(rank: int, epoch: int, *, world: int = 2, streams: int = 2, batch: int = 4, start: int = 0,
             seed: int = 3, buffer: int = 6) -> list[list[int]]:
    s = ShardBatchSampler(SIZES, batch, seed=seed, buffer=buffer, streams=streams, rank=rank, world_size=world,
                          seeded=False)
    s.set_epoch(epoch, start_batch=start)
    return list(s)


def test_buffer_shuffle_is_a_permutation_that_keeps_each_sample_near_its_place():
    samples = list(range(500))
    out = buffer_shuffle(samples, 10, torch.Generator().manual_seed(0))
    assert sorted(out) == samples and out != samples
    assert all(position >= sample - 10 for position, sample in enumerate(out))  # never out before it is read
    assert buffer_shuffle(samples, 1, torch.Generator()) == samples


@pytest.mark.parametrize("world,streams", [(2, 2), (1, 3), (3, 1)])
def test_each_sample_at_most_once_an_epoch_and_fewer_than_a_global_batch_left(world, streams):
    batch = 4
    for epoch in range(3):
        read = [i for r in range(world) for b in epoch_of(r, epoch, world=world, streams=streams, batch=batch)
                for i in b]
        assert len(read) == len(set(read))  # no duplicate
        assert len(read) > sum(SIZES) - world * batch  # no drop beyond the remainder of the last global batch
        counts = {len(epoch_of(r, epoch, world=world, streams=streams, batch=batch)) for r in range(world)}
        assert counts == {sum(SIZES) // world // batch}  # every rank the same number of batches
    assert epoch_of(0, 0) != epoch_of(0, 1)  # another order each epoch


def test_a_worker_reads_a_contiguous_run_of_the_shard_order():
    starts = torch.tensor([0, *SIZES]).cumsum(0).tolist()
    shard_of = {i: s for s in range(len(SIZES)) for i in range(starts[s], starts[s + 1])}
    batches = epoch_of(0, 0, buffer=0)  # no buffer: the stream's samples in their order
    for stream in range(2):
        samples = [i for b in batches[stream::2] for i in b]
        shards = [shard_of[i] for i in samples]
        changes = sum(a != b for a, b in zip(shards, shards[1:]))
        assert changes == len(set(shards)) - 1  # each shard entered once, read front to back
        assert all(b == a + 1 for a, b in zip(samples, samples[1:]) if shard_of[a] == shard_of[b])


def test_resuming_at_a_batch_gives_the_rest_of_the_epoch():
    assert epoch_of(1, 2, start=3) == epoch_of(1, 2)[3:]


class WhoReads(Dataset):
    def __len__(self) -> int:
        return sum(SIZES)

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, get_worker_info().id


def test_dataloader_hands_each_stream_to_one_worker():
    """DataLoader gives its workers batches in turn (torch's in-order hand-out, whatever the start
    method, so this uses the platform's default): one worker reads all of one stream."""
    sampler = ShardBatchSampler(SIZES, 4, seed=0, buffer=6, streams=2, rank=0, world_size=2, seeded=False)
    for start in (0, 3):  # a resumed run starts its iterator mid-epoch
        sampler.set_epoch(1, start_batch=start)
        loader = DataLoader(WhoReads(), batch_sampler=sampler, num_workers=2, collate_fn=lambda items: items)
        batches = list(loader)
        workers = [{w for _, w in b} for b in batches]
        assert all(len(w) == 1 for w in workers)
        streams = {}
        for position, (w,) in enumerate(workers):
            streams.setdefault(w, set()).add((start + position) % 2)
        assert all(len(s) == 1 for s in streams.values()), streams  # a worker stays on its stream


# ------------------------------------------------------------------ through the CLI
@pytest.fixture(scope="module")
def digits_shards(tmp_path_factory) -> Path:
    """`visiontrain shard classify-fashion data.name=digits --shard-size 64KB` (76 + 19 shards)."""
    return shard_helpers.digits_shards(tmp_path_factory)[0]


# classify-fashion as shipped, on the digits' shards, for 2 epochs, so that a resumed run starts an
# epoch's new order. Its num_workers=0 becomes 2 and a checkpoint is written every few steps: what a
# kill is resumed from, with a worker per stream (the issue asks for exact resume with workers).
TRAIN = ("data.name=shards", "trainer.epochs=2", "data.num_workers=2", "checkpoint.unit=steps",
         "trainer.plots=false")  # the figures at the end: about 2 s of CPU a run, and not the subject
# The run's size by process count. One process: 480 of the 1,437 training images, 15 steps of 32 an
# epoch, a checkpoint every 5 steps. Two ranks: 256 images, 8 steps of 2 x 16 an epoch, a checkpoint
# every 4 (a step of two ranks costs several of one process's).
SIZE = {1: ("data.batch_size=32", "data.limit_train=480", "checkpoint.every=5"),
        2: ("data.batch_size=16", "data.limit_train=256", "data.limit_val=180", "checkpoint.every=4")}


def start_fit(shards: Path | str, run_dir: Path, *extra: str, nproc: int = 1,
              env: dict[str, str] | None = None) -> subprocess.Popen:
    launch = ["--nproc", str(nproc)] if nproc > 1 else []
    return start_cli("fit", "classify-fashion", *TRAIN, *SIZE[nproc], f"data.shards={shards}", "--run-dir",
                     str(run_dir), *launch, *extra, env=env)


def finished(proc: subprocess.Popen) -> None:
    _, err = finish(proc, 600)
    assert proc.returncode == 0, err[-3000:]


def same_weights(a: Path, b: Path) -> bool:
    x, y = (load_file(str(run / "model.safetensors")) for run in (a, b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def checkpoint_step(run_dir: Path) -> int:
    last = run_dir / "checkpoints" / "last.pt"
    return fmt.step_of(load_checkpoint(last)) if last.exists() else 0


class Straight:
    """The uninterrupted one-process run from the local shards, started in the background when first
    asked for; ``run_dir()`` waits for it. What the S3 run must end with, and what validate reads."""

    def __init__(self, shards: Path, run_dir: Path) -> None:
        self.dir, self.proc, self.err = run_dir, start_fit(shards, run_dir), ""

    def run_dir(self) -> Path:
        if self.proc.returncode is None:
            _, self.err = finish(self.proc, 600)
        assert self.proc.returncode == 0, self.err[-3000:]
        return self.dir


@pytest.fixture(scope="module")
def straight(digits_shards, tmp_path_factory) -> Iterator[Straight]:
    run = Straight(digits_shards, tmp_path_factory.mktemp("straight") / "run")
    yield run
    stop(run.proc)  # where no test waited for it


def test_kill_9_then_resume_gives_the_straight_runs_weights(digits_shards, tmp_path):
    """Two ranks with two workers each: SIGKILL to the whole process group a random moment after the
    checkpoint of step 4 (of 16), then `--resume auto` to the end, gives the straight run's weights
    (run beside the killed one). One process resuming from shards with workers: the S3 test's resume
    after an outage."""
    killed = tmp_path / "killed"
    straight = start_fit(digits_shards, tmp_path / "straight", nproc=2)
    proc = resumed = start_fit(digits_shards, killed, nproc=2)
    try:
        wait_for(lambda: checkpoint_step(killed) >= 4, "step 4", proc, timeout=300)
        time.sleep(random.Random(2).uniform(0.0, 1.5))
        os.killpg(proc.pid, signal.SIGKILL)
        finish(proc, 60)
        assert proc.returncode == -signal.SIGKILL
        resumed = start_fit(digits_shards, killed, "--resume", "auto", nproc=2)
        finished(resumed)
        finished(straight)
    finally:
        stop(straight, proc, resumed)
    assert same_weights(tmp_path / "straight", killed)


def test_a_brace_pattern_trains_on_the_shards_it_names_and_resume_keeps_the_order(digits_shards, tmp_path, capsys):
    """In this process (shard_helpers): the recipe loads in-process, and what is checked is which
    shards a run reads and what a refusal says."""
    index = json.loads((digits_shards / "index.json").read_text())
    picked = sum(s["samples"] for s in index["splits"]["train"]["shards"][10:20])
    run_dir = tmp_path / "run"
    fit = ("fit", "classify-fashion", "data.name=shards", f"data.shards={digits_shards}/train-{{000010..000019}}.tar",
           "data.batch_size=32", "trainer.epochs=1", "--run-dir", str(run_dir))
    code, out, err = in_process(capsys, *fit)
    assert code == 0, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1])["steps"] == picked // 32
    # the run read with the recipe's auto workers (1 on 2 cores); a resume with 2 reads the order the
    # checkpoint was cut for (tests/data/test_shard_order.py checks it)
    code, out, err = in_process(capsys, *fit, "trainer.epochs=2", "data.num_workers=2", "--resume", "auto")
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["steps"] == 2 * (picked // 32), err[-2000:]
    code, _, err = in_process(capsys, *fit[:-3], "data.shards=" + str(digits_shards) + "/train-{000070..000080}.tar",
                              "--run-dir", str(tmp_path / "other"))
    assert code == 2 and "train-000076.tar" in err and "index.json" in err, err[-2000:]


def test_a_detector_and_dino_train_from_shards_as_shipped(digits_shards, tmp_path, capsys):
    """YOLOv3 and DINO as their recipes ship (their workers, start method, precision, transforms),
    the two runs side by side; validate (in this process) reads the detection val split again."""
    out = tmp_path / "mosaic"
    code, _, err = in_process(capsys, "shard", "detect-yolov3", "data.limit_train=32", "data.limit_val=16", "--out",
                              str(out), "--shard-size", "300KB")
    assert code == 0, err[-2000:]
    yolo = start_cli("fit", "detect-yolov3", "data.name=shards", f"data.shards={out}", "trainer.epochs=1",
                     "--run-dir", str(tmp_path / "yolo"))
    # 2 steps of 32, k-NN with the first 320 training images as the bank, on 180 validation images
    dino = start_cli("fit", "ssl-dino", "data.name=shards", f"data.shards={digits_shards}", "trainer.max_steps=2",
                     "data.batch_size=32", "data.limit_train=320", "data.limit_val=180", "--run-dir",
                     str(tmp_path / "dino"))
    results = {}
    try:
        for name, proc in (("yolo", yolo), ("dino", dino)):
            stdout, err = finish(proc, 600)
            assert proc.returncode == 0, f"{name}: {err[-2000:]}"
            results[name] = json.loads(stdout.strip().splitlines()[-1])["final"]
    finally:
        stop(yolo, dino)
    final = results["yolo"]
    boxes = len(ShardSplit(ShardSpec(str(out)), "val").samples.labels["labels"])
    assert final["AP50"] is not None and len(final["per_class"]) == 10
    assert sum(c["n_gt"] for c in final["per_class"].values()) == boxes  # every val box, from the samples file
    code, stdout, err = in_process(capsys, "validate", str(tmp_path / "yolo" / "checkpoints" / "last.pt"))
    assert code == 0, err[-2000:]
    validated = json.loads(stdout.strip().splitlines()[-1])
    assert validated["AP50"] == pytest.approx(final["AP50"])
    assert {k: c["n_gt"] for k, c in validated["per_class"].items()} == {k: c["n_gt"] for k, c in
                                                                         final["per_class"].items()}
    assert results["dino"]["ema/knn_top1"] > 30  # 10 classes: 10 % is chance


# ------------------------------------------------------------------ object storage
@pytest.fixture(scope="module")
def bucket(digits_shards) -> Iterator[tuple[str, int]]:
    """The digits' shards in a bucket of a local S3 server: (URL, the server's port)."""
    import boto3

    with s3_server() as endpoint:
        client = boto3.client("s3", endpoint_url=endpoint, **{k.lower(): v for k, v in CREDENTIALS.items()
                                                              if k != "AWS_DEFAULT_REGION"}, region_name="us-east-1")
        client.create_bucket(Bucket="shards")
        for path in digits_shards.iterdir():
            client.upload_file(str(path), "shards", f"digits/{path.name}")
        yield "s3://shards/digits", int(endpoint.rsplit(":", 1)[1])


def fit_env(endpoint: str) -> dict[str, str]:
    """The run's environment for the local server: its address and credentials, as a user sets them."""
    return {**os.environ, **COMMAND_ENV, **CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}


# One read of the shards' index from a store whose server refuses every connection.
READ_INDEX = ("from visiontrain.data.shards.storage import ShardStore, ShardReadError\n"
              "try:\n    ShardStore('s3://shards/digits', first_wait=0.001).read('index.json')\n"
              "except ShardReadError as err:\n    print(err)")


def test_an_outage_is_given_up_after_visiontrain_s_tries_alone():
    """s3fs's five calls around each of botocore's five attempts, under visiontrain's tries, made an
    outage take 200 connections and 150 s to give up (194 s for a run): one policy now, the docs'."""
    from visiontrain.data.shards.storage import RETRIES

    proxy = FlakyProxy(0, cut=0.0)
    proxy.down = True  # every connection closed at once: the server is gone
    try:
        proc = procs_run([sys.executable, "-c", READ_INDEX], env=fit_env(proxy.endpoint), timeout=300)
    finally:
        proxy.close()
    assert f"cannot be read or written after {RETRIES} tries" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert RETRIES <= proxy.connections <= 2 * RETRIES  # a try may open two (found 10 for 5 tries)


def test_from_s3_through_dropped_connections_and_an_outage_a_run_ends_with_the_local_runs_weights(
        straight, bucket, tmp_path):
    """The run reads its shards from S3 through a proxy that cuts half the connections part-way, and
    ends with the weights of the straight run from the local shards (which runs beside it). In
    between, an outage (every connection refused) stops it with one line naming the URL, the last
    checkpoint intact, and `--resume auto` continues once the storage is back."""
    url, port = bucket
    run_dir = tmp_path / "run"
    # a fifth of the connections cut part-way: a read fails for good only when all 8 of its tries are
    # cut (0.2^8, 3e-6; at half of them cut, 0.4 % of the run's few hundred reads would, with the
    # storage libraries' own retries gone from under visiontrain's)
    flaky = FlakyProxy(port, cut=0.2, within=40_000)
    proc = start_fit(url, run_dir, env=fit_env(flaky.endpoint))
    try:
        wait_for(lambda: checkpoint_step(run_dir) >= 5, "step 5", proc, timeout=300)
        flaky.go_down()
        _, err = finish(proc, 600)
    finally:
        flaky.close()
        stop(proc)
    assert proc.returncode == 2, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("visiontrain: error:")]
    assert len(lines) == 1 and "s3://shards/digits/" in lines[0] and "cannot be read" in lines[0], err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert checkpoint_step(run_dir) >= 5  # the last checkpoint loads
    back = FlakyProxy(port, cut=0.2, within=40_000, seed=1)  # the storage is back, as flaky as before
    resumed = start_fit(url, run_dir, "--resume", "auto", env=fit_env(back.endpoint))
    try:
        finished(resumed)
    finally:
        back.close()
        stop(resumed)
    assert flaky.cuts + back.cuts >= 3, (flaky.cuts, back.cuts)  # the reads went through cut connections
    assert same_weights(straight.run_dir(), run_dir)


def test_shard_writes_to_a_bucket_the_bytes_it_writes_to_a_directory_and_a_killed_write_continues(
        digits_shards, bucket, tmp_path):
    import s3fs

    _, port = bucket
    env, staging = fit_env(f"http://127.0.0.1:{port}"), tmp_path / "staging"
    args = [sys.executable, "-m", "visiontrain", *shard_helpers.DIGITS_SHARDS, "--out", "s3://shards/written",
            "--staging", str(staging)]  # the fixture's shards' data and size
    proc = popen(args, env=env)

    def uploaded() -> int:
        try:
            return len(json.loads((staging / "index.json").read_text())["splits"]["train"]["shards"])
        except (OSError, ValueError):
            return 0
    wait_for(lambda: uploaded() >= 3, "three shards uploaded", proc)
    os.killpg(proc.pid, signal.SIGKILL)
    finish(proc, 60)
    resumed = procs_run(args, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert not staging.exists()  # everything is in the bucket
    fs = s3fs.S3FileSystem(endpoint_url=f"http://127.0.0.1:{port}", key="testing", secret="testing")
    names = sorted(path.rsplit("/", 1)[1] for path in fs.ls("shards/written"))
    assert names == sorted(p.name for p in digits_shards.iterdir())
    assert all(fs.cat_file(f"shards/written/{name}") == (digits_shards / name).read_bytes() for name in names)


def test_the_straight_run_learned_and_validate_reads_the_val_split_from_the_shards_again(straight, capsys):
    run_dir = straight.run_dir()
    final = json.loads((run_dir / "summary.json").read_text())["final"]
    assert final["top1"] > 80  # it learned from the shards
    code, out, err = in_process(capsys, "validate", str(run_dir / "checkpoints" / "last.pt"))
    assert code == 0, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1])["top1"] == pytest.approx(final["top1"])


def test_brace_patterns_expand_as_the_shell_does():
    assert expand_braces("train-{000008..000011}.tar") == [f"train-{n:06d}.tar" for n in range(8, 12)]
    assert expand_braces("{train,val}-{0..1}.tar") == ["train-0.tar", "train-1.tar", "val-0.tar", "val-1.tar"]
    assert split_pattern("s3://b/p/train-{0..1}.tar") == ("s3://b/p", ("train-0.tar", "train-1.tar"))
    assert split_pattern("s3://b/p/") == ("s3://b/p", ())
    with pytest.raises(ValueError, match="backwards"):
        expand_braces("train-{5..2}.tar")


def test_a_detection_split_taken_by_shard_keeps_each_images_boxes():
    labels = {"image_id": np.arange(4), "height": np.full(4, 10), "width": np.full(4, 20),
              "box_start": np.array([0, 2, 2, 5, 6]), "boxes": np.arange(24, dtype=np.float32).reshape(6, 4),
              "labels": np.arange(6), "ann_ids": np.arange(6) + 100}
    samples = SplitSamples(np.array([0, 0, 1, 1]), np.arange(4), np.arange(4) + 1, labels)
    taken = samples.take(np.array([False, True, True, False]))
    assert taken.labels["box_start"].tolist() == [0, 0, 3] and taken.labels["labels"].tolist() == [2, 3, 4]
    assert taken.labels["boxes"].tolist() == labels["boxes"][2:5].tolist() and taken.shard.tolist() == [0, 1]
    first = samples.first(3)
    assert first.labels["box_start"].tolist() == [0, 2, 2, 5]
    assert first.labels["ann_ids"].tolist() == list(range(100, 105))


def test_an_image_that_cannot_be_decoded_is_named_by_shard_and_key(digits_shards, tmp_path):
    copy = tmp_path / "digits"
    shutil.copytree(digits_shards, copy)
    shard_index.cache_clear()
    spec = ShardSpec(str(copy))
    split = ShardSplit(spec, "train")
    start = int(split.samples.start[3])
    with open(copy / "train-000000.tar", "r+b") as f:  # the PNG's bytes after its header: garbage
        f.seek(start + 512 + 16)
        f.write(b"\0" * 64)
    train, *_ = build_shards_classification(ClassificationReader(shards=spec))
    with pytest.raises(UnreadableImageError, match=r"train-000000\.tar sample 000000003 cannot be decoded"):
        train[3]
    train.check_files("skip", 0.1)  # data.on_bad_image=skip: the next image stands in
    assert torch.equal(train[3][0], train[4][0])


@pytest.mark.parametrize("key, value, expected", [
    ("label", 99, "label of sample 7 is 99; expected a class index 0-9"),
    ("end", 2**40, "[start, end] of sample 7 is [{start}, 1099511627776]; expected 0 <= start < end <= the "
                   "shard's bytes in the index"),
    ("shard", 500, "shard of sample 7 is 500; expected a shard number 0-75"),
])
def test_a_samples_file_out_of_its_index_is_one_line_before_any_read(digits_shards, tmp_path, capsys, key, value,
                                                                      expected):
    """A downloaded samples file's numbers are checked against its index: a label that is no class,
    a byte range past its shard (2^40 bytes was a MemoryError after five tries), a shard not listed."""
    copy = tmp_path / "shards"
    shutil.copytree(digits_shards, copy)
    name = json.loads((copy / "index.json").read_text())["splits"]["train"]["samples_file"]
    with np.load(copy / name) as npz:
        arrays = {k: npz[k] for k in npz.files}
    start = int(arrays["start"][7])
    arrays[key][7] = value
    with open(copy / name, "wb") as f:
        np.savez(f, **arrays)
    shard_index.cache_clear()
    code, _, err = in_process(capsys, "fit", "classify-fashion", "data.name=shards", f"data.shards={copy}",
                              "--run-dir", str(tmp_path / "run"))
    errors = [line for line in err.splitlines() if line.startswith("visiontrain: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert f"{copy / name}: {expected.format(start=start)} (1 such sample)" in errors[0], errors
    assert not (tmp_path / "run").exists()


def test_an_index_nested_past_a_json_readers_depth_is_one_line(tmp_path, capsys):
    copy = tmp_path / "shards"
    copy.mkdir()
    (copy / "index.json").write_text('{"splits": ' + "[" * 100_000 + "]" * 100_000 + "}")
    shard_index.cache_clear()
    code, _, err = in_process(capsys, "fit", "classify-fashion", "data.name=shards", f"data.shards={copy}",
                              "--run-dir", str(tmp_path / "run"))
    errors = [line for line in err.splitlines() if line.startswith("visiontrain: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert f"{copy}/index.json: not a readable shard index (nested too deeply for a JSON reader)" in errors[0]


@pytest.mark.parametrize("field, value", [("samples_file", "/etc/passwd"), ("samples_file", "../../samples.npz"),
                                          ("name", "../outside.tar"), ("name", "..")])
def test_an_index_naming_a_file_outside_its_directory_is_refused_in_one_line(digits_shards, tmp_path, capsys,
                                                                           field, value):
    """A downloaded index.json: its shard and samples file names reach nothing outside the directory."""
    index = json.loads((digits_shards / "index.json").read_text())
    entry = index["splits"]["train"]
    if field == "name":
        entry["shards"][1]["name"] = value
    else:
        entry["samples_file"] = value
    copy = tmp_path / "shards"
    copy.mkdir()
    (copy / "index.json").write_text(json.dumps(index))
    shard_index.cache_clear()
    code, _, err = in_process(capsys, "fit", "classify-fashion", "data.name=shards", f"data.shards={copy}",
                              "--run-dir", str(tmp_path / "run"))
    errors = [line for line in err.splitlines() if line.startswith("visiontrain: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-2000:]
    key = "shards[1].name" if field == "name" else "samples_file"
    assert f"splits.train.{key} is {value!r}; expected a file name in the shard directory" in errors[0], errors
    assert not (tmp_path / "run").exists()


def test_a_bucket_that_does_not_exist_is_named_as_such(bucket, tmp_path):
    """S3 answers NoSuchBucket, which s3fs raises as a missing file: `shard --out` and a fit from the
    bucket said "…/train-000000.tar: no such file". They say the bucket does not exist now."""
    _, port = bucket
    env = fit_env(f"http://127.0.0.1:{port}")
    wrote = procs_run([sys.executable, "-m", "visiontrain", *shard_helpers.DIGITS_SHARDS, "--out",
                       "s3://no-such-bucket/written", "--staging", str(tmp_path / "staging")], env=env, timeout=300)
    read = procs_run([sys.executable, "-m", "visiontrain", "fit", "classify-fashion", "data.name=shards",
                      "data.shards=s3://no-such-bucket/digits", "--run-dir", str(tmp_path / "run")], env=env, timeout=300)
    for proc, name in ((wrote, "written/train-000000.tar"), (read, "digits/index.json")):
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1] == (
            f"visiontrain: error: s3://no-such-bucket/{name}: the bucket s3://no-such-bucket does not exist (the "
            f"storage answered NoSuchBucket); create it first: `visiontrain shard --out` writes into an existing "
            f"bucket and data.shards reads from one")
    assert not (tmp_path / "run").exists()


def test_aspect_grouping_from_shards_says_once_what_an_epoch_leaves_out(digits_shards, caplog):
    """The line was "task.group_aspect is not applied ..."; groups are formed within each worker's
    stream now (tests/data/test_shard_labels.py), and what that leaves out of an epoch is said once,
    by the first rank; ungrouped, nothing is said."""
    from visiontrain.core import config as C

    # the sampler is called directly, without the start-up that turns data.num_workers=auto into a
    # number: one stream, as auto gives on 2 cores of a CPU
    cfg = C.load_config("classify-fashion", ["data.name=shards", f"data.shards={digits_shards}",
                                             "data.num_workers=1"])
    n = json.loads((digits_shards / "index.json").read_text())["splits"]["train"]["samples"]
    with caplog.at_level(logging.INFO, logger="visiontrain"):
        cfg.data.batch_sampler(n, None, seed=0, rank=0, world_size=1)
        assert caplog.messages == []
        grouped = cfg.data.batch_sampler(n, [i % 2 for i in range(n)], seed=0, rank=0, world_size=1)
        cfg.data.batch_sampler(n, [i % 2 for i in range(n)], seed=0, rank=1, world_size=2)
    left = n - grouped.batches_per_epoch * cfg.data.batch_size
    assert caplog.messages == [grouped.left_out_message()]
    assert f"leaves {left:,} out of each epoch" in caplog.messages[0]
