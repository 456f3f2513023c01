"""`trainer.profile=true` writes a torch.profiler trace of the chosen steps; `visiontrain benchmark`
times a recipe's steps (samples/s, data wait vs compute, peak memory) and writes nothing."""
from __future__ import annotations

import json

import pytest
import torch

from procs import cli_here, run_cli
from toy_task import toy_config, train


def test_profile_writes_a_trace_of_the_window(run_dir):
    train(toy_config(trainer__profile=True, trainer__profile_start=2, trainer__profile_steps=3), run_dir)
    trace = json.loads((run_dir / "profile" / "trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("addmm" in n or "linear" in n for n in names)  # the MLP's forward is in it
    assert any("Optimizer.step" in n for n in names)            # and the optimizer step
    summary = (run_dir / "profile" / "summary.txt").read_text()
    assert summary.startswith("steps 3..5 (trainer.profile_start=2)") and "Self CPU" in summary


def test_profile_window_longer_than_the_run_still_writes(run_dir):
    train(toy_config(trainer__max_steps=6, trainer__profile=True, trainer__profile_start=4,
                     trainer__profile_steps=50), run_dir)
    assert (run_dir / "profile" / "summary.txt").read_text().startswith("steps 5..6")


@pytest.mark.parametrize("synthetic", [False, True])
def test_benchmark_reports_throughput_split_and_memory_and_writes_nothing(tmp_path, synthetic):
    proc = run_cli("benchmark", "classify-fashion", "data.name=digits", "data.batch_size=32", "data.augment=basic",
                   "--steps", "6", "--warmup", "2", *(["--synthetic"] if synthetic else []), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    r = json.loads(lines[-1])
    assert r["steps"] == 6 and r["samples_per_s"] > 0 and r["peak_host_rss_mib"] > 100
    assert r["step_ms"] == pytest.approx(r["data_wait_ms"] + r["compute_ms"])
    assert (r["data_wait_ms"] == 0.0) == synthetic  # replaying the first batch loads nothing
    assert any(line.strip().startswith("samples/s") for line in lines)
    assert list(tmp_path.iterdir()) == []  # no run dir, no checkpoint


def test_benchmark_init_starts_the_timed_steps_from_those_weights(classify_checkpoint):
    """`benchmark --init CKPT` (as `fit --init`): its first step starts from the checkpoint's weights."""
    from visiontrain.core import config as C
    from visiontrain.app.benchmark import run_benchmark
    from visiontrain.engine.protocols.hooks import Hook
    from safetensors.torch import load_file
    from visiontrain.tasks import build_task

    class FirstWeights(Hook):
        def before_step(self) -> None:
            if self.trainer.step == 0:
                self.weights = {k: v.detach().clone() for k, v in self.trainer.raw_model.state_dict().items()}

    saved = load_file(classify_checkpoint.parent.parent / "model.safetensors")  # the run's final weights
    cfg = C.load_config("classify-fashion", ["data.name=digits", "data.batch_size=8"])
    seen = FirstWeights()
    r = run_benchmark(cfg, build_task(cfg), steps=1, warmup=0, synthetic=True, hooks=[seen], init=str(classify_checkpoint))
    assert r["steps"] == 1 and seen.weights.keys() == saved.keys()
    assert all(torch.equal(seen.weights[k], saved[k]) for k in saved)
    fresh = FirstWeights()
    run_benchmark(C.load_config("classify-fashion", ["data.name=digits", "data.batch_size=8"]), build_task(cfg),
                  steps=1, warmup=0, synthetic=True, hooks=[fresh])
    assert not all(torch.equal(fresh.weights[k], saved[k]) for k in saved)  # without --init: not those weights


def test_benchmark_steps_are_the_runs_first_steps_with_its_schedules():
    """The lr of benchmark's steps is the run's at those steps (its warm-up): a detector trained at the
    full lr from step 1 diverged, and its steps then cost a third less than fit's."""
    from visiontrain.core import config as C
    from visiontrain.app.benchmark import run_benchmark
    from visiontrain.engine.protocols.hooks import Hook
    from visiontrain.tasks import build_task

    class Lrs(Hook):
        def __init__(self) -> None:
            self.lrs: list[float] = []

        def before_step(self) -> None:
            self.lrs.append(self.trainer.optimizer.param_groups[0]["lr"])

    cfg = C.load_config("classify-fashion", ["data.name=digits", "data.batch_size=8"])
    peak = cfg.optim.lr
    seen = Lrs()
    run_benchmark(cfg, build_task(cfg), steps=2, warmup=1, synthetic=True, hooks=[seen])
    # classify-fashion's one-cycle starts at the peak / 25 and rises: 3 steps of its 14 epochs
    assert len(seen.lrs) == 3 and seen.lrs[0] == pytest.approx(peak / 25, rel=1e-3), seen.lrs
    assert seen.lrs[0] < seen.lrs[1] < seen.lrs[2] < peak


def test_benchmark_refuses_a_bad_key(capfd):
    proc = cli_here("benchmark", "classify-fashion", "optim.lrr=1", capture=capfd)
    assert proc.returncode == 2 and "optim.lr" in proc.stderr
