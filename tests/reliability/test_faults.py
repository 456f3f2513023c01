"""Faults while training: a full disk or an unwritable run dir during a save, NaN/Inf from a
poisoned batch or a hook, running out of memory. Each ends in a clear error (or, under
`nonfinite=skip`, a completed run) and loses nothing already written."""
from __future__ import annotations

import errno
import io
import json
import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from toy_task import ToyTask, toy_config, train
from visiontrain.app import cli
from visiontrain.core import config as C
from visiontrain.engine.loop.trainer import Trainer
from visiontrain.engine.protocols.hooks import Hook
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.engine.state import files as files_module
from visiontrain.engine.state.checkpoint import CheckpointError, load_checkpoint
from visiontrain.engine.step.guards import NonFiniteLossError
from visiontrain.engine.step.precision import choose_precision

WORKER = Path(__file__).parent / "kill_worker.py"
EVERY_5 = dict(checkpoint__every=5, checkpoint__unit="steps")


def finite_checkpoints(run_dir: Path) -> dict[str, int]:
    """Every checkpoint on disk loads and holds finite weights; returns each one's step."""
    steps = {}
    for pt in sorted((run_dir / "checkpoints").glob("*.pt")):
        state = load_checkpoint(pt)
        assert all(torch.isfinite(v).all() for v in fmt.model_weights(state).values() if v.is_floating_point()), pt
        steps[pt.name] = fmt.step_of(state)
    return steps


# ---------------------------------------------------------------- full disk, unwritable run dir
def test_a_full_disk_during_a_save_is_a_clear_error_and_keeps_the_previous_checkpoint(run_dir, monkeypatch):
    real_save, calls = torch.save, []

    def save_until_the_disk_fills(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) < 3:
            return real_save(obj, f, *args, **kwargs)
        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[:1000])  # part of the file, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files_module.torch, "save", save_until_the_disk_fills)
    with pytest.raises(CheckpointError, match=r"^could not write checkpoint \S+/checkpoints/last\.pt: the disk is "
                                              r"full \(No space left on device; \d+ MiB free on that file system\); "
                                              r"the previous last\.pt is intact, and nothing of this write was left "
                                              r"behind$"):
        train(toy_config(**EVERY_5), run_dir)
    # last.pt at step 5 and best.pt at 8 (the epoch's evaluation) are whole; last.pt at 10 failed
    assert finite_checkpoints(run_dir) == {"last.pt": 5, "best.pt": 8}
    assert not list(run_dir.rglob(".*.tmp"))


def test_a_real_write_failure_names_the_file_not_the_zip_writer(tmp_path):
    """A real failed write (a file-size limit, EFBIG, as a full disk gives ENOSPC): torch.save
    raises its zip writer's RuntimeError; the user sees which file and why, and resume works."""
    recipe = tmp_path / "toy.yaml"
    recipe.write_text(C.dump_config(toy_config(trainer__max_steps=12, **EVERY_5)))
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(WORKER), str(recipe), str(run)]
    first = subprocess.run([*cmd, json.dumps({"phase": "step", "n": 8})], capture_output=True, text=True, env=env)
    assert first.returncode == -signal.SIGKILL and load_checkpoint(run / "checkpoints" / "last.pt")

    def small_files_only() -> None:  # checkpoints are > 4 kB; the logs written before them are not
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    proc = subprocess.run([*cmd, json.dumps({"phase": "none"})], capture_output=True, text=True, env=env,
                          preexec_fn=small_files_only)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert re.search(r"could not write checkpoint \S+(last|best)\.pt: the file would exceed the file-size limit "
                     r"\(ulimit -f\) \(File too large; \d+ MiB free on that file system\); (the previous last\.pt is "
                     r"intact|the checkpoints already there \(last\.pt\) are intact), and nothing of this write was "
                     r"left behind",
                     proc.stderr), proc.stderr[-2000:]
    assert finite_checkpoints(run) == {"last.pt": 5} and not list(run.rglob(".*.tmp"))


