"""YOLOv3: the target generator on hand-built boxes, the losses' weights, mixup, multi-scale sizes,
decoding back to original-image boxes, VOC07 from COCO results, the no-wd groups, export, the
config errors, and a CLI fit + predict of detect-yolov3 with no host read in the training step."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from procs import cli_here
from host_reads import ALL_ON, run_counted
from tiny import YOLO as TINY
from visiontrain.core import config as C
from visiontrain.engine.loop.trainer import Trainer
from visiontrain.models.yolo import decode, postprocess
from visiontrain.models.yolo_loss import (batched_box_iou, build_targets, mixup, multiscale_size, rescale_batch,
                                          yolo_losses)
from visiontrain.tasks import build_task
from visiontrain.tasks.yolo import YoloSchedule, voc07_from_coco_results

# 3 anchors per stride 8 / 16 / 32, chosen so that shape IoU picks an unambiguous one
ANCHORS = torch.tensor([[8., 8.], [6., 14.], [14., 6.], [20., 20.], [14., 34.], [34., 14.],
                        [48., 48.], [36., 80.], [80., 36.]])
SIZES = [(8, 8), (4, 4), (2, 2)]          # a 64 x 64 input
N = 3 * (64 + 16 + 4)


def targets_for(boxes, labels, weights=None, pred_boxes=None, **kw):
    boxes, labels = torch.tensor([boxes], dtype=torch.float32), torch.tensor([labels])
    weights = torch.ones(labels.shape) if weights is None else torch.tensor([weights])
    pred_boxes = torch.zeros(1, N, 4) if pred_boxes is None else pred_boxes
    return build_targets(boxes, labels, weights, pred_boxes, ANCHORS, SIZES, (64, 64), 3, **kw)


def slot(level: int, anchor: int, gx: int, gy: int) -> int:
    offsets = [0, 3 * 64, 3 * 64 + 3 * 16]
    h, w = SIZES[level]
    return offsets[level] + (anchor * h + gy) * w + gx


def test_a_box_centred_in_a_cell_gets_its_anchor_cell_offsets_and_scale():
    # centre (20, 28) = cell (2, 3) at stride 8, offsets 0.5 / 0.5; shape of anchor 1 (6 x 14)
    # centre (40, 40) = cell (1, 1) at stride 32, offsets 0.25 / 0.25; 1.1 x anchor 7 (36 x 80)
    t = targets_for([[17, 21, 23, 35], [40 - 19.8, 40 - 44, 40 + 19.8, 40 + 44]], [2, 0])
    first, second = slot(0, 1, 2, 3), slot(2, 1, 1, 1)
    assert t.positive.nonzero()[:, 1].tolist() == [first, second]
    torch.testing.assert_close(t.center[0, first], torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(t.center[0, second], torch.tensor([0.25, 0.25]))
    torch.testing.assert_close(t.scale[0, first], torch.zeros(2), atol=1e-6, rtol=0)
    torch.testing.assert_close(t.scale[0, second], torch.full((2,), math.log(1.1)))
    torch.testing.assert_close(t.box_weight[0, [first, second]],
                               torch.tensor([2 - 6 * 14 / 64**2, 2 - 39.6 * 88 / 64**2]))
    assert t.cls[0, first].tolist() == [0, 0, 1] and t.cls[0, second].tolist() == [1, 0, 0]
    assert t.cls_weight.sum() == 2 and t.box_weight.count_nonzero() == 2 and t.center.count_nonzero() == 4
    assert t.obj_weight.sum() == N  # nothing ignored: 1 everywhere, positives at their weight 1


def test_padding_boxes_are_no_targets_and_a_shared_slot_goes_to_the_later_box():
    t = targets_for([[17, 21, 23, 35], [0, 0, 0, 0], [18, 22, 24, 34]], [2, -1, 1])
    assert t.positive.sum() == 1
    assert t.cls[0, slot(0, 1, 2, 3)].tolist() == [0, 1, 0]  # box 2 overwrote box 0, as in GluonCV


def test_predictions_overlapping_a_box_above_the_threshold_are_ignored():
    pred = torch.zeros(1, N, 4)
    gt = torch.tensor([8., 8., 40., 40.])
    pred[0, 5] = gt + torch.tensor([0., 0., 2., 2.])    # IoU (32*32)/(34*34) = 0.89 -> ignored
    pred[0, 6] = gt + torch.tensor([0., 0., 8., 8.])    # IoU 0.64 -> a negative
    t = targets_for([gt.tolist()], [0], weights=[0.3], pred_boxes=pred, ignore_iou=0.7)
    pos = t.positive.nonzero()[0, 1]
    assert t.obj_weight[0, 5] == 0 and t.obj_weight[0, 6] == 1
    assert t.obj_weight[0, pos] == pytest.approx(0.3)                  # a positive is weighted, not ignored
    assert t.box_weight[0, pos] == pytest.approx(0.3 * (2 - 32 * 32 / 64**2))
    assert batched_box_iou(pred[:, 5:7], gt.view(1, 1, 4)).flatten().tolist() == pytest.approx([1024 / 1156, 0.64])


def test_extra_anchors_above_the_match_iou_also_get_the_box():
    # a 10 x 10 box at (20, 28): shape IoU 0.64 with anchor 0 (the best), 0.48 with anchors 1 and 2,
    # 0.25 with anchor 3 (stride 16), 0.21 with anchors 4 and 5
    box = [[15, 23, 25, 33]]
    assert targets_for(box, [1]).positive.nonzero()[:, 1].tolist() == [slot(0, 0, 2, 3)]
    t = targets_for(box, [1], extra_match_iou=0.24)
    cells = [slot(0, 0, 2, 3), slot(0, 1, 2, 3), slot(0, 2, 2, 3), slot(1, 0, 1, 1)]
    assert t.positive.nonzero()[:, 1].tolist() == cells
    torch.testing.assert_close(t.scale[0, cells[1]], torch.tensor([math.log(10 / 6), math.log(10 / 14)]))
    torch.testing.assert_close(t.center[0, cells[3]], torch.tensor([0.25, 0.75]))
    # a slot wanted by one box's best anchor and another box's extra goes to the best, whatever the order
    t = targets_for([[17, 21, 23, 35], box[0]], [0, 2], extra_match_iou=0.4)   # box 0 is 6 x 14: anchor 1
    assert t.cls[0, slot(0, 1, 2, 3)].tolist() == [1, 0, 0] and t.cls[0, slot(0, 0, 2, 3)].tolist() == [0, 0, 1]


def test_label_smoothing_is_gluoncvs():
    t = targets_for([[17, 21, 23, 35]], [2], label_smoothing=True)
    assert t.cls[0, slot(0, 1, 2, 3)].tolist() == pytest.approx([1 / 40, 1 / 40, 1 - 1 / 40])


def test_loss_terms_scale_with_the_box_weights():
    torch.manual_seed(0)
    pred = torch.randn(1, N, 8)
    full, half = (yolo_losses(pred, targets_for([[17, 21, 23, 35]], [2], weights=[w])) for w in (1.0, 0.5))
    assert set(full) == {"loss_obj", "loss_center", "loss_scale", "loss_cls"}
    for k in ("loss_center", "loss_scale", "loss_cls"):
        assert half[k] == pytest.approx(full[k] / 2)


def test_mixup_keeps_both_images_boxes_with_their_weights():
    torch.manual_seed(3)
    images = torch.randn(4, 3, 8, 8)
    boxes = torch.arange(4 * 2 * 4, dtype=torch.float32).view(4, 2, 4)
    labels = torch.tensor([[0, 1], [2, -1], [1, 1], [0, -1]])
    state = torch.get_rng_state()
    mixed, mboxes, mlabels, weights = mixup(images, boxes, labels, 1.5)
    lam = weights[0, 0]
    partner = torch.tensor([int((mboxes[i, 2] == boxes).all(-1).any(-1).nonzero()[0]) for i in range(4)])
    assert sorted(partner.tolist()) == [0, 1, 2, 3] and (partner != torch.arange(4)).all()
    torch.testing.assert_close(mixed, lam * images + (1 - lam) * images[partner])
    assert torch.equal(mboxes, torch.cat([boxes, boxes[partner]], 1))
    assert torch.equal(mlabels, torch.cat([labels, labels[partner]], 1))
    valid = (labels >= 0).float()
    torch.testing.assert_close(weights, torch.cat([valid * lam, valid[partner] * (1 - lam)], 1))
    torch.set_rng_state(state)  # the draws come from torch's checkpointed RNG: same state, same mix
    assert torch.equal(mixup(images, boxes, labels, 1.5)[0], mixed)


def test_input_size_is_the_same_on_every_rank_and_changes_every_interval():
    sizes = list(range(320, 609, 32))
    mine = [multiscale_size(7, s, sizes) for s in range(200)]
    assert all(mine[s] == mine[s // 10 * 10] for s in range(200)) and set(mine) <= set(sizes) and len(set(mine)) > 3
    code = ("import random, torch; random.seed(99); torch.manual_seed(99); "
            "from visiontrain.models.yolo_loss import multiscale_size; "
            f"print([multiscale_size(7, s, {sizes}) for s in range(200)])")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "RANK": "3", "LOCAL_RANK": "3", "OMP_NUM_THREADS": "1"})
    assert json.loads(other.stdout) == mine  # another process, other RNG state: the same sizes
    images, boxes = rescale_batch(torch.zeros(2, 3, 96, 64), torch.tensor([[[8., 16., 32., 48.]]]), 320 / 416)
    assert images.shape[-2:] == (64, 64)
    assert boxes.flatten().tolist() == pytest.approx([8., 16 * 64 / 96, 32., 48 * 64 / 96])


def test_schedule_hook_passes_the_step_and_switches_mixup_off():
    cfg = C.load_config("detect-yolov3", ["task.mixup=true", "task.no_mixup_epochs=2"])
    task = build_task(cfg)
    hook = YoloSchedule()
    progress = type("P", (), {"epochs": cfg.trainer.epochs})()  # the loop's Progress: the run's length
    hook.trainer = type("T", (), {"task": task, "progress": progress, "step": 37, "epoch": 0})()
    hook.before_step()
    hook.before_epoch()
    assert task.step == 37 and task.mixing
    hook.trainer.epoch = cfg.trainer.epochs - 2
    hook.before_epoch()
    assert not task.mixing


def test_decoding_maps_a_prediction_back_to_the_original_image():
    raw = [torch.full((1, 3 * 8, h, w), -20.0) for h, w in SIZES]
    anchor, gy, gx = 1, 3, 2                        # stride 8, anchor 6 x 14, cell (2, 3)
    raw[0][0, anchor * 8 + 4, gy, gx] = 20.0        # objectness
    raw[0][0, anchor * 8 + 5 + 1, gy, gx] = 20.0    # class 1
    raw[0][0, anchor * 8:anchor * 8 + 4, gy, gx] = 0.0   # centre offsets 0.5, scale = anchor
    _, boxes, _ = decode(raw, ANCHORS, 3)
    assert boxes[0, slot(0, 1, 2, 3)].tolist() == [17., 21., 23., 35.]
    # the 64 x 64 input held a 32 x 48 letterboxed image of an original 96 x 64 (h x w)
    (det,) = postprocess(raw, ANCHORS, 3, torch.tensor([[48, 32]]), torch.tensor([[96, 64]]))
    assert det["labels"].tolist() == [1] and det["scores"][0] > 0.99
    torch.testing.assert_close(det["boxes"], torch.tensor([[34., 42., 46., 70.]]))


def test_voc07_from_coco_results():
    from visiontrain.data.detection.base import ImageRecord
    import numpy as np

    records = [ImageRecord("a.png", 1, 50, 50, np.array([[0, 0, 10, 10], [20, 20, 30, 30]], np.float32),
                           np.array([0, 1]), difficult=np.array([False, True]))]
    hit = {"image_id": 1, "category_id": 5, "bbox": [0, 0, 10, 10], "score": 0.9}
    assert voc07_from_coco_results(records, [hit], [5, 7])["mAP"] == 1.0   # the difficult class counts nowhere
    miss = {**hit, "bbox": [30, 30, 10, 10], "score": 0.95}
    voc = voc07_from_coco_results(records, [hit, miss], [5, 7])
    assert voc["mAP"] == pytest.approx(0.5) and voc["per_class"][0] == voc["mAP"]  # precision 1/2 at recall 1
    assert math.isnan(voc["per_class"][1])


def test_evaluate_reports_voc07_and_coco_per_class_and_keeps_the_figures():
    """YOLO's evaluation on a fixed set of detections: the per-class table's voc07_AP is voc_map's
    per_class on the same boxes, next to COCO's columns; the kept confusion matrix is
    detection_confusion's, and both figures draw."""
    import numpy as np

    from visiontrain.data.detection.base import BadDataPolicy, DetectionDataset, ImageRecord
    from visiontrain.rundir.metrics_file import PER_CLASS
    from visiontrain.engine.records.plots import render
    from visiontrain.evaluation import detection_confusion, voc_map

    rng = np.random.default_rng(1)
    cats, names = [3, 8, 11], ["cat", "dog", "owl"]
    records, dets, preds, gts = [], [], [], []
    for image_id in range(1, 9):
        m, xy = int(rng.integers(1, 5)), rng.uniform(0, 80, (4, 2))
        boxes = np.concatenate([xy, xy + rng.uniform(8, 40, (4, 2))], 1)[:m].astype(np.float32)
        labels, difficult = rng.integers(0, 3, m), rng.random(m) < 0.15
        records.append(ImageRecord(f"{image_id}.png", image_id, 128, 128, boxes, labels, difficult=difficult))
        gts.append({"boxes": boxes, "labels": labels, "difficult": difficult})
        p_boxes = np.concatenate([boxes + rng.normal(0, 3, boxes.shape), rng.uniform(0, 60, (2, 4))])  # hits, 2 random
        p_boxes = np.concatenate([p_boxes[:, :2], np.maximum(p_boxes[:, 2:], p_boxes[:, :2] + 4)], 1)
        p_labels = np.concatenate([np.where(rng.random(m) < 0.8, labels, (labels + 1) % 3), rng.integers(0, 3, 2)])
        p_scores = rng.random(m + 2)
        preds.append({"boxes": p_boxes, "labels": p_labels, "scores": p_scores})
        dets += [{"image_id": image_id, "category_id": cats[lab], "bbox": [x1, y1, x2 - x1, y2 - y1], "score": sc}
                 for (x1, y1, x2, y2), lab, sc in zip(p_boxes.tolist(), p_labels.tolist(), p_scores.tolist())]
    task = build_task(C.load_config("detect-yolov3", TINY))
    task.val_set = DetectionDataset(records, names, cats, source="fixture", policy=BadDataPolicy("error", "fixture"))
    task.info = {"num_classes": 3, "class_names": names, "category_ids": cats}
    task.collect_detections = lambda model, data: dets
    metrics = task.evaluate(None, None)
    voc = voc_map(preds, gts, 3, use_07_metric=True)
    table = metrics[PER_CLASS]
    assert list(table) == names and list(metrics)[-1] == PER_CLASS
    assert [table[n]["voc07_AP"] for n in names] == pytest.approx(voc["per_class"], abs=1e-12)
    assert metrics["voc07_mAP"] == pytest.approx(voc["mAP"], abs=1e-12) and 0 < voc["mAP"] < 1
    assert all(set(row) == {"AP", "AP50", "recall", "n_gt", "voc07_AP"} for row in table.values())
    assert [table[n]["n_gt"] for n in names] == [int(sum((g["labels"] == k).sum() for g in gts)) for k in range(3)]
    np.testing.assert_array_equal(task.kept.confusion, detection_confusion(preds, gts, 3))
    figures = task.eval_figures()  # no validation images kept (shown_detections): the two others only
    assert sorted(figures) == ["confusion_matrix", "pr_curves"]
    for fig in figures.values():
        pixels = render(fig)
        assert pixels.shape[0] > 300 and pixels.shape[1] > 300 and pixels.std() > 10  # drawn, not blank


