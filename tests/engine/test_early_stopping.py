"""eval.patience: evaluations without an improvement end the run, resume-safe, said in summary.json."""
from __future__ import annotations

import json

import pytest

from procs import run_cli
from toy_task import ToyTask, toy_config, train
from visiontrain.core.config import ConfigError
from visiontrain.engine.loop.trainer import Trainer

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


# A metric that peaks while the lr still rises (evaluation 0), dips, then climbs for the rest of the run:
# what a one-cycle schedule does early on. Patience counted from the start stops it at the dip.
RISING = [5.0, 1.0, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.5, 6.0]
WARMUP_3_EPOCHS = {"lr": {"shape": "cosine", "warmup": 3, "unit": "epochs"}}  # 24 steps


def test_patience_after_the_warmup_ignores_the_evaluations_before_it(tmp_path):
    stopped = train(scripted(task__scripted=RISING, eval__patience=1, schedules=WARMUP_3_EPOCHS), tmp_path / "a")
    assert stopped.step == 2 * 8  # the dip at step 16 ends a run counted from its first evaluation
    watched = train(scripted(task__scripted=RISING, eval__patience=1, eval__patience_after="warmup",
                             schedules=WARMUP_3_EPOCHS), tmp_path / "b")
    assert watched.early_stop.start == 24 and watched.step == 10 * 8  # steps 8 and 16 were not watched
    assert watched.early_stop.best == 6.0 and watched.early_stop.best_step == 80
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["ended"]["reason"] == "epochs"


def test_patience_after_a_position_in_eval_unit_and_the_stop_says_from_where(run_dir):
    falls = [5.0, 1.0, 2.0, 1.5, 1.2, 1.1, 1.0, 0.9, 0.8, 0.7]
    trainer = train(scripted(task__scripted=falls, eval__patience=2, eval__patience_after=2), run_dir)
    # watched from epoch 2 (step 16): best 2.0 at step 24, then two evaluations without improvement
    assert trainer.early_stop.start == 16 and trainer.step == 5 * 8
    message = json.loads((run_dir / "summary.json").read_text())["ended"]["message"]
    assert "(eval.patience=2, counted from step 16; best 2 at step 24)" in message
    steps = train(scripted(task__scripted=falls, eval__patience=2, eval__patience_after=20, eval__unit="steps",
                           eval__every=8), None)
    assert steps.early_stop.start == 20 and steps.step == 5 * 8  # in steps: watched from the evaluation at step 24


def test_patience_after_must_be_a_position_or_warmup():
    with pytest.raises(ConfigError, match="eval.patience_after: expected float or 'warmup', got 'warmpu'"):
        toy_config(eval__patience_after="warmpu")
    with pytest.raises(ConfigError, match=r"eval.patience_after: expected a number >= 0, got -1"):
        toy_config(eval__patience_after=-1)
    assert toy_config(eval__patience_after="warmup").eval.patience_after == "warmup"