def test_an_unwritable_run_dir_is_refused_before_training_and_during_a_save(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match=r"run dir .*a-file/run cannot be written: .*choose another --run-dir"):
        Trainer(toy_config(), ToyTask(toy_config()), blocker / "run")

    run_dir = tmp_path / "run"
    real_mkstemp, calls = files_module.tempfile.mkstemp, []

    def mkstemp_denied_from_the_third(*args, **kwargs):
        if kwargs.get("prefix", "").startswith(".write-check."):  # the run dir's check before training
            return real_mkstemp(*args, **kwargs)
        calls.append(1)
        if len(calls) >= 3:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), kwargs.get("dir"))
        return real_mkstemp(*args, **kwargs)

    monkeypatch.setattr(files_module.tempfile, "mkstemp", mkstemp_denied_from_the_third)
    recipe = tmp_path / "toy.yaml"
    recipe.write_text(C.dump_config(toy_config(**EVERY_5)))
    assert cli.main(["fit", str(recipe), "--run-dir", str(run_dir)]) == cli.EXIT_USAGE
    assert re.search(r"could not write checkpoint .*last\.pt: permission denied; the previous last\.pt is intact",
                     capsys.readouterr().err)
    assert finite_checkpoints(run_dir) == {"last.pt": 5, "best.pt": 8}


# ---------------------------------------------------------------- NaN / Inf
def sample_of_step(step: int, **overrides) -> int:
    """A training sample that the batch of optimizer step ``step`` (epoch 0) holds, from the
    sampler's own order: poisoning it poisons that step."""
    cfg = toy_config(**overrides)
    probe = Trainer(cfg, ToyTask(cfg), None)
    probe.run.source.sampler.set_epoch(0)
    return list(probe.run.source.sampler)[step - 1][0]


class WeightsAround(Hook):
    """Records the weights before and after each step."""

    def __init__(self) -> None:
        self.before: dict[int, list[torch.Tensor]] = {}
        self.after: dict[int, list[torch.Tensor]] = {}

    def before_step(self) -> None:
        self.before[self.trainer.step + 1] = [p.detach().clone() for p in self.trainer.raw_model.parameters()]

    def after_step(self) -> None:
        self.after[self.trainer.step] = [p.detach().clone() for p in self.trainer.raw_model.parameters()]


def test_a_poisoned_batch_under_raise_names_the_step_and_terms_and_writes_nothing_after_it(run_dir):
    bad = 7
    cfg = toy_config(task__poison_sample=sample_of_step(bad), trainer__log_every=3, **EVERY_5)
    with pytest.raises(NonFiniteLossError, match=rf"non-finite loss at step {bad} \(epoch 0\) in mse, l1, "
                                                 r"mean_out, l1_w, total: mse=nan"):
        train(cfg, run_dir)
    assert finite_checkpoints(run_dir) == {"last.pt": 5}  # and none from step 7 on


def test_a_poisoned_batch_under_skip_leaves_the_weights_untouched_and_the_run_completes(run_dir):
    bad, probe = 6, WeightsAround()
    cfg = toy_config(task__poison_sample=sample_of_step(bad), trainer__nonfinite="skip", **EVERY_5)
    trainer = Trainer(cfg, ToyTask(cfg), run_dir, hooks=[probe])
    summary = trainer.fit()
    assert summary["skipped_steps"] == cfg.trainer.epochs  # the sample comes once per epoch
    assert all(torch.equal(a, b) for a, b in zip(probe.before[bad], probe.after[bad]))
    assert not all(torch.equal(a, b) for a, b in zip(probe.before[bad + 1], probe.after[bad + 1]))
    assert finite_checkpoints(run_dir)["last.pt"] == trainer.clock.total_steps


class InfGradientAt(Hook):
    """Poisons one gradient with Inf during the backward of step ``k`` (its loss stays finite),
    through a tensor hook: what an overflowing custom op or a bad layer does."""

    def __init__(self, k: int) -> None:
        self.k = k

    def before_train(self) -> None:
        param = next(self.trainer.raw_model.parameters())
        param.register_hook(lambda g: torch.full_like(g, float("inf")) if self.trainer.step + 1 == self.k else g)


@pytest.mark.parametrize("clip", [None, 10.0])
def test_an_inf_gradient_under_raise_never_reaches_a_checkpoint(run_dir, clip):
    cfg = toy_config(trainer__clip_grad=clip, trainer__log_every=1, **EVERY_5)
    # without a gradient norm the NaN weights surface in the next step's loss; with one, at once
    expected = r"non-finite gradient norm at step 7 .* in grad_norm" if clip else r"non-finite loss at step 8"
    with pytest.raises(NonFiniteLossError, match=expected):
        Trainer(cfg, ToyTask(cfg), run_dir, hooks=[InfGradientAt(7)]).fit()
    assert finite_checkpoints(run_dir) == {"last.pt": 5}


