"""visiontrain.engine.state.checkpoint: atomic writes (also under SIGKILL), safe loads, RNG state, best-k."""
from __future__ import annotations

import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from visiontrain.engine.state.checkpoint import (BestTracker, CheckpointError, atomic_save, capture_rng,
                                                 load_checkpoint, restore_rng)
import visiontrain.engine.state.checkpoint as ckpt


class Custom:
    """A plain class: a weights_only load must refuse to build it."""

    def __init__(self) -> None:
        self.x = 1


def sample_state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(3, 4, generator=g), "b": torch.arange(5)},
            "step": 7, "name": "run", "lr": [0.1, 0.01], "flags": {"ok": True, "none": None}}


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b and type(a) is type(b)


def leftovers(directory: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name not in keep)


# --- atomic writes -----------------------------------------------------------------------

def test_atomic_save_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "dir" / "last.pt"  # parent directories are created
    state = sample_state()
    atomic_save(state, path)
    assert_same(state, load_checkpoint(path))
    assert leftovers(path.parent, {"last.pt"}) == []
    # overwriting replaces the content
    state["step"] = 8
    state["model"]["w"] = state["model"]["w"] * 2
    atomic_save(state, str(path))
    assert_same(state, load_checkpoint(str(path)))


def test_failed_write_keeps_previous_file_and_cleans_temp(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "last.pt"
    old = sample_state()
    atomic_save(old, path)
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 partial zip bytes" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", full_disk)
    with pytest.raises(CheckpointError) as info:
        atomic_save({"model": {"w": torch.zeros(3)}, "step": 99}, path)
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    msg = str(info.value)
    assert str(path) in msg and "the disk is full" in msg and "the previous last.pt is intact" in msg
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == 28
    assert_same(old, load_checkpoint(path))
    assert leftovers(tmp_path, {"last.pt"}) == []


def test_failed_first_write_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    def boom(obj, f, *args, **kwargs):
        f.write(b"xx")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", boom)
    with pytest.raises(CheckpointError, match="the disk is full .*; no checkpoint was there before, and nothing "
                                              "of this write was left behind"):
        atomic_save({"a": torch.ones(1)}, tmp_path / "new.pt")
    assert list(tmp_path.iterdir()) == []


def test_non_os_error_propagates_unchanged_and_cleans_temp(tmp_path: Path, monkeypatch) -> None:
    def bad(obj, f, *args, **kwargs):
        f.write(b"xx")
        raise KeyError("boom")

    monkeypatch.setattr(ckpt.torch, "save", bad)
    with pytest.raises(KeyError):
        atomic_save({"a": torch.ones(1)}, tmp_path / "x.pt")
    assert list(tmp_path.iterdir()) == []


SAVER = r"""
import os, sys
import torch
from visiontrain.engine.state.checkpoint import atomic_save

path = sys.argv[1]
tensors = [torch.empty(1 << 20) for _ in range(5)]  # 5 x 4 MiB = 20 MiB
for line in sys.stdin:  # one saver per line, forked from this (already imported) process
    base = int(line)
    server = os.getpid()
    pid = os.fork()
    if pid == 0:
        counter = base
        while os.getppid() == server:  # never outlive the server
            for t in tensors:
                t.fill_(float(counter))
            atomic_save({"counter": counter, **{f"t{i}": t for i, t in enumerate(tensors)}}, path)
            if counter == base:
                print(f"ready {os.getpid()}", flush=True)
            counter += 1
        os._exit(1)
    _, status = os.waitpid(pid, 0)
    print(f"reaped {pid} {status}", flush=True)
"""


