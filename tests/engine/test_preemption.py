"""Preemption: SIGTERM / SIGUSR1 to a training run (the main process and its DataLoader worker,
as a scheduler signals the whole job) -> last.pt written, exit code 4; --resume auto then ends with
weights bit-identical to an uninterrupted run. Ctrl-C (SIGINT to the terminal's process group) does
the same with exit code 130; a second Ctrl-C stops at once."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.engine.state.checkpoint import load_checkpoint
from visiontrain.core.exit_codes import EXIT_PREEMPTED

from procs import finish, popen

# 480 of the digits' 1,437 training images: 30 steps of 16 an epoch, so that a stop lands mid-epoch and
# the resumed run crosses an epoch's end (and its evaluation and new order) before it ends.
ARGS = ["classify-fashion", "data.name=digits", "data.limit_train=480", "data.batch_size=16", "data.augment=basic",
        "data.num_workers=1", "trainer.epochs=3", "trainer.log_every=5", "trainer.threads=1", "trainer.progress=plain",
        "checkpoint.every=1", "eval.every=1", "task.drop_rate=0.2", "optim.lr=0.003",
        "trainer.plots=false"]  # the figures at the end cost about 2 s of CPU a run; not the subject


def start(run_dir: Path, *options: str, overrides: tuple[str, ...] = ()) -> subprocess.Popen:
    return popen([sys.executable, "-m", "visiontrain", "fit", *ARGS, *overrides, "--run-dir", str(run_dir),
                  *options])  # its own process group, like a job


def logged_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return max(steps, default=0)


def signalled(run: Path, at_step: int, sig: int, *options: str, overrides: tuple[str, ...] = ()) -> tuple[
        subprocess.Popen, str, str]:
    """A run started, then ``sig`` to its whole process group (the run and its DataLoader workers, as
    a scheduler or a terminal signals a job) once it has logged ``at_step``; its output at the end."""
    proc = start(run, *options, overrides=overrides)
    deadline = time.time() + 300
    while logged_step(run) < at_step and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the run ended before it could be signalled"
    os.killpg(proc.pid, sig)
    out, err = finish(proc, 240)
    return proc, out, err


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("full") / "run"
    proc = start(run)
    _, err = finish(proc, 240)
    assert proc.returncode == 0, err[-3000:]
    return run


def test_every_stop_signal_sets_the_flag_the_loop_reads():
    """SIGTERM and SIGUSR1 go through one handler into one flag; the run below shows what the loop
    does with it (one full run: the signal that reaches the flag makes no difference after it)."""
    from visiontrain.engine.parts.preemption import StopFlag
    from visiontrain.core.stop_signals import STOP_SIGNALS

    assert set(STOP_SIGNALS) == {signal.SIGTERM, signal.SIGUSR1, signal.SIGINT}
    for sig in STOP_SIGNALS:
        flag = StopFlag()
        flag.install()
        try:
            os.kill(os.getpid(), sig)
            deadline = time.time() + 5
            while not flag.requested and time.time() < deadline:  # the handler runs between bytecodes
                time.sleep(0.01)
        finally:
            flag.restore()
        assert flag.requested and flag.name == sig.name
        assert signal.getsignal(sig) is not flag._handle  # restored after the run


def test_a_second_ctrl_c_stops_at_once():
    from visiontrain.engine.parts.preemption import StopFlag

    flag = StopFlag()
    flag.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert flag.requested  # the first: finish the step, write last.pt
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    finally:
        flag.restore()


def test_ctrl_c_writes_last_in_one_line_and_exits_130(tmp_path):
    """What a terminal sends its foreground job: SIGINT to every process of the group (the run and its
    DataLoader worker). No KeyboardInterrupt traceback, one line, last.pt at the step it stopped."""
    run = tmp_path / "run"
    proc, out, err = signalled(run, 10, signal.SIGINT)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    lines = [line for line in (out + err).splitlines() if "stopped by" in line]
    assert len(lines) == 1 and lines[0].startswith("visiontrain: stopped by SIGINT at step "), lines
    stopped_at = int(lines[0].split("at step ")[1].split()[0])
    assert fmt.step_of(load_checkpoint(run / "checkpoints" / "last.pt")) == stopped_at >= 10


def test_stop_signal_writes_last_and_resume_is_exact(uninterrupted, tmp_path):
    sig = signal.SIGTERM
    run = tmp_path / "run"
    proc, out, err = signalled(run, 20, sig)
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert f"stopped by {sig.name}" in err and "--resume auto" in err
    assert (out + err).count("stopped by") == 1, err[-3000:]  # said once
    state = load_checkpoint(run / "checkpoints" / "last.pt")  # the newest checkpoint loads
    stopped_at = fmt.step_of(state)
    assert 20 <= stopped_at < 3 * (480 // 16)
    assert not (run / "model.safetensors").exists()  # the run did not finish

    resumed = start(run, "--resume", "auto")
    out, err = finish(resumed, 240)
    assert resumed.returncode == 0, err[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'last.pt'} at step {stopped_at}" in out
    a, b = load_file(str(uninterrupted / "model.safetensors")), load_file(str(run / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_ranks_agree_to_stop_at_a_log_point_and_resume_exactly(tmp_path):
    """fit --nproc 2 (torchrun, gloo): the whole process group gets SIGTERM; the ranks agree at the
    next log point, each rank writes its shards of last.pt, and the resumed run equals an
    uninterrupted one. Under FSDP: the agreement does not depend on the strategy, and a replicated
    last.pt at a stop is the single-process test's (DDP writes it the same way, from rank 0)."""
    # 640 images: 20 steps of 2 x 16 an epoch; signalled at step 10, the ranks stop mid-epoch at 15
    TWO = ("trainer.epochs=2", "distributed.strategy=fsdp", "data.limit_train=640")
    full = tmp_path / "full"
    proc = start(full, "--nproc", "2", overrides=TWO)
    _, err = finish(proc, 240)
    assert proc.returncode == 0, err[-3000:]

    run = tmp_path / "run"
    proc, out, err = signalled(run, 10, signal.SIGTERM, "--nproc", "2", overrides=TWO)
    assert proc.returncode != 0 and "stopped by SIGTERM" in out + err, err[-3000:]
    stopped_at = fmt.step_of(load_checkpoint(run / "checkpoints" / "last.pt"))
    assert stopped_at % 5 == 0 and 10 <= stopped_at < 2 * (640 // 32)  # a log point (log_every=5)
    proc = start(run, "--nproc", "2", "--resume", "auto", overrides=TWO)
    out, err = finish(proc, 240)
    assert proc.returncode == 0, err[-3000:]
    a, b = load_file(str(full / "model.safetensors")), load_file(str(run / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    files = sorted(p.name for p in run.iterdir() if p.is_file())
    assert files == ["config.yaml", "metrics.jsonl", "model.safetensors", "model_summary.json", "provenance.json",
                     "report.html", "summary.json"]  # rank 0 only