def test_weights_that_became_non_finite_are_never_saved(run_dir):
    """A NaN that reaches the weights while every logged loss is finite (a hook writing them)."""
    class PoisonWeightsAt(Hook):
        def after_step(self) -> None:
            if self.trainer.step == 10:  # just before the checkpoint at step 10
                with torch.no_grad():
                    next(self.trainer.raw_model.parameters())[0, 0] = float("nan")

    cfg = toy_config(**EVERY_5)
    with pytest.raises(NonFiniteLossError, match=r"weights became non-finite between step 8 and step 10 .*0\.weight"):
        Trainer(cfg, ToyTask(cfg), run_dir, hooks=[PoisonWeightsAt()]).fit()
    assert finite_checkpoints(run_dir) == {"last.pt": 5, "best.pt": 8}


def test_an_inf_gradient_under_skip_is_skipped(run_dir):
    cfg, probe = toy_config(trainer__nonfinite="skip"), WeightsAround()
    summary = Trainer(cfg, ToyTask(cfg), run_dir, hooks=[InfGradientAt(7), probe]).fit()
    assert summary["skipped_steps"] == 1
    assert all(torch.equal(a, b) for a, b in zip(probe.before[7], probe.after[7]))


class Overflowing(ToyTask):
    """A loss whose fp16 gradients overflow at GradScaler's initial scale (65536) and fit once the
    scaler has lowered it a few times."""

    def losses(self, model, batch):
        x, y, _ = batch
        return {"sum": model(x).sum() * 4.0}


def test_fp16_overflow_is_skipped_and_counted_not_raised(run_dir):
    snaps = []

    class Snap(Hook):
        def before_step(self):
            snaps.append({k: v.clone() for k, v in self.trainer.raw_model.state_dict().items()})

    cfg = toy_config(trainer__precision="fp16", trainer__max_steps=16, trainer__log_every=4,
                     task__loss_weights={"sum": 1.0}, optim__lr=1e-4, trainer__epochs=2)
    t = Trainer(cfg, Overflowing(cfg), run_dir, hooks=[Snap()])
    summary = t.fit()  # trainer.nonfinite=raise: an overflow is not a failure
    n = summary["fp16_overflow_skips"]
    assert 1 <= n < 15 and summary["skipped_steps"] == 0
    assert t.run.scaler.get_scale() == 65536.0 / 2**n  # halved once per overflow
    same = [all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(snaps, snaps[1:])]
    assert same[:n] == [True] * n and not any(same[n:])  # the first n steps were skipped, no others
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert fmt.entry(state, fmt.SCALER)["scale"] == 65536.0 / 2**n


# ---------------------------------------------------------------- out of memory
@pytest.mark.parametrize("phase", ["training", "evaluation"])
def test_out_of_memory_names_the_batch_size_and_what_to_lower(tmp_path, monkeypatch, capsys, phase):
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.1 GiB total)")

    recipe = tmp_path / "toy.yaml"
    recipe.write_text(C.dump_config(toy_config(**EVERY_5)))
    calls, fine = [], 6 if phase == "training" else 1  # the 7th step, the 2nd evaluation
    real = ToyTask.losses if phase == "training" else ToyTask.evaluate
    monkeypatch.setattr(ToyTask, "losses" if phase == "training" else "evaluate",
                        lambda *a: oom() if calls.append(1) or len(calls) > fine else real(*a))
    assert cli.main(["fit", str(recipe), "--run-dir", str(tmp_path / "run")]) == cli.EXIT_OUT_OF_MEMORY
    err = capsys.readouterr().err
    assert f"out of memory on cpu during {phase} at step" in err and "Tried to allocate 20.00 GiB" in err
    if phase == "training":
        assert "lower data.batch_size (now 32 per process) and raise trainer.accum_steps (now 1)" in err
        # the advice to lower the precision only where the run computes in fp32 (auto picks bf16 on a CPU with
        # AVX512-BF16 or AMX: nothing left to lower there)
        computed = choose_precision(toy_config().trainer.precision, torch.device("cpu")).precision
        assert ("or set trainer.precision=bf16" in err) == (computed == "fp32"), (computed, err)
        assert "last checkpoint" in err and "--resume auto" in err
    else:
        assert "lower data.eval_batch_size (now 64 per process)" in err