def test_no_weight_decay_on_biases_and_batch_norm():
    from visiontrain.engine.optim.param_groups import build_param_groups

    cfg = C.load_config("detect-yolov3", TINY)
    model = build_task(cfg).build_model({"num_classes": 3})
    groups = {g["name"]: g for g in build_param_groups(model, cfg.optim.weight_decay)}
    assert cfg.optim.name == "sgd" and cfg.optim.weight_decay == 5e-4 and cfg.optim.momentum == 0.9
    assert groups["decay_x1"]["weight_decay"] == 5e-4 and groups["no_decay_x1"]["weight_decay"] == 0
    modules = dict(model.named_modules())
    for name in groups["no_decay_x1"]["param_names"]:
        assert name.endswith(".bias") or isinstance(modules[name.rsplit(".", 1)[0]], torch.nn.BatchNorm2d), name
    for name in groups["decay_x1"]["param_names"]:
        assert name.endswith(".weight") and isinstance(modules[name.rsplit(".", 1)[0]], torch.nn.Conv2d), name
    assert {"outputs.0.bias", "blocks.0.body.0.1.weight", "blocks.0.body.0.1.bias"} <= \
        set(groups["no_decay_x1"]["param_names"])


@pytest.mark.parametrize("fmt, suffix", [("onnx", ".onnx"), ("torchscript", ".torchscript.pt")])
def test_export_round_trips(fmt, suffix, tmp_path):
    from visiontrain.use.export import export_model

    torch.manual_seed(0)
    task = build_task(C.load_config("detect-yolov3", TINY + ["task.val_size=64"]))
    info = {"num_classes": 3}
    model = task.build_model(info)
    result = export_model(task, model, info, fmt, tmp_path / f"yolo{suffix}")
    assert result["max_abs_diff"] < 1e-4 and result["outputs"] == ["out_stride8", "out_stride16", "out_stride32"]
    assert result["inputs"] == {"images": [2, 3, 64, 64]}


