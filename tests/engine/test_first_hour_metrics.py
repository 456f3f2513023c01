"""A user's first hour, no surprise: strict JSON in the run files (null, never NaN), one scale per
kind of metric (percentages 0-100, AP 0-1), and plain log lines that read the same all run (a
timestamp, one number format per quantity, long summaries wrapped)."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from toy_task import ToyTask, toy_config
from visiontrain.engine.loop.trainer import Trainer
from visiontrain.engine.step.eval_loop import EvalData

STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ")


def strict_loads(text: str) -> Any:
    """json.loads as a strict parser (JavaScript's JSON.parse, jq, Go) reads: no NaN/Infinity."""
    def refuse(token: str) -> Any:
        raise ValueError(f"{token} is not JSON")
    return json.loads(text, parse_constant=refuse)


# ---------------------------------------------------------------- item 13: null, never NaN
def test_dumps_json_writes_null_for_every_non_finite_float():
    from visiontrain.engine.records.run_log import dumps_json

    value = {"AP": 0.5, "APs": math.nan, "per_class": [1.0, math.inf, {"x": -math.inf}], "pair": (2, math.nan),
             "n": 3, "name": "run", "none": None}
    assert strict_loads(dumps_json(value)) == {"AP": 0.5, "APs": None, "per_class": [1.0, None, {"x": None}],
                                               "pair": [2, None], "n": 3, "name": "run", "none": None}
    assert strict_loads(dumps_json({"a": 1}, indent=2)) == {"a": 1}
    with pytest.raises(TypeError):  # anything else that is not JSON still refuses, as json.dumps does
        dumps_json({"t": object()})


class UndefinedAPTask(ToyTask):
    """The toy task with COCO's undefined APs (no small objects in the set): NaN in evaluation."""

    def evaluate(self, model: nn.Module, data: EvalData) -> dict[str, float]:
        return {**super().evaluate(model, data), "APs": math.nan}


def test_a_run_writes_metrics_and_summary_that_strict_parsers_read(run_dir):
    cfg = toy_config(trainer__max_steps=4, trainer__log_every=2, trainer__plots=False)
    Trainer(cfg, UndefinedAPTask(cfg), run_dir).fit()
    rows = [strict_loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals and all(r["APs"] is None and math.isfinite(r["mse"]) for r in evals)
    summary = strict_loads((run_dir / "summary.json").read_text())
    assert summary["final"]["APs"] is None and math.isfinite(summary["final"]["mse"])


def _null_run(path: Path) -> Path:
    """A run dir as dumps_json writes it: an undefined metric is null."""
    path.mkdir()
    rows = [{"kind": "train", "step": s, "epoch": 0, "time": 0.0, "total": 1.0 / s, "samples_per_s": 10.0,
             "data_s": 0.1, "compute_s": 0.9} for s in (1, 2)]
    rows += [{"kind": "eval", "step": 2, "epoch": 0, "time": 0.0, "AP": 0.25, "APs": None}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "summary.json").write_text(json.dumps({"steps": 2, "epochs": 1, "wall_s": 1.0, "samples_per_s": 10.0,
                                                   "final": {"AP": 0.25, "APs": None}, "best": {"model": 0.25},
                                                   "metric": "AP", "mode": "max"}))
    return path


def test_readers_take_null_as_a_missing_value(tmp_path):
    from visiontrain.report.compare import read_run, table_rows
    from visiontrain.rundir.metrics_file import UNDEFINED, read_metrics
    from visiontrain.engine.records.plots import curve_figures
    from visiontrain.report.page import build_report

    run = _null_run(tmp_path / "run")
    train, evals = read_metrics(run / "metrics.jsonl")
    assert math.isnan(evals[0]["APs"])
    fig = curve_figures(train, evals)["eval"]
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["AP", "APs"]  # the undefined metric keeps its panel
    assert [t.get_text() for t in panels[1].texts] == ["no finite value"]
    record = read_run(run)
    assert math.isnan(record.evals[0]["APs"]) and math.isnan(record.summary["final"]["APs"])
    assert table_rows([record])[1][0][3] == UNDEFINED  # run, steps, AP, APs: the dash, as the log's tables
    html = build_report(run)
    assert "None" not in html and "<th>APs</th><td class=\"num\">—</td>" in html  # as the log's tables


# ---------------------------------------------------------------- item 14: one scale per kind
def _classification_task(classes: int):
    from visiontrain.core import config as C
    from visiontrain.tasks import build_task

    task = build_task(C.load_config("classify-fashion", ["data.name=digits"]))
    task.num_classes = classes
    return task


def test_training_acc_is_in_percent_like_the_evaluation_top1():
    task = _classification_task(10)
    x, y = torch.eye(10)[:8], torch.arange(8)
    out = task.losses(nn.Identity(), (x, y))  # logits = one-hot of the label: every sample right
    assert out["acc"].item() == pytest.approx(100.0)
    out = task.losses(nn.Identity(), (x, (y + 1) % 10))  # every sample wrong
    assert out["acc"].item() == pytest.approx(0.0)
    m = task.evaluate(nn.Identity(), EvalData.local([(x, y)]))
    assert m["top1"] == pytest.approx(100.0) and m["top5"] == pytest.approx(100.0)


def test_top5_is_reported_from_six_classes_up():
    for classes, has_top5 in ((2, False), (5, False), (6, True)):
        task = _classification_task(classes)
        logits = torch.eye(classes)[[0, 1, 1]]
        m = task.evaluate(nn.Identity(), EvalData.local([(logits, torch.tensor([0, 1, 0]))]))
        assert ("top5" in m) is has_top5, (classes, m)
        assert m["top1"] == pytest.approx(200 / 3)


def test_eval_png_draws_training_acc_on_the_top1_panel():
    from visiontrain.engine.records.plots import curve_figures

    train = [{"kind": "train", "step": s, "epoch": 0, "ce": 1.0 / s, "acc": 40.0 + s, "total": 1.0 / s, "lr": 0.1}
             for s in (1, 2, 3, 4)]
    evals = [{"kind": "eval", "step": s, "epoch": 0, "top1": 50.0 + s, "ema/top1": 49.0 + s, "loss": 0.5}
             for s in (2, 4)]
    fig = curve_figures(train, evals)["eval"]
    lines = [[line.get_label() for line in ax.get_lines()] for ax in fig.axes if ax.get_visible()]
    assert lines == [["top1", "ema/top1", "train/acc"], ["loss"]]
    acc = fig.axes[0].get_lines()[2]
    assert list(acc.get_xdata()) == [1, 2, 3, 4] and list(acc.get_ydata()) == [41.0, 42.0, 43.0, 44.0]


# ---------------------------------------------------------------- item 18: plain log lines
def _plain_logger(tmp_path: Path):
    from visiontrain.engine.records.run_log import RunLogger

    return RunLogger(tmp_path, total_steps=100, progress="plain")


def test_plain_train_lines_keep_one_format_per_quantity(tmp_path, capsys):
    log = _plain_logger(tmp_path)
    for step, lr, total in ((10, 3e-3, 2.5), (20, 3.696e-4, 0.000123)):
        log.log("train", step, 0, {"total": total, "lr": lr, "samples_per_s": 2030.66, "eta_s": 65.0})
    log.log("eval", 20, 0, {"top1": 91.756, "ema/top1": 91.0, "AP": 0.5, "loss": 0.25})
    log.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(STAMP.match(line) for line in lines), lines
    assert "lr 3.000e-03" in lines[0] and "lr 3.696e-04" in lines[1]  # not 0.0030 then 3.696e-04
    assert "total 2.5000" in lines[0] and "total 0.0001" in lines[1]
    assert "samples_per_s 2031 " in lines[0] + " "  # samples/s: a whole number
    assert "top1 91.76" in lines[2] and "ema/top1 91.00" in lines[2] and "AP 0.5000" in lines[2]


def test_format_value_is_chosen_by_the_quantity():
    from visiontrain.engine.records.run_log import format_value

    assert format_value("lr", 3e-3) == "3.000e-03" and format_value("lr/backbone", 1e-5) == "1.000e-05"
    assert format_value("samples_per_s", 12.4) == "12" and format_value("acc", 87.5) == "87.50"
    assert format_value("class_error", 12.345) == "12.35" and format_value("ema/knn_top1", 5.0) == "5.00"
    assert format_value("loss_giou", 1.23456) == "1.2346" and format_value("APs", math.nan) == "nan"
    assert format_value("skipped_steps", 3) == "3" and format_value("wall_s", 118.34) == "118.34"


DETR_TERMS = ["loss_ce", "loss_bbox", "loss_giou", "loss_ce_0", "loss_bbox_0", "loss_giou_0", "loss_ce_w",
              "loss_bbox_w", "loss_giou_w", "class_error", "cardinality_error", "cardinality_error_0", "total",
              "grad_norm"]


def test_a_fourteen_term_epoch_summary_wraps_under_the_width(tmp_path, capsys):
    log = _plain_logger(tmp_path)
    rows = {k: 1.234567 * (i + 1) for i, k in enumerate(DETR_TERMS)}
    rows.update({"lr": 1e-4, "lr/backbone": 1e-5, "samples_per_s": 12.3, "data_s": 0.5, "skipped_steps": 0})
    log.table("epoch 3 train", rows)
    log.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 2 and max(len(line) for line in lines) <= 100, lines
    assert STAMP.match(lines[0]) and "epoch 3 train:" in lines[0]
    assert all(line.startswith(" " * 20) and line.strip() for line in lines[1:])  # continuation lines
    text = " ".join(lines)
    assert all(f"{k} " in text for k in rows)  # nothing lost, no item cut in two


def test_the_terminal_bar_still_shows_progress_and_tables(tmp_path, capsys):
    from visiontrain.engine.records.run_log import RunLogger

    log = RunLogger(tmp_path, total_steps=10, progress="bar")
    log.log("train", 5, 0, {"total": 0.5, "lr": 3e-3, "samples_per_s": 100.0, "eta_s": 3.0})
    log.table("epoch 0 train", {"total": 0.5, "acc": 87.5})
    log.print("a message")
    log.close()
    out = capsys.readouterr().out
    assert "epoch 0 train" in out and "87.50" in out and "a message" in out and "5/10" in out
