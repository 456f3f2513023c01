"""How input-bound a run is, as the user sees it: each log line's ``data NN%``, summary.json's
``data_wait_share`` and one hint line when a window (not a launch's first) waits for data more than
a fifth of its time. The runs are the toy task with its time put where the test wants it: a loader
that sleeps 5 ms a sample (40 ms a batch, against a step of about a millisecond), or a step that
sleeps 20 ms (against well under a millisecond of loading): far from the 20 % line either way."""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from procs import cli_here
from toy_task import ToyConfig, ToyData, ToyTask, toy_config, train
from visiontrain.core.config import doc
from visiontrain.engine.loop.trainer import Trainer
from visiontrain.engine.records.run_log import INPUT_BOUND, RunLogger, input_bound_hint
from visiontrain.engine.protocols.task import TaskData, register_task
from visiontrain.rundir.metrics_file import COMPUTE_S, DATA_S, SAMPLES_PER_S

HINT = "waiting for data"
SHARE = re.compile(r"  data (\d+)%  ")


@dataclass
class PacedConfig(ToyConfig):
    name: str = doc("task name", "paced")
    sample_sleep: float = doc("seconds each training sample's loading waits", 0.0)
    slow_samples: int = doc("how many of the first samples loaded wait (-1: all)", -1)
    step_sleep: float = doc("seconds each training step waits", 0.0)


class PacedData(ToyData):
    """ToyData whose first ``slow`` loads (all, with -1) each sleep ``sleep`` seconds."""

    def __init__(self, n: int, dim: int, sleep: float, slow: int) -> None:
        super().__init__(n, dim, False, 1)
        self.sleep, self.slow, self.loads = sleep, slow, 0

    def __getitem__(self, i: int) -> Any:
        if self.slow < 0 or self.loads < self.slow:
            time.sleep(self.sleep)
        self.loads += 1
        return super().__getitem__(i)


class PacedTask(ToyTask):
    name = "paced"

    def build_data(self) -> TaskData:
        t = self.cfg.task
        return TaskData(PacedData(t.samples, t.dim, t.sample_sleep, t.slow_samples), ToyData(16, t.dim, False, 2),
                        {"dim": t.dim})

    def losses(self, model: Any, batch: Any) -> dict[str, Any]:
        if model.training:
            time.sleep(self.cfg.task.step_sleep)
        return super().losses(model, batch)


@pytest.fixture
def paced() -> None:
    register_task("paced", PacedTask, PacedConfig)  # the registries are put back after each test


def recipe(path: Path, **task: Any) -> Path:
    """96 samples in batches of 8, in this process (no workers): 12 steps, a log line every 3."""
    path.write_text(yaml.safe_dump({
        "task": {"name": "paced", "samples": 96, **task}, "data": {"batch_size": 8, "num_workers": 0},
        "optim": {"name": "sgd", "lr": 0.01},
        # fp32 and no plots: not the subject, and plots cost 2 s of CPU a run
        "trainer": {"epochs": 1, "log_every": 3, "progress": "plain", "precision": "fp32", "plots": False},
        "eval": {"every": 0}, "checkpoint": {"every": 0}}))
    return path


def fit(tmp_path: Path, capsys: pytest.CaptureFixture, **task: Any) -> tuple[dict[str, Any], list[float], str, str]:
    """``visiontrain fit`` of the paced recipe: (summary.json, the train rows' data shares, stdout,
    report.html)."""
    run = tmp_path / "run"
    done = cli_here("fit", str(recipe(tmp_path / "paced.yaml", **task)), "--run-dir", str(run), capture=capsys)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    shares = [r["data_s"] / (r["data_s"] + r["compute_s"]) for r in rows if r["kind"] == "train"]
    return json.loads((run / "summary.json").read_text()), shares, done.stdout, (run / "report.html").read_text()


def test_a_slow_loader_is_in_the_summary_and_the_log_with_one_hint(tmp_path, capsys, paced):
    summary, shares, out, report = fit(tmp_path, capsys, sample_sleep=0.005)
    # the second window also holds the first log point's own work (metrics.jsonl opened, the trackers)
    assert len(shares) == 4 and shares[0] > 0.5 and sum(s > INPUT_BOUND for s in shares[1:]) >= 2
    assert summary["data_wait_share"] > INPUT_BOUND
    assert out.count(HINT) == 1  # once, though more than one window is above the line
    hint = next(line for line in out.splitlines() if HINT in line)
    assert "raise data.num_workers (now 0)" in hint and "visiontrain benchmark" in hint
    assert out.index(HINT) > out.index("step 6/12")  # not after the first window: after the second at the earliest
    # the log lines carry each window's share, as metrics.jsonl has it
    logged = [int(m) for m in SHARE.findall(out)]
    assert len(logged) == 4 and all(abs(n - 100 * s) <= 1 for n, s in zip(logged, shares))
    assert "data-wait share" in report and report.count(HINT) == 1  # the report says it too


def test_a_fast_loader_gets_no_hint(tmp_path, capsys, paced):
    summary, shares, out, report = fit(tmp_path, capsys, step_sleep=0.02)
    share = summary["data_wait_share"]
    assert isinstance(share, float) and 0.0 <= share < INPUT_BOUND
    assert HINT not in out and HINT not in report
    assert len(SHARE.findall(out)) == 4


def test_a_slow_first_window_alone_gets_no_hint(tmp_path, capsys, paced):
    """A launch's first window holds the workers' start-up and the first batch: it never hints."""
    _, shares, out, report = fit(tmp_path, capsys, sample_sleep=0.05, slow_samples=8, step_sleep=0.02)
    assert shares[0] > 0.5 and max(shares[1:]) < INPUT_BOUND
    assert HINT not in out and HINT not in report


def test_the_share_resumes_and_an_older_checkpoint_still_loads(tmp_path):
    run = tmp_path / "run"
    before = train(toy_config(trainer__epochs=1), run).parts["log_point"]
    assert before.logged_s > before.wait_s > 0
    cfg = toy_config(trainer__epochs=2)
    resumed = Trainer(cfg, ToyTask(cfg), run, resume=str(run / "checkpoints/last.pt"))
    point = resumed.parts["log_point"]
    assert (point.wait_s, point.logged_s) == (before.wait_s, before.logged_s)  # from the checkpoint
    resumed.fit()
    assert point.logged_s > before.logged_s  # the run's windows: the first launch's and this one's
    assert json.loads((run / "summary.json").read_text())["data_wait_share"] == point.data_wait_share()
    state = point.state_dict()
    del state["wait_s"], state["logged_s"]  # a checkpoint written before the share was kept
    point.load_state_dict(state)
    assert point.data_wait_share() is None and point.skipped == 0


def test_the_hint_is_one_short_line():
    line = input_bound_hint(0.34, 1)
    assert line.startswith("waiting for data 34 % of the step time: raise data.num_workers (now 1)")
    assert "\n" not in line and len(line) < 240


def test_a_plain_log_line_shows_the_window_s_data_share_before_the_eta(tmp_path, capsys):
    log = RunLogger(tmp_path, total_steps=100, progress="plain")
    log.log("train", 10, 0, {"total": 2.5, "lr": 3e-3, SAMPLES_PER_S: 2030.66, DATA_S: 0.34, COMPUTE_S: 0.66,
                             "eta_s": 65.0})
    log.log("train", 20, 0, {"total": 2.5, "lr": 3e-3, "eta_s": 65.0})  # a row without the window's times
    log.close()
    first, second = capsys.readouterr().out.splitlines()
    assert first.endswith("samples_per_s 2031  data 34%  eta 01:05")
    assert " data " not in second
