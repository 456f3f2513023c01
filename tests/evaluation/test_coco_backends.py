"""faster-coco-eval (the default COCO backend) gives what pycocotools gives: the six stats, the
per-class table, the PR curves and the precision / recall arrays behind them, to 1e-12, on the
evaluation fixtures of tests/evaluation/test_evaluation.py and on randomized cases (crowd regions, empty
images, categories without ground truth or without detections, small / medium / large boxes)."""
from __future__ import annotations

import copy
import json
import logging
import math
import sys

import numpy as np
import pytest
from detection_helpers import coco_detections, coco_truth
from spies import calls_of

from visiontrain.evaluation.coco import COCO_BACKENDS, CocoEvaluation, coco_api, coco_evaluation

TOLERANCE = 1e-12


def _random_case(seed: int) -> tuple[dict, list[dict]]:
    """A small COCO set drawn from ``seed``: some images without boxes, crowd regions, one category
    without ground truth, one never detected, boxes from 4 to 300 px a side (every area range);
    detections are jittered copies of the ground truth (some dropped) plus random boxes, random scores."""
    rng = np.random.default_rng(seed)
    n_images, n_cats = int(rng.integers(3, 12)), int(rng.integers(2, 7))
    cat_ids = sorted(rng.choice(np.arange(1, 40), size=n_cats, replace=False).tolist())
    no_gt, no_dets = cat_ids[0], cat_ids[-1]
    images = [{"id": i + 1, "width": 640, "height": 480} for i in range(n_images)]
    anns = []
    for img in images:
        for _ in range(int(rng.integers(0, 8)) if rng.random() > 0.2 else 0):
            w, h = np.exp(rng.uniform(np.log(4), np.log(300), size=2))
            x, y = rng.uniform(0, 640 - w), rng.uniform(0, 480 - h)
            anns.append({"id": len(anns) + 1, "image_id": img["id"], "category_id": int(rng.choice(cat_ids[1:])),
                         "bbox": [float(x), float(y), float(w), float(h)], "area": float(w * h),
                         "iscrowd": int(rng.random() < 0.1)})
    dets = []
    for a in anns:
        if rng.random() < 0.8 and a["category_id"] != no_dets:
            x, y, w, h = a["bbox"]
            jitter = rng.normal(0, 0.1, size=4) * [w, h, w, h]
            dets.append({"image_id": a["image_id"], "category_id": a["category_id"],
                         "bbox": [x + jitter[0], y + jitter[1], max(w + jitter[2], 1.0), max(h + jitter[3], 1.0)],
                         "score": float(rng.random())})
    for _ in range(int(rng.integers(0, 4 * n_images))):
        w, h = np.exp(rng.uniform(np.log(4), np.log(300), size=2))
        dets.append({"image_id": int(rng.integers(1, n_images + 1)), "category_id": int(rng.choice(cat_ids[:-1])),
                     "bbox": [float(rng.uniform(0, 600)), float(rng.uniform(0, 440)), float(w), float(h)],
                     "score": float(rng.random())})
    dets = [{**d, "bbox": [float(v) for v in d["bbox"]]} for d in dets]
    cats = [{"id": c, "name": f"class {c}"} for c in rng.permutation(cat_ids).tolist()]
    assert not any(a["category_id"] == no_gt for a in anns)
    return {"images": images, "annotations": anns, "categories": cats}, dets


def differences(a: CocoEvaluation, b: CocoEvaluation, tol: float = TOLERANCE) -> list[str]:
    """Where two evaluations differ by more than ``tol`` (NaN equals NaN): every metric, every
    per-class cell, every PR curve, the full precision / recall arrays; [] when they agree."""
    out = []

    def close(x: float, y: float) -> bool:
        return (math.isnan(x) and math.isnan(y)) or abs(x - y) <= tol

    out += [f"metric {k}: {a.metrics[k]} vs {b.metrics[k]}" for k in a.metrics if not close(a.metrics[k], b.metrics[k])]
    if list(a.metrics) != list(b.metrics) or a.category_ids != b.category_ids or a.names != b.names:
        out.append("different keys, categories or names")
    rows_a, rows_b = a.per_class(), b.per_class()
    out += [f"per_class {n} {c}: {rows_a[n][c]} vs {rows_b[n][c]}" for n in rows_a for c in rows_a[n]
            if not close(rows_a[n][c], rows_b[n][c])]
    curves_a, curves_b = a.pr_curves(0.5), b.pr_curves(0.5)
    if list(curves_a) != list(curves_b):
        out.append(f"PR curves of {list(curves_a)} vs {list(curves_b)}")
    for name in set(curves_a) & set(curves_b):
        if not np.allclose(curves_a[name], curves_b[name], rtol=0, atol=tol):
            out.append(f"PR curve of {name}")
    for field in ("precision", "recall", "iou_thresholds", "recall_thresholds"):
        x, y = getattr(a, field), getattr(b, field)
        if x.shape != y.shape or not np.allclose(x, y, rtol=0, atol=tol):
            out.append(f"{field} arrays")
    return out


