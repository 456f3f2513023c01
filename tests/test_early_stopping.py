"""eval.patience: evaluations without an improvement end the run, resume-safe, said in summary.json."""
from __future__ import annotations

import json

import pytest

from procs import run_cli
from toy_task import ToyTask, toy_config, train
from visiontrain.config import ConfigError
from visiontrain.engine.trainer import Trainer

# 256 samples / batch 32 = 8 steps an epoch, one evaluation an epoch. The scripted metric (max)
# improves at evaluations 0, 1 and 2, then not by more than min_delta=0.1 (2.05), then falls.
SCRIPT = [1.0, 2.0, 3.0, 3.05, 2.0, 2.5, 2.9, 2.8, 2.7, 2.6]


def scripted(**overrides):
    settings = dict(trainer__epochs=10, optim__lr=0.005, eval__metric="scripted", eval__mode="max", eval__patience=3,
                    eval__min_delta=0.1, task__scripted=SCRIPT)
    return toy_config(**{**settings, **overrides})


def test_patience_stops_the_run_after_evaluations_without_improvement(run_dir, capsys):
    trainer = train(scripted(), run_dir)
    # best 3.0 at evaluation 2 (epoch 2, step 24); evaluations 3, 4, 5 do not beat 3.1: stop after 5
    assert trainer.step == 6 * 8 and trainer.early_stop.fired()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ended"]["reason"] == "early_stopping"
    assert "scripted did not improve by more than 0.1 in 3 evaluations" in summary["ended"]["message"]
    assert "best 3 at step 24" in summary["ended"]["message"]
    assert "stopping: early stopping" in capsys.readouterr().out
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["scripted"] for r in evals if r["kind"] == "eval"] == SCRIPT[:6]  # no evaluation after the stop


def test_a_run_without_patience_trains_every_epoch(run_dir):
    trainer = train(scripted(eval__patience=0), run_dir)
    assert trainer.step == 10 * 8
    assert json.loads((run_dir / "summary.json").read_text())["ended"]["reason"] == "epochs"


def test_patience_resumes_where_it_counted(tmp_path):
    whole = train(scripted(), tmp_path / "whole")
    # the same run cut after 4 epochs (one evaluation without improvement counted), then resumed
    cut = train(scripted(trainer__max_steps=4 * 8), tmp_path / "cut")
    assert cut.early_stop.since_best == 1
    assert json.loads((tmp_path / "cut" / "summary.json").read_text())["ended"]["reason"] == "max_steps"
    resumed = train(scripted(), tmp_path / "cut", resume=str(tmp_path / "cut" / "checkpoints" / "last.pt"))
    assert resumed.step == whole.step == 6 * 8
    assert resumed.early_stop.state_dict() == whole.early_stop.state_dict()


def test_a_run_that_stopped_early_resumes_with_more_patience(tmp_path):
    train(scripted(), tmp_path / "run")
    last = str(tmp_path / "run" / "checkpoints" / "last.pt")
    again = Trainer(scripted(), ToyTask(scripted()), tmp_path / "run", resume=last)
    assert again.done() and again.step == 6 * 8  # same patience: nothing more to train (the CLI says so)
    more = train(scripted(eval__patience=5), tmp_path / "run", resume=last)
    assert more.step == 8 * 8  # evaluations 6 and 7 also fail to beat 3.1: five in a row


def test_patience_needs_a_metric_the_task_reports(run_dir):
    with pytest.raises(KeyError, match="eval.metric='nope'"):
        train(toy_config(eval__metric="nope", eval__patience=2), None)
    with pytest.raises(ConfigError, match="eval.min_delta: expected a number >= 0"):
        toy_config(eval__min_delta=-1.0)


def test_patience_from_the_command_line(tmp_path):
    """`visiontrain fit ... eval.patience=1` as a user runs it; a min_delta no epoch can beat makes the
    second evaluation the last. Resumed as it is, the run has nothing to train and says why."""
    run = tmp_path / "run"
    args = ["fit", "classify-fashion", "data.name=digits", "trainer.epochs=6", "eval.patience=1",
            "eval.min_delta=100", "--run-dir", str(run)]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["ended"]["reason"] == "early_stopping" and summary["epochs"] == 2, summary["ended"]
    assert "stopping: early stopping: top1 did not improve by more than 100" in proc.stdout
    again = run_cli(*args, "--resume", "auto")
    assert again.returncode == 0 and "nothing to train (raise eval.patience" in again.stdout, again.stderr[-2000:]