def test_sigkill_during_saves_leaves_a_complete_file(tmp_path: Path) -> None:
    path = tmp_path / "last.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    rng = random.Random(1234)
    kills, alive = 0, None
    try:
        for round_ in range(5):
            base = (round_ + 1) * 1_000_000
            proc.stdin.write(f"{base}\n")
            proc.stdin.flush()
            ready = proc.stdout.readline().split()
            assert ready and ready[0] == "ready", ready
            pid = alive = int(ready[1])
            time.sleep(rng.uniform(0.05, 0.5))
            os.kill(pid, signal.SIGKILL)
            alive = None
            reaped = proc.stdout.readline().split()
            assert reaped[:2] == ["reaped", str(pid)], reaped
            assert os.WIFSIGNALED(int(reaped[2])) and os.WTERMSIG(int(reaped[2])) == signal.SIGKILL
            kills += 1

            state = load_checkpoint(path)  # complete, whatever moment the kill hit
            counter = state["counter"]
            assert base <= counter < base + 1_000_000  # written by this round's saver
            for i in range(5):
                t = state[f"t{i}"]
                assert t.shape == (1 << 20,)
                assert t.min().item() == t.max().item() == float(counter), (round_, i)
            # a kill may leave a temp file behind, never anything else
            assert all(n.startswith(".last.pt.") and n.endswith(".tmp")
                       for n in leftovers(tmp_path, {"last.pt"}))
    finally:
        if alive is not None:  # a failed check between fork and kill: stop that saver too
            try:
                os.kill(alive, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    assert kills == 5 and proc.returncode == 0


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600)])
def test_saved_file_mode_follows_umask(tmp_path: Path, umask: int, mode: int) -> None:
    old = os.umask(umask)
    try:
        atomic_save({"a": torch.ones(2)}, tmp_path / "m.pt")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "m.pt").stat().st_mode) == mode


# --- loads -------------------------------------------------------------------------------

def test_load_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "cut.pt"
    atomic_save({"w": torch.randn(1000)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert "truncated or corrupt" in str(info.value) and str(path) in str(info.value)


def test_load_refuses_arbitrary_objects(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"obj": Custom(), "w": torch.ones(2)}, path)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert "refused" in str(info.value) and str(path) in str(info.value)


def test_load_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.pt"
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert "does not exist" in str(info.value) and str(path) in str(info.value)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path)  # a directory is not a checkpoint file


def test_load_non_dict(tmp_path: Path) -> None:
    path = tmp_path / "list.pt"
    torch.save([torch.ones(1)], path)
    with pytest.raises(CheckpointError, match="expected a dict"):
        load_checkpoint(path)


# --- RNG state ---------------------------------------------------------------------------

def draw() -> tuple:
    return (random.random(), random.gauss(0.0, 1.0), np.random.rand(), np.random.standard_normal(),
            torch.rand(3))


def assert_draws_equal(a: tuple, b: tuple) -> None:
    assert a[:4] == b[:4]
    assert torch.equal(a[4], b[4])


def test_capture_restore_rng_round_trip(tmp_path: Path) -> None:
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    random.gauss(0.0, 1.0)  # leaves a cached gauss value in the python state
    np.random.standard_normal()  # and a cached one in numpy's legacy state (has_gauss = 1)
    state = capture_rng()
    first = draw()
    second = draw()
    assert first[0] != second[0]

    restore_rng(state)
    assert_draws_equal(draw(), first)

    atomic_save({"rng": state}, tmp_path / "rng.pt")
    loaded = load_checkpoint(tmp_path / "rng.pt")["rng"]  # weights_only load
    draw()  # move every generator on
    restore_rng(loaded)
    assert_draws_equal(draw(), first)
    assert_draws_equal(draw(), second)


# --- best-k ------------------------------------------------------------------------------

def files(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()}


def test_best_tracker_max_writes_only_on_improvement(tmp_path: Path) -> None:
    bt = BestTracker(tmp_path, "max")
    assert bt.update("model", 0.5, {"v": 0.5}, step=1)
    assert load_checkpoint(tmp_path / "best.pt")["v"] == 0.5
    assert not bt.update("model", 0.4, {"v": 0.4}, step=2)
    assert not bt.update("model", 0.5, {"v": 0.5}, step=3)  # a tie is no improvement
    assert not bt.update("model", float("nan"), {"v": -1.0}, step=4)
    assert load_checkpoint(tmp_path / "best.pt")["v"] == 0.5
    assert bt.update("model", 0.7, {"v": 0.7}, step=5)
    assert load_checkpoint(tmp_path / "best.pt")["v"] == 0.7
    assert files(tmp_path) == {"best.pt"}  # keep=0: no best-stepS.pt files
    # the EMA has its own record and file
    assert bt.update("ema", 0.6, {"v": 0.6}, step=5)
    assert load_checkpoint(tmp_path / "best_ema.pt")["v"] == 0.6
    assert load_checkpoint(tmp_path / "best.pt")["v"] == 0.7
    assert bt.best == {"model": 0.7, "ema": 0.6}


def test_best_tracker_min_and_nan_first(tmp_path: Path) -> None:
    bt = BestTracker(tmp_path, "min")
    assert not bt.update("model", float("nan"), {"v": 0.0}, step=1)
    assert not (tmp_path / "best.pt").exists()
    assert bt.update("model", 2.0, {"v": 2.0}, step=2)
    assert not bt.update("model", 3.0, {"v": 3.0}, step=3)
    assert bt.update("model", 1.5, {"v": 1.5}, step=4)
    assert not bt.update("model", float("nan"), {"v": 0.0}, step=5)
    assert load_checkpoint(tmp_path / "best.pt")["v"] == 1.5


