"""Every schedulable scalar reaches what it controls, step by step."""
from __future__ import annotations

import pytest
from torch import nn

from toy_task import ToyTask, toy_config
from visiontrain.engine.loop.trainer import Trainer
from visiontrain.engine.protocols.hooks import Hook


class Probe(Hook):
    def __init__(self, read) -> None:
        self.read, self.seen = read, []

    def after_backward(self) -> None:
        self.seen.append(self.read(self.trainer))


def run(read, **overrides):
    cfg = toy_config(trainer__epochs=1, **overrides)
    probe = Probe(read)
    Trainer(cfg, ToyTask(cfg), None, hooks=[probe]).fit()
    return probe.seen


def test_weight_decay_schedule_only_touches_decayed_group():
    seen = run(lambda t: [(g["decay"], g["weight_decay"]) for g in t.optimizer.param_groups],
               optim__weight_decay=0.04, schedules={"weight_decay": {"shape": "linear", "end": 0.4}})
    # 8 steps, linear 0.04 -> 0.4: step 4 is 0.04 + 0.36 * 4/8
    assert [dict(s)[True] for s in seen] == pytest.approx([0.04 + 0.36 * i / 8 for i in range(8)])
    assert all(dict(s)[False] == 0.0 for s in seen)


def test_momentum_schedule_sets_adam_beta1_and_sgd_momentum():
    seen = run(lambda t: t.optimizer.param_groups[0]["betas"], optim__name="adamw",
               schedules={"momentum": {"shape": "linear", "base": 0.85, "end": 0.95}})
    assert [b[0] for b in seen] == pytest.approx([0.85 + 0.1 * i / 8 for i in range(8)])
    assert all(b[1] == 0.999 for b in seen)
    seen = run(lambda t: t.optimizer.param_groups[0]["momentum"], optim__name="sgd",
               schedules={"momentum": {"shape": "multistep", "base": 0.9, "milestones": [4], "gamma": 0.5}})
    assert seen == pytest.approx([0.9] * 4 + [0.45] * 4)


def test_loss_weight_schedule_changes_the_total(run_dir):
    import json

    cfg = toy_config(trainer__epochs=1, trainer__log_every=1,
                     schedules={"loss.l1": {"shape": "linear", "base": 0.0, "end": 1.0}})
    Trainer(cfg, ToyTask(cfg), run_dir).fit()
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["kind"] == "train"]
    for i, r in enumerate(rows):  # weight of l1 at step i is i/8; mse keeps weight 1
        assert r["total"] == pytest.approx(r["mse"] + r["l1"] * i / 8, rel=1e-5)
        assert r["loss.l1"] == pytest.approx(i / 8)


def test_ema_decay_and_bn_momentum_and_task_scalar_schedules():
    class BnToy(ToyTask):
        temperature = 0.04

        def build_model(self, info):
            return nn.Sequential(nn.Linear(info["dim"], 8), nn.BatchNorm1d(8), nn.Linear(8, 1))

    cfg = toy_config(trainer__epochs=1, ema__enabled=True, schedules={
        "ema_decay": {"shape": "cosine", "base": 0.996, "end": 1.0},
        "bn_momentum": {"shape": "constant", "base": 0.01},
        "task.temperature": {"shape": "linear", "end": 0.07, "warmup": 0}})
    probe = Probe(lambda t: (t.ema.decay, t.raw_model[1].momentum, t.task.temperature))
    Trainer(cfg, BnToy(cfg), None, hooks=[probe]).fit()
    import math

    assert [s[0] for s in probe.seen] == pytest.approx(
        [1.0 + (0.996 - 1.0) * (1 + math.cos(math.pi * i / 8)) / 2 for i in range(8)])
    assert all(s[1] == 0.01 for s in probe.seen)
    assert [s[2] for s in probe.seen] == pytest.approx([0.04 + 0.03 * i / 8 for i in range(8)])


def test_a_warmup_longer_than_the_run_is_a_warning_and_trains(caplog):
    """A step budget below a warmup is a normal request (a smoke run): one line per schedule, and
    the values stay on the warmup ramp to the end."""
    seen = run(lambda t: (t.optimizer.param_groups[0]["lr"], t.ema.decay), trainer__max_steps=3,
               ema__enabled=True, schedules={
                   "lr": {"shape": "cosine", "warmup": 2, "unit": "epochs"},  # 2 epochs of 8 steps = 16
                   "ema_decay": {"shape": "constant", "base": 0.99, "warmup": 10, "warmup_start": 0.9}})
    assert [lr for lr, _ in seen] == pytest.approx([0.05 * i / 16 for i in range(3)])
    assert [decay for _, decay in seen] == pytest.approx([0.9 + 0.09 * i / 10 for i in range(3)])
    lines = [r.getMessage() for r in caplog.records if "warmup" in r.getMessage()]
    assert lines == [
        "visiontrain: warning: schedules.lr.warmup (2 epochs = 16 steps) is longer than the run (3 steps): "
        "lr stays in its warmup to the end",
        "visiontrain: warning: schedules.ema_decay.warmup (10 steps) is longer than the run (3 steps): "
        "ema_decay stays in its warmup to the end"]


def test_unknown_scalar_is_an_error():
    with pytest.raises(ValueError, match="schedules.lrr: unknown scalar"):
        cfg = toy_config(schedules={"lrr": {"shape": "constant"}})
        Trainer(cfg, ToyTask(cfg), None)


def test_lr_scaled_by_global_batch():
    cfg = toy_config(optim__lr=0.1, optim__base_batch=256, trainer__accum_steps=2)
    t = Trainer(cfg, ToyTask(cfg), None)
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 64 / 256)  # 32 x 2 micro-batches


def test_a_warmup_lengthened_to_warmup_min_steps_is_said_once(caplog):
    """A quarter epoch of 8 steps is 2 steps; warmup_min_steps makes it 10, longer than this 3-step run."""
    with caplog.at_level("INFO", logger="visiontrain"):
        seen = run(lambda t: t.optimizer.param_groups[0]["lr"], trainer__max_steps=3, schedules={
            "lr": {"shape": "cosine", "warmup": 0.25, "unit": "epochs", "warmup_min_steps": 10}})
    assert seen == pytest.approx([0.05 * i / 10 for i in range(3)])
    lines = [r.getMessage() for r in caplog.records if "warmup" in r.getMessage()]
    assert lines == [
        "visiontrain: schedules.lr.warmup (0.25 epochs = 2 steps) is shorter than schedules.lr.warmup_min_steps: "
        "lr warms up over 10 steps",
        "visiontrain: warning: schedules.lr.warmup (0.25 epochs = 2 steps, lengthened to warmup_min_steps=10) is "
        "longer than the run (3 steps): lr stays in its warmup to the end"]
