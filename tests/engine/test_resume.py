"""Exact resume: "fit to N" and "fit to k, crash, --resume auto to N" give bit-identical weights,
with shuffling, random augmentation, mixup, dropout and DataLoader workers on. The tests marked
``cuda`` hold on a GPU too, with deterministic kernels (tests/support/devices.py): the CUDA random streams
are in the checkpoint, and the workers start beside a CUDA context."""
from __future__ import annotations

import json

import pytest
import torch

from crashes import Crash, CrashAt
from devices import deterministic_kernels
from resume_checks import assert_bit_identical, fit_and_crash_resume, state_of
from toy_task import ToyTask, toy_config
from visiontrain.core import config as C
from visiontrain.engine.loop.trainer import Trainer


def classification_cfg(workers: int) -> C.Config:
    return C.load_config("classify-fashion", [
        "data.name=digits", "data.batch_size=32", "data.augment=basic", f"data.num_workers={workers}",
        "task.mixup_alpha=0.2", "task.cutmix_alpha=1.0", "task.mix_off_epochs=1", "task.drop_rate=0.3",
        "task.label_smoothing=0.1", "trainer.epochs=3", "trainer.log_every=7", "trainer.channels_last=false",
        "ema.enabled=true", "ema.decay=0.9", "checkpoint.every=5", "checkpoint.unit=steps",
        "eval.every=1", "eval.unit=epochs", "optim.lr=0.002"])


@pytest.fixture
def deterministic():
    with deterministic_kernels():
        yield


@pytest.mark.cuda
@pytest.mark.parametrize("workers", [0, 2])
def test_mid_epoch_resume_is_bit_exact(tmp_path, workers, deterministic):
    cfg = classification_cfg(workers)
    # 1437 train digits / 32 = 44 steps per epoch; crash at 50 (after the checkpoint at 50, mid-epoch 1)
    # and resume; the resumed run goes through an epoch-end evaluation and the mix switch-off.
    full, resumed = fit_and_crash_resume(cfg, tmp_path, crash_at=50, position=(50, 1, 6))
    assert resumed.step == full.step == 132
    assert_bit_identical(state_of(full), state_of(resumed))
    # the optimizer state and best metrics match too
    for a, b in zip(full.optimizer.state.values(), resumed.optimizer.state.values()):
        for key in a:
            assert torch.equal(torch.as_tensor(a[key]), torch.as_tensor(b[key]))
    assert full.checkpointer.best.best == resumed.checkpointer.best.best


@pytest.mark.cuda
def test_a_set_kept_on_the_device_resumes_bit_exact(tmp_path, deterministic):
    """data.on_device=true: the set's batches are made where it lies (on the CPU here, through the
    same code; on a GPU in its memory), each sample's crop drawn from its own seed."""
    cfg = C.load_config("classify-fashion", [  # digits: "basic" crops each sample (a mirrored digit is another)
        "data.name=digits", "data.batch_size=32", "data.augment=basic", "data.on_device=true",
        "task.mixup_alpha=0.2", "task.drop_rate=0.3", "trainer.epochs=2", "trainer.log_every=7",
        "checkpoint.every=5", "checkpoint.unit=steps", "optim.lr=0.002"])
    assert cfg.data.num_workers == "auto"  # as shipped: auto gives 0 for a set held in memory
    full, resumed = fit_and_crash_resume(cfg, tmp_path, crash_at=50, position=(50, 1, 6))
    assert resumed.step == full.step == 88
    placed = full.run.source.loader.dataset.dataset  # under the SeededDataset: random transforms
    assert placed.stacked and placed.images.device == full.run.device
    assert_bit_identical(state_of(full), state_of(resumed))


@pytest.mark.cuda
def test_resume_at_epoch_boundary_and_with_accumulation(tmp_path, deterministic):
    cfg = toy_config(data__batch_size=16, trainer__accum_steps=2, trainer__epochs=3, task__noise=True,
                     task__dropout=0.2, checkpoint__every=1, checkpoint__unit="epochs",
                     optim__name="adamw", optim__lr=0.01, trainer__nonfinite="skip")
    full = Trainer(cfg, ToyTask(cfg), tmp_path / "a")
    full.fit()
    crashed = Trainer(cfg, ToyTask(cfg), tmp_path / "b", hooks=[CrashAt(8)])  # 8 steps/epoch
    with pytest.raises(Crash):
        crashed.fit()
    resumed = Trainer(cfg, ToyTask(cfg), tmp_path / "b", resume=str(tmp_path / "b/checkpoints/last.pt"))
    assert (resumed.step, resumed.epoch, resumed.step_in_epoch) == (8, 1, 0)
    resumed.fit()
    assert_bit_identical(state_of(full), state_of(resumed))


class EventRecorder:
    """A tracker (engine.records.tracking) that keeps the (kind, step) of every event it is handed."""

    packages = ()

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def start(self, config, provenance, step) -> None:
        pass

    def log(self, kind, step, epoch, values) -> None:
        self.events.append((kind, step))

    def end(self, status) -> None:
        pass


def logged_rows(run_dir) -> list[tuple[str, int]]:
    from visiontrain.rundir.metrics_file import METRICS_FILE

    return [(row["kind"], row["step"]) for row in map(json.loads, (run_dir / METRICS_FILE).read_text().splitlines())]