def _both(gt: dict, dets: list[dict]) -> tuple[CocoEvaluation, CocoEvaluation]:
    return tuple(coco_evaluation(copy.deepcopy(gt), copy.deepcopy(dets), backend=b)  # type: ignore[return-value]
                 for b in ("faster-coco-eval", "pycocotools"))


def test_the_backends_are_the_two_libraries_and_faster_coco_eval_is_the_default():
    """A check that both names do not silently run the same code (the equality below would then be empty)."""
    assert COCO_BACKENDS[0] == "faster-coco-eval"
    assert coco_api("faster-coco-eval")[1].__module__.startswith("faster_coco_eval")
    assert coco_api("pycocotools")[1].__module__.startswith("pycocotools")
    with pytest.raises(ValueError, match=r"COCO backend 'detectron2': expected one of faster-coco-eval, pycocotools"):
        coco_evaluation(coco_truth(), coco_detections(), backend="detectron2")


def test_a_backend_not_installed_is_an_error_naming_the_key(monkeypatch):
    from visiontrain.core.config import ConfigError

    monkeypatch.setitem(sys.modules, "faster_coco_eval", None)  # what an environment without it imports
    with pytest.raises(ConfigError, match=r"^eval.coco_backend=faster-coco-eval: the faster-coco-eval package "
                                          r"cannot be imported .*; install it \(pip install faster-coco-eval"):
        coco_evaluation(coco_truth(), coco_detections())
    assert coco_evaluation(coco_truth(), coco_detections(), backend="pycocotools").metrics["AP"] > 0


@pytest.mark.parametrize("backend", COCO_BACKENDS)
def test_an_evaluation_logs_and_prints_nothing_unless_verbose(backend, caplog, capsys):
    """faster-coco-eval logged its progress and its whole AP/AR table at INFO, which a run's log
    handler printed at every evaluation; the run prints its own metrics. ``verbose`` prints them."""
    caplog.set_level(logging.INFO)  # what a run's log handler shows (the libraries' debug lines are not)
    coco_evaluation(coco_truth(), coco_detections(), backend=backend)
    assert not [r for r in caplog.records if r.levelno >= logging.INFO] and capsys.readouterr().out == ""
    coco_evaluation(coco_truth(), coco_detections(), backend=backend, verbose=True)
    assert "Average Precision" in capsys.readouterr().out


def test_backends_agree_on_the_evaluation_fixtures():
    """tests/evaluation/test_evaluation.py's scene, its per-class variant (categories out of id order, one never
    detected, one without ground truth), the perfect and the empty result sets, a set without small boxes."""
    gt, dets = coco_truth(), coco_detections()
    cases = [(gt, dets), (gt, []), (gt, [{"image_id": a["image_id"], "category_id": a["category_id"],
                                          "bbox": list(a["bbox"]), "score": 1.0} for a in gt["annotations"]])]
    per_class_gt, per_class_dets = coco_truth(), coco_detections()
    per_class_gt["annotations"] += [{"id": 100 + i, "image_id": im, "category_id": 12, "bbox": b, "area": 400.0,
                                     "iscrowd": 0} for i, (im, b) in enumerate([(1, [400, 10, 20, 20]),
                                                                                (5, [500, 300, 20, 20])])]
    per_class_gt["categories"] = [{"id": 9, "name": "c"}, {"id": 1, "name": "a"}, {"id": 15, "name": "e"},
                                  {"id": 5, "name": "b"}, {"id": 12, "name": "d"}]
    per_class_dets.append({"image_id": 2, "category_id": 15, "bbox": [5.0, 5.0, 30.0, 30.0], "score": 0.8})
    no_small = coco_truth()
    no_small["annotations"] = [a for a in no_small["annotations"] if a["area"] >= 32 ** 2]
    cases += [(per_class_gt, per_class_dets), (no_small, dets)]
    for i, (g, d) in enumerate(cases):
        fast, ref = _both(g, d)
        assert differences(fast, ref) == [], i
    assert 0.0 < _both(gt, dets)[0].metrics["APs"] < 1.0  # a scene with numbers in every area range


