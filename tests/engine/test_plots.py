"""Plots in the run dir: the curves of every logged scalar after each evaluation, the task's own
figures (a confusion matrix here; detections in test_yolo.py), the same images in TensorBoard."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

import procs
from toy_task import toy_config, train
from visiontrain.engine.records import plots as P


def _not_blank(path: Path) -> None:
    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] > 150 and pixels.shape[1] > 150, path
    assert pixels.std() > 0.03, f"{path} is a blank canvas"


def test_a_run_writes_every_curve_and_none_when_switched_off(tmp_path):
    run = tmp_path / "on"
    train(toy_config(ema__enabled=True, schedules__lr__shape="cosine", trainer__plots=True), run)
    names = sorted(p.name for p in (run / "plots").glob("*.png"))
    assert names == ["eval.png", "losses.png", "schedules.png", "throughput.png"]
    for path in (run / "plots").glob("*.png"):
        _not_blank(path)
    assert not list((run / "plots").glob(".*"))  # no temporary file left behind
    train(toy_config(trainer__plots=False), tmp_path / "off")
    assert not (tmp_path / "off" / "plots").exists()


def _records() -> tuple[list[dict], list[dict]]:
    train_rows = [{"kind": "train", "step": s, "epoch": 0, "time": 0.0, "loss_ce": 2.0 / s, "loss_ce_0": 2.1 / s,
                   "loss_ce_w": 4.0 / s, "loss_bbox": 1.0, "total": 3.0, "grad_norm": 1.0, "lr": 0.1,
                   "lr/backbone": 0.01, "lr/head": 0.1, "weight_decay": 0.05, "task.teacher_temp": 0.04,
                   "samples_per_s": 100.0, "data_s": 0.1, "compute_s": 0.9, "eta_s": 10.0}
                  for s in (1, 2, 3)]
    evals = [{"kind": "eval", "step": s, "epoch": 0, "time": 0.0, "top1": 50.0 + s, "ema/top1": 51.0 + s,
              "ema/knn": 10.0, "APl": math.nan} for s in (2, 3)]
    return train_rows, evals


def test_curves_put_each_logged_scalar_in_its_kind_of_panel():
    figures = P.curve_figures(*_records())
    assert sorted(figures) == ["eval", "losses", "schedules", "throughput"]

    def panels(name: str) -> list[list[str]]:
        return [[line.get_label() for line in ax.get_lines()] for ax in figures[name].axes if ax.get_visible()]

    # weighted copies (_w) are left out; auxiliary terms share their base term's panel
    assert panels("losses") == [["loss_ce", "loss_ce_0"], ["loss_bbox"], ["total"], ["grad_norm"]]
    assert panels("schedules") == [["lr/backbone", "lr/head"], ["weight_decay"], ["task.teacher_temp"]]
    assert panels("throughput") == [["samples_per_s"], ["data_wait_share"]]
    assert panels("eval") == [["top1", "ema/top1"], ["APl"], ["ema/knn"]]  # EMA next to the model
    wait = figures["throughput"].axes[1].get_lines()[0].get_ydata()
    assert list(wait) == pytest.approx([0.1, 0.1, 0.1])
    texts = [t.get_text() for t in figures["eval"].axes[1].texts]
    assert texts == ["no finite value"]


def test_a_line_cut_short_by_a_kill_is_passed_over(tmp_path):
    train_rows, evals = _records()
    text = "".join(json.dumps(r) + "\n" for r in train_rows + evals)
    (tmp_path / "metrics.jsonl").write_text(text + '{"kind": "train", "step": 4, "lo')
    written = P.write_curves(tmp_path)
    assert sorted(p.name for p in written) == ["eval.png", "losses.png", "schedules.png", "throughput.png"]


def test_the_benchmark_figure_is_drawn_from_the_same_rows(tmp_path):
    import sys

    train_rows, evals = _records()
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train_rows + evals))
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "plot_run.py"
    out = tmp_path / "curves.png"
    proc = procs.run([sys.executable, script, tmp_path, "--out", out])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(out)
    _not_blank(out)


def test_evaluations_close_together_are_drawn_once_and_the_last_always(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(P, "write_curves", lambda run_dir: calls.append(run_dir) or [])
    trainer = SimpleNamespace(step=1, clock=SimpleNamespace(total_steps=3),
                              task=SimpleNamespace(eval_figures=lambda: {}))
    hook = P.PlotHook(tmp_path, min_interval_s=3600)
    hook.trainer = trainer
    hook.after_eval({})  # a hook that has not seen before_train yet draws at once
    assert len(calls) == 1
    hook.before_train()
    hook.after_eval({})  # within the interval of the start, not the last: skipped
    trainer.step = 2
    hook.after_eval({})
    assert len(calls) == 1
    trainer.step = 3
    hook.after_eval({})  # the last evaluation of the run
    assert len(calls) == 2
    hook.min_interval_s = 0.0
    trainer.step = 2
    hook.after_eval({})  # the interval has passed
    assert len(calls) == 3


def test_a_plot_that_fails_is_logged_and_training_goes_on(tmp_path, caplog):
    (tmp_path / "metrics.jsonl").write_text("")
    hook = P.PlotHook(tmp_path)

    def broken() -> dict:
        raise RuntimeError("no figure today")

    hook.trainer = SimpleNamespace(step=1, clock=SimpleNamespace(total_steps=1), task=SimpleNamespace(eval_figures=broken))
    hook.after_eval({})
    assert "no figure today" in caplog.text and str(tmp_path / "plots") in caplog.text


@pytest.fixture(scope="module")
def fashion_run(tmp_path_factory):
    from visiontrain.core import config as C
    from visiontrain.engine.loop.trainer import Trainer
    from visiontrain.tasks import build_task

    cfg = C.load_config("classify-fashion", ["data.limit_train=256", "data.limit_val=200", "trainer.epochs=1",
                                             "trainer.log_every=4", "data.batch_size=64"])
    run = tmp_path_factory.mktemp("fashion") / "run"
    trainer = Trainer(cfg, build_task(cfg), run)
    trainer.fit()
    return trainer, run


def test_classification_draws_its_confusion_matrix_from_the_evaluation(fashion_run):
    trainer, run = fashion_run
    counts = trainer.task.confusion
    assert counts.shape == (10, 10) and int(counts.sum()) == 200
    final = json.loads((run / "summary.json").read_text())["final"]
    assert 100.0 * float(counts.diag().sum()) / 200 == pytest.approx(final["top1"])
    per_class = list(final["per_class"].values())  # the same counts, read per class
    assert [r["support"] for r in per_class] == counts.sum(1).tolist()
    assert [r["recall"] for r in per_class] == pytest.approx((counts.diag() / counts.sum(1)).tolist())
    _not_blank(run / "plots" / "confusion_matrix.png")
    fig = trainer.task.eval_figures()["confusion_matrix"]
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()][:2] == ["T-shirt/top", "Trouser"]


def test_the_figures_go_to_tensorboard_as_images(fashion_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run = fashion_run
    events = EventAccumulator(str(run / "tb"), size_guidance={"images": 0}).Reload()
    assert "figures/confusion_matrix" in events.Tags()["images"]
    image = events.Images("figures/confusion_matrix")[-1]
    assert image.width > 200 and image.height > 200
    assert "train/total" in events.Tags()["scalars"] and "eval/top1" in events.Tags()["scalars"]


def test_class_names_in_any_script_are_drawn_without_a_warning(tmp_path):
    """A confusion matrix of classes named in German and Chinese: DejaVu Sans has ü but no CJK, which
    matplotlib once drew as empty boxes with a "Glyph ... missing" warning per character and redraw.
    The CJK names now fall back to an installed font that has them, else to matplotlib's Last Resort font."""
    import warnings

    import numpy as np
    from matplotlib.text import Text

    from visiontrain.evaluation.figures import confusion_figure, pr_curves_figure

    names = ["Müller", "猫", "北京 dog"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        fig = confusion_figure(np.array([[3, 1, 0], [0, 2, 1], [1, 0, 4]]), names)
        P.save_figure(fig, tmp_path / "confusion.png")
        recall = np.linspace(0, 1, 11)
        P.save_figure(pr_curves_figure(recall, {n: 1 - recall for n in names}, {n: 0.5 for n in names}, title="pr"),
                      tmp_path / "pr.png")
    _not_blank(tmp_path / "confusion.png")
    _not_blank(tmp_path / "pr.png")
    labels = {t.get_text(): t.get_fontfamily() for t in fig.findobj(Text) if t.get_text() in names}
    assert labels["Müller"] == ["sans-serif"]  # its own font has every letter: left as it was
    assert labels["猫"][0] == "DejaVu Sans" and labels["猫"][-1] == "Last Resort High-Efficiency"  # matplotlib's