@pytest.mark.parametrize("override, key", [
    ("task.anchors=[[10,13],[16,30]]", "task.anchors"), ("task.multiscale_sizes=[320,330]", "task.multiscale_sizes"),
    ("task.nms_iou=1.5", "task.nms_iou"), ("task.backbone_width=0.5", "task.backbone_width")])
def test_bad_config_names_the_key(override, key):
    cfg = C.load_config("detect-yolov3", ["task.backbone=resnet18", override])
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        build_task(cfg).build_model({"num_classes": 3})


def test_pretrained_backbone_offline_and_not_cached_names_the_switch(monkeypatch):
    import visiontrain.models as models

    monkeypatch.setattr(models, "_cached_weights", lambda timm, name: False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = C.load_config("detect-yolov3", ["task.backbone=cspdarknet53", "task.backbone_width=1.0", "task.pretrained_backbone=true"])
    with pytest.raises(RuntimeError, match=r"'cspdarknet53'.*not in the local cache.*task\.pretrained_backbone=false"):
        build_task(cfg).build_model({"num_classes": 3})


def test_recipes_load():
    voc = C.load_config("detect-yolov3-darknet53-voc")
    t = voc.task
    assert (t.backbone, t.size, t.multiscale_sizes, t.mixup, t.no_mixup_epochs) == \
        ("darknet53", 416, list(range(320, 609, 32)), True, 20)
    assert (voc.data.name, voc.optim.lr, voc.optim.weight_decay, voc.trainer.epochs) == ("voc", 1e-3, 5e-4, 200)
    assert voc.data.batch_size * 8 == 64 and voc.optim.base_batch == 64
    assert voc.schedules["lr"].milestones == [160, 180] and voc.schedules["lr"].warmup > 0
    assert voc.eval.metric == "voc07_mAP" and C.load_config("detect-yolov3").data.name == "fashion-mosaic"


@pytest.fixture(scope="module")
def coco_root(mosaic_coco) -> Path:
    """240 / 8 fashion-mosaic images as COCO: 50 steps of 2 x 2 images fit in one epoch."""
    return mosaic_coco(240, 8)


@pytest.fixture(scope="module")
def fitted(coco_root, tmp_path_factory):
    """YOLO's losses, both mAPs, predict and export on a small network read from COCO, loaded
    in-process with mixup on: test_recipes.py runs the recipe itself."""
    run = tmp_path_factory.mktemp("yolo") / "run"
    # in this process: no DataLoader workers to start (data.num_workers 0)
    proc = cli_here("fit", "detect-yolov3", "data.name=coco", f"data.root={coco_root}", "data.batch_size=4",
                    "data.num_workers=0", "trainer.max_steps=4", "trainer.log_every=2", "eval.every=1", *TINY,
                    "task.size=96", "task.val_size=96", "task.multiscale_sizes=[64,96,128]", "task.mixup=true",
                    "task.conf_threshold=0.0001", "schedules.lr.warmup=1", "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_detect_yolov3_smoke_fit_logs_four_losses_and_both_maps(fitted):
    rows = [json.loads(line) for line in (fitted / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4]
    losses = ("loss_obj", "loss_center", "loss_scale", "loss_cls")
    assert all(math.isfinite(train[-1][k]) and train[-1][k] > 0 for k in losses)
    weighted = [f"{k}_w" if f"{k}_w" in train[-1] else k for k in losses]  # the recipe weighs loss_cls 4
    assert "loss_cls_w" in weighted
    assert train[-1]["total"] == pytest.approx(sum(train[-1][k] for k in weighted), rel=1e-4)
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals and {"AP", "AP50", "voc07_mAP"} <= set(evals[-1])
    assert json.loads((fitted / "summary.json").read_text())["metric"] == "AP50"


def test_the_run_dir_shows_validation_detections_over_the_ground_truth(fitted):
    import matplotlib.image

    names = {p.name for p in (fitted / "plots").glob("*.png")}
    assert {"losses.png", "eval.png", "schedules.png", "val_detections.png"} <= names
    pixels = matplotlib.image.imread(fitted / "plots" / "val_detections.png")
    green = (pixels[..., 1] > 0.9) & (pixels[..., 0] < 0.1) & (pixels[..., 2] < 0.1)  # the dashed true boxes
    assert green.sum() > 100


def test_predict_with_the_checkpoint(fitted, coco_root, tmp_path):
    from PIL import Image

    images = sorted((coco_root / "val").glob("*.png"))[:2]
    proc = cli_here("predict", str(fitted / "checkpoints" / "last.pt"), *map(str, images), "--out",
                    str(tmp_path), "--threshold", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    dets = json.loads((tmp_path / "detections.json").read_text())
    assert dets and all(0 < len([d for d in dets if d["image_id"] == i]) <= 100 for i in (1, 2))
    for d in dets:
        w, h = Image.open(images[d["image_id"] - 1]).size
        x, y, bw, bh = d["bbox"]
        assert -1e-3 <= x and -1e-3 <= y and x + bw <= w + 1e-3 and y + bh <= h + 1e-3


def test_cli_exports_the_checkpoint_to_onnx_and_checks_it_in_onnxruntime(fitted, tmp_path):
    import onnxruntime as ort

    proc = cli_here("export", str(fitted / "checkpoints" / "last.pt"), "--format", "onnx", "--out",
                    str(tmp_path / "y.onnx"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["max_abs_diff"] < 1e-3 and result["inputs"] == {"images": [2, 3, 96, 96]}
    outputs = ort.InferenceSession(str(tmp_path / "y.onnx")).run(None, {"images": torch.zeros(3, 3, 96, 96).numpy()})
    assert [o.shape for o in outputs] == [(3, 45, 12, 12), (3, 45, 6, 6), (3, 45, 3, 3)]  # 3 x (5 + 10 classes)


def test_yolo_step_has_no_host_reads(coco_root, monkeypatch):
    cfg = C.load_config("detect-yolov3", ALL_ON + TINY + [
        "data.name=coco", f"data.root={coco_root}", "data.batch_size=2", "data.num_workers=0", "trainer.epochs=2",
        "task.size=64", "task.val_size=64", "task.multiscale_sizes=[64,96]", "task.mixup=true",
        "task.no_mixup_epochs=0", "task.label_smoothing=true", "schedules.lr.warmup=5"])
    counter = run_counted(Trainer, cfg, build_task(cfg), monkeypatch)
    assert counter.calls == [], counter.calls[0][1]