@pytest.mark.parametrize("seed", range(60))
def test_backends_agree_on_random_scenes(seed):
    gt, dets = _random_case(seed)
    fast, ref = _both(gt, dets)
    assert differences(fast, ref) == []


def test_the_comparison_sees_a_changed_score():
    """The equality above is no tautology: one detection's score moved changes AP, and ``differences``
    reports it (as it would a backend that ranked detections differently)."""
    gt, dets = coco_truth(), coco_detections()
    moved = copy.deepcopy(dets)
    moved[3]["score"] = 0.99  # the false positive on image 1 now outranks the true positives of class 1
    before, after = coco_evaluation(gt, dets), coco_evaluation(gt, moved, backend="pycocotools")
    found = differences(before, after)
    assert any(line.startswith("metric AP:") for line in found) and any("per_class a AP" in line for line in found)
    assert differences(before, after, tol=1.0) == []  # the tolerance is what decides


# ------------------------------------------------------------------ eval.coco_backend, through the CLI
@pytest.fixture
def backends_used(monkeypatch) -> list[str]:
    """The backend of every COCO evaluation this process runs from here on."""
    from visiontrain.evaluation import coco

    return calls_of(monkeypatch, coco, "coco_api")


def test_the_key_reaches_fit_and_validate(tmp_path, mosaic_coco, rcnn_checkpoint, backends_used, capsys):
    """``eval.coco_backend`` picks the implementation of every COCO evaluation: fit's (metrics, per-class
    table and PR curves come from that one evaluation), and validate's, where it can be overridden."""
    from visiontrain.app import cli

    root = mosaic_coco(4, 2)
    run = tmp_path / "run"
    # in-process (data.num_workers=0) so that the evaluations can be watched; a smaller network (the subject
    # is which library scores it), a one-step burn-in
    assert cli.main(["fit", "detect-faster-rcnn", "data.name=coco", f"data.root={root}", "data.batch_size=2",
                     "data.num_workers=0", "task.fpn_channels=32", "task.representation_size=64",
                     "task.train_scales=[96]", "task.val_size=96", "task.max_size=128", "trainer.max_steps=1",
                     "schedules.lr.warmup=1", "eval.coco_backend=pycocotools", "--run-dir", str(run)]) == 0
    assert backends_used and set(backends_used) == {"pycocotools"}
    assert "coco_backend: pycocotools" in (run / "config.yaml").read_text()
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "per_class" in line]
    assert evals and "AP" in evals[-1]
    del backends_used[:]
    capsys.readouterr()
    assert cli.main(["validate", str(rcnn_checkpoint)]) == 0  # the checkpoint's config: the default
    assert set(backends_used) == {"faster-coco-eval"}
    default = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    del backends_used[:]
    assert cli.main(["validate", str(rcnn_checkpoint), "eval.coco_backend=pycocotools"]) == 0
    assert set(backends_used) == {"pycocotools"}
    reference = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert reference["per_class"] == default["per_class"] and reference["AP"] == default["AP"]


def test_a_bad_backend_is_a_one_line_usage_error(capfd, tmp_path):
    """Refused as the config is read, so in this process (a config error's stderr from the real entry
    point is checked whole in tests/reliability/test_bad_input.py)."""
    from visiontrain.app import cli

    capfd.readouterr()
    code = cli.main(["fit", "detect-faster-rcnn", "eval.coco_backend=pycoco", "trainer.max_steps=1",
                     "--run-dir", str(tmp_path / "run")])
    err = capfd.readouterr().err
    assert code == 2 and not (tmp_path / "run").exists()
    assert err.strip().splitlines() == [
        "visiontrain: error: command line (over detect-faster-rcnn.yaml): eval.coco_backend: expected one of "
        "'faster-coco-eval' | 'pycocotools', got 'pycoco' (did you mean 'pycocotools'?)"]