@pytest.mark.parametrize("mode,values", [("max", [0.1, 0.2, 0.15, 0.3, 0.4]), ("min", [5.0, 4.0, 4.5, 3.0, 1.0])])
def test_best_tracker_keep_two(tmp_path: Path, mode: str, values: list[float]) -> None:
    bt = BestTracker(tmp_path, mode, keep=2)
    for step, v in enumerate(values, start=1):
        bt.update("model", v, {"v": v}, step=step)
    # records at steps 1, 2, 4, 5; the two best are steps 5 and 4
    assert files(tmp_path) == {"best.pt", "best-step4.pt", "best-step5.pt"}
    assert load_checkpoint(tmp_path / "best-step5.pt")["v"] == values[4]
    assert load_checkpoint(tmp_path / "best-step4.pt")["v"] == values[3]
    assert load_checkpoint(tmp_path / "best.pt")["v"] == values[4]
    assert [n for _, n in bt.kept] == ["best-step5.pt", "best-step4.pt"]


def test_a_kept_record_is_written_once_and_best_pt_links_to_it(tmp_path: Path) -> None:
    """With checkpoint.keep_best, a new record was written twice (best.pt and best-stepS.pt: two
    full checkpoints, seconds each for a large model); now best.pt is a hard link to the kept file.
    A later write or pruning of one name leaves the other whole."""
    bt = BestTracker(tmp_path, "max", keep=1)
    bt.update("model", 0.5, {"v": 0.5}, step=1)
    assert os.stat(tmp_path / "best.pt").st_ino == os.stat(tmp_path / "best-step1.pt").st_ino
    bt.update("model", 0.9, {"v": 0.9}, step=2)  # a new record: best-step1.pt is pruned, best.pt moves on
    assert files(tmp_path) == {"best.pt", "best-step2.pt"}
    assert os.stat(tmp_path / "best.pt").st_ino == os.stat(tmp_path / "best-step2.pt").st_ino
    assert load_checkpoint(tmp_path / "best.pt")["v"] == 0.9
    bt.update("model", 0.95, {"v": 0.95}, step=3)
    assert load_checkpoint(tmp_path / "best.pt")["v"] == 0.95 and files(tmp_path) == {"best.pt", "best-step3.pt"}
    atomic_save({"v": 0.0}, tmp_path / "best-step3.pt")  # a write of one name replaces only that name
    assert load_checkpoint(tmp_path / "best.pt")["v"] == 0.95


def test_best_tracker_keep_two_includes_non_record_runner_up(tmp_path: Path) -> None:
    bt = BestTracker(tmp_path, "max", keep=2)
    for step, v in enumerate([0.5, 0.9, 0.7], start=1):
        bt.update("model", v, {"v": v}, step=step)
    # the two best checkpoints are 0.9 (step 2) and 0.7 (step 3)
    assert files(tmp_path) == {"best.pt", "best-step2.pt", "best-step3.pt"}


def test_best_tracker_state_dict_round_trip(tmp_path: Path) -> None:
    bt = BestTracker(tmp_path, "max", keep=2)
    for step, v in enumerate([0.1, 0.2, 0.3], start=1):
        bt.update("model", v, {"v": v}, step=step)
    bt.update("ema", 0.25, {"v": 0.25}, step=3)
    atomic_save({"best": bt.state_dict()}, tmp_path / "last.pt")
    state = load_checkpoint(tmp_path / "last.pt")["best"]

    other = BestTracker(tmp_path, "max", keep=2)
    other.load_state_dict(state)
    assert other.best == bt.best == {"model": 0.3, "ema": 0.25}
    assert other.kept == bt.kept == [(0.3, "best-step3.pt"), (0.2, "best-step2.pt")]
    assert not other.update("model", 0.25, {"v": 0.25}, step=4)  # the loaded record holds
    assert not other.update("ema", 0.2, {"v": 0.2}, step=4)
    assert other.update("model", 0.35, {"v": 0.35}, step=5)
    # pruning continues from the loaded list: step 2 goes
    assert files(tmp_path) == {"best.pt", "best_ema.pt", "last.pt", "best-step3.pt", "best-step5.pt"}
    assert load_checkpoint(tmp_path / "best.pt")["v"] == 0.35