def test_a_step_checkpoint_on_an_epochs_last_step_then_a_kill_logs_each_evaluation_once(tmp_path):
    """8 steps per epoch and a step checkpoint every 4: the one at step 8 is also the epoch's end,
    where the epoch's evaluation runs. The run dies right after that checkpoint (before step 9) and
    resumes: the evaluation at step 8 must be in metrics.jsonl and the trackers once, and run once."""
    cfg = toy_config(trainer__epochs=3, checkpoint__every=4, checkpoint__unit="steps")
    full = Trainer(cfg, ToyTask(cfg), tmp_path / "full")
    full.fit()
    tracker = EventRecorder()
    crashed = Trainer(cfg, ToyTask(cfg), tmp_path / "run", hooks=[CrashAt(9)], trackers=[tracker])
    with pytest.raises(Crash):
        crashed.fit()
    resumed = Trainer(cfg, ToyTask(cfg), tmp_path / "run", resume=str(tmp_path / "run/checkpoints/last.pt"),
                      trackers=[tracker])
    position = (resumed.step, resumed.epoch, resumed.step_in_epoch)
    resumed.fit()
    rows = logged_rows(tmp_path / "run")
    assert [r for r in rows if r[0] == "eval"] == [("eval", 8), ("eval", 16), ("eval", 24)]
    assert len(rows) == len(set(rows)) and rows == logged_rows(tmp_path / "full")
    assert sorted(tracker.events) == sorted(set(tracker.events)) == sorted(rows)
    assert resumed.task.evaluations == full.task.evaluations == 3
    assert position == (8, 1, 0)  # the checkpoint was written after the epoch's evaluation
    assert_bit_identical(state_of(full), state_of(resumed))


def test_detr_with_its_fast_options_resumes_bit_exact(tmp_path, mosaic_coco):
    """detect-detr as shipped (focal loss, two-stage, groups, denoising copies drawn from the RNG,
    deformable attention, bf16, one worker), crashed after step 4's checkpoint and resumed. Not
    marked ``cuda``: the deformable attention's grid_sample has no deterministic CUDA backward
    (torch.use_deterministic_algorithms refuses it), so on a GPU only the CPU's bit-exactness holds."""
    root = mosaic_coco(8, 2)
    # a tiny transformer (and 6 steps) keeps the test fast; the options under test are the recipe's
    small = ["task.hidden_dim=32", "task.dim_feedforward=64", "task.enc_layers=1", "task.num_queries=6"]
    cfg = C.load_config("detect-detr", small + [
        "data.name=coco", f"data.root={root}", "data.batch_size=2", "trainer.max_steps=6", "trainer.log_every=3",
        "task.train_scales=[96]", "task.val_size=96", "task.max_size=128", "task.crop_resize=[96]",
        "task.crop_min=64", "task.crop_max=96", "eval.every=0", "checkpoint.every=2", "checkpoint.unit=steps",
        "trainer.progress=plain"])
    full, resumed = fit_and_crash_resume(cfg, tmp_path, crash_at=4)
    assert resumed.step == full.step == 6
    assert_bit_identical(state_of(full), state_of(resumed))


# Another training, as `visiontrain fit` holds its run dir: the run dir's lock, held until stdin closes.
HOLD_THE_LOCK = ("import sys; from pathlib import Path; from visiontrain.rundir.run_lock import held\n"
                 "with held(Path(sys.argv[1])):\n    print('held', flush=True); sys.stdin.read()")
IS_FREE = "import sys; from pathlib import Path; from visiontrain.rundir.run_lock import check_free; check_free(Path(sys.argv[1]))"


def test_a_script_keeps_the_cli_s_one_writer_per_run_dir(tmp_path):
    """Two trainings in one run dir interleave their metrics and overwrite each other's checkpoints.
    A Trainer from Python is refused a run dir another training holds, in the CLI's words, writing
    nothing; and while it exists and trains it holds the run dir itself, until ``fit`` ends."""
    import subprocess
    import sys

    cfg = toy_config(trainer__epochs=1)
    run = tmp_path / "run"
    other = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, run], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        with pytest.raises(C.ConfigError, match=f"run dir {run} is in use by another training \\(pid {other.pid} "):
            Trainer(cfg, ToyTask(cfg), run)
        assert [p.name for p in run.iterdir()] == [".lock"]  # nothing written
    finally:
        other.communicate("", timeout=30)

    def free() -> bool:  # asked by another process, as a second `visiontrain fit` asks
        return subprocess.run([sys.executable, "-c", IS_FREE, run], capture_output=True, timeout=60).returncode == 0

    trainer = Trainer(cfg, ToyTask(cfg), run)
    assert not free()
    trainer.fit()
    assert free() and not (run / ".lock").exists()


def test_a_script_keeps_the_cli_s_run_dir_rules(tmp_path):
    """``Trainer(cfg, task, RUN_DIR).fit()`` again from Python on a finished run dir started over and
    overwrote the run (its checkpoints, summary, a second run appended to metrics.jsonl). It is refused
    now as `fit` refuses it, through the same code, and ``resume="auto"`` finds the run at its end and
    trains and rewrites nothing."""
    cfg = toy_config(trainer__epochs=1)
    run = tmp_path / "run"
    Trainer(cfg, ToyTask(cfg), run).fit()
    files = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(C.ConfigError, match=r"already holds a run .*nothing was overwritten"):
        Trainer(cfg, ToyTask(cfg), run)
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files  # nothing written
    again = Trainer(cfg, ToyTask(cfg), run, resume="auto")
    summary = again.fit()
    assert again.nothing_to_train and summary == json.loads((run / "summary.json").read_text())
    kept = [run / "summary.json", run / "metrics.jsonl", *(run / "checkpoints").iterdir()]
    assert all(p.read_bytes() == files[p] for p in kept)
    with pytest.raises(C.ConfigError, match="resume='auto' continues the run in a run dir"):
        Trainer(cfg, ToyTask(cfg), None, resume="auto")
