"""Faster R-CNN (seamseg-style): a smoke fit of detect-faster-rcnn through the CLI, predict with its
checkpoint, the poly + burn-in schedule, the parameter groups and frozen stages, the class count."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn

from procs import cli_here
from tiny import RCNN as TINY
from visiontrain.core import config as C
from visiontrain.engine.loop.trainer import Trainer
from visiontrain.engine.optim.param_groups import group_rules
from visiontrain.engine.optim.schedules import StepClock, build_schedule
from visiontrain.tasks import build_task

CLASSES = 3  # the fixture keeps fashion-mosaic's first three categories


@pytest.fixture(scope="module")
def coco_root(mosaic_coco) -> Path:
    """An 8/4-image fashion-mosaic as COCO, cut to 3 categories (so the class count is not the default 10)."""
    return mosaic_coco(8, 4, classes=CLASSES)


def tiny_config(coco_root: Path, *extra: str) -> C.Config:
    return C.load_config("detect-faster-rcnn", ["data.name=coco", f"data.root={coco_root}", *TINY, *extra])


@pytest.fixture(scope="module")
def fitted(coco_root, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("rcnn") / "run"
    # in this process: no DataLoader workers to start (data.num_workers 0)
    proc = cli_here("fit", "detect-faster-rcnn", "data.name=coco", f"data.root={coco_root}", *TINY,
                    "trainer.max_steps=4", "trainer.log_every=2", "schedules.lr.warmup=0.5", "eval.every=1",
                    "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_smoke_fit_logs_the_four_losses_and_evaluates(fitted):
    rows = [json.loads(line) for line in (fitted / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert {2, 4} <= {r["step"] for r in train} and train[-1]["step"] == 4  # also logged at epoch ends
    losses = ("loss_objectness", "loss_rpn_box_reg", "loss_classifier", "loss_box_reg")
    for row in train:
        assert all(k in row and row[k] >= 0 for k in losses), row
        assert row["total"] == pytest.approx(sum(row[k] for k in losses), rel=1e-4)  # default weights 1
        assert {"lr/other_x1", "lr/norm_no_decay_x1"} <= set(row)
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals and {"AP", "AP50", "AP75"} <= set(evals[-1])
    summary = json.loads((fitted / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["metric"] == "AP"


def test_predict_returns_boxes_in_original_pixels(fitted, coco_root, tmp_path):
    images = sorted((coco_root / "val").glob("*.png"))[:2]
    out = tmp_path / "pred"
    proc = cli_here("predict", str(fitted / "checkpoints" / "last.pt"), *map(str, images), "--out", str(out),
                    "--threshold", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    dets = json.loads((out / "detections.json").read_text())
    assert dets, "an untrained detector still scores proposals above box_score_thresh 0.05"
    cats = {c["id"] for c in json.loads((coco_root / "annotations" / "instances_val.json").read_text())["categories"]}
    sizes = [Image.open(p).size for p in images]
    for d in dets:
        assert d["category_id"] in cats and 0 <= d["score"] <= 1
        w, h = sizes[d["image_id"] - 1]
        x, y, bw, bh = d["bbox"]
        assert -1e-3 <= x and -1e-3 <= y and x + bw <= w + 1e-3 and y + bh <= h + 1e-3


def test_poly_schedule_with_burn_in_from_a_third():
    """seamseg's lr: linear burn-in from lr/3 over 500 steps, then (1 - t)^0.9 to 0 at the end, per step."""
    cfg = C.load_config("detect-faster-rcnn-r50-coco", ["optim.lr=0.03"])
    spec = cfg.schedules["lr"]
    assert (spec.shape, spec.power, spec.warmup, spec.unit) == ("poly", 0.9, 500, "steps")
    lr = build_schedule(spec, cfg.optim.lr, StepClock(100, 1500), name="lr")
    third = 0.03 * 0.333
    assert lr(0) == pytest.approx(third)
    assert lr(250) == pytest.approx(third + (0.03 - third) * 0.5)
    assert lr(499) == pytest.approx(third + (0.03 - third) * 499 / 500)
    assert lr(500) == pytest.approx(0.03)
    assert lr(1000) == pytest.approx(0.03 * 0.5 ** 0.9)  # t = (1000 - 500) / (1500 - 500)
    assert lr(1250) == pytest.approx(0.03 * 0.25 ** 0.9)
    assert lr(1500) == 0.0 and lr(2000) == 0.0
    # the CPU recipe burns in for half an epoch: 125 of 250 steps per epoch, from a third of its lr
    small = C.load_config("detect-faster-rcnn")
    lr = build_schedule(small.schedules["lr"], small.optim.lr, StepClock(250, 875), name="lr")
    base = small.optim.lr
    assert (lr(0), lr(125), lr(500)) == pytest.approx((base * 0.333, base, base * 0.5 ** 0.9))
    with pytest.raises(ValueError, match="not both"):
        build_schedule(C.load_config("detect-faster-rcnn", ["schedules.lr.warmup_start=0.01"]).schedules["lr"],
                       0.03, StepClock(100, 1500), name="lr")


def test_seamseg_param_groups_split_norms_from_the_rest(coco_root):
    cfg = tiny_config(coco_root, "schedules.lr.warmup=1")
    task = build_task(cfg)
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Conv2d(4, 4, 1))
    by_name = {g["name"]: g for g in task.param_groups(net, group_rules(cfg.optim))}
    assert set(by_name) == {"other_x1", "norm_no_decay_x1"}
    assert by_name["other_x1"]["param_names"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert by_name["other_x1"]["weight_decay"] == 1e-4  # seamseg decays biases; only norms are spared
    assert by_name["norm_no_decay_x1"]["param_names"] == ["1.weight", "1.bias"]
    assert by_name["norm_no_decay_x1"]["weight_decay"] == 0.0
    frozen_cfg = tiny_config(coco_root, "task.frozen_bn=true", "task.weight_decay_norm=true")
    groups = build_task(frozen_cfg).param_groups(net, group_rules(frozen_cfg.optim))
    norm = [g for g in groups if g["name"].startswith("norm")]
    assert [(g["lr_mult"], g["weight_decay"]) for g in norm] == [(0.0, 1e-4)]  # seamseg: norm lr 0 under bn_frozen

    trainer = Trainer(cfg, task, None)
    opt = trainer.optimizer
    assert isinstance(opt, torch.optim.SGD)
    assert all(g["nesterov"] and g["momentum"] == 0.9 for g in opt.param_groups)
    trainer.scalars.apply(0, {})
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert lrs == pytest.approx({"other_x1": cfg.optim.lr * 0.333, "norm_no_decay_x1": cfg.optim.lr * 0.333})


def test_frozen_stages_and_frozen_bn(coco_root):
    from torchvision.ops import FrozenBatchNorm2d

    def norms(model):
        return {n: type(m) for n, m in model.backbone.body.named_modules()
                if isinstance(m, (nn.BatchNorm2d, FrozenBatchNorm2d))}

    task = build_task(tiny_config(coco_root, "task.trainable_layers=3"))
    model = task.build_model({"num_classes": CLASSES})
    kinds = norms(model)
    assert kinds["bn1"] is FrozenBatchNorm2d and kinds["layer1.0.bn1"] is FrozenBatchNorm2d
    assert kinds["layer2.0.bn1"] is nn.BatchNorm2d and kinds["layer4.1.bn2"] is nn.BatchNorm2d
    trainable = {n for n, p in model.backbone.body.named_parameters() if p.requires_grad}
    assert not any(n.startswith(("conv1", "layer1.")) for n in trainable)
    assert "layer2.0.conv1.weight" in trainable

    frozen = build_task(tiny_config(coco_root, "task.frozen_bn=true")).build_model({"num_classes": CLASSES})
    assert set(norms(frozen).values()) == {FrozenBatchNorm2d}
    assert not [n for n, p in frozen.named_parameters() if "bn" in n]


def test_class_count_and_labels_come_from_the_data(coco_root):
    cfg = tiny_config(coco_root)
    task = build_task(cfg)
    data = task.build_data()
    assert data.info["num_classes"] == CLASSES
    model = task.build_model(data.info)
    assert model.roi_heads.box_predictor.cls_score.out_features == CLASSES + 1  # + torchvision's background
    assert model.roi_heads.box_predictor.bbox_pred.out_features == 4 * (CLASSES + 1)
    images, mask, targets = data.eval_collate([data.val[i] for i in range(2)])
    model.eval()
    with torch.no_grad():
        raw, _ = model(images, [t["hw"] for t in targets])  # boxes in the resized images' pixels, labels 1..C
        preds = task.predict_batch(model, images, mask, torch.stack([t["orig_size"] for t in targets]))
    for pred, det, target in zip(preds, raw, targets):
        assert pred["labels"].numel() and 0 <= int(pred["labels"].min()) and int(pred["labels"].max()) < CLASSES
        assert torch.equal(pred["labels"], det["labels"] - 1) and torch.equal(pred["scores"], det["scores"])
        (h, w), (oh, ow) = target["hw"], target["orig_size"].tolist()
        assert (h, w) != (oh, ow)  # val_size=128 resized them: the boxes must be scaled back
        scale = torch.tensor([ow / w, oh / h, ow / w, oh / h])
        torch.testing.assert_close(pred["boxes"], det["boxes"] * scale)


def test_bad_settings_name_the_key(coco_root, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # an empty hub cache: pretrained weights are missing
    with pytest.raises(ValueError, match="task.anchor_sizes"):
        build_task(tiny_config(coco_root, "task.anchor_sizes=[16,32]")).build_model({"num_classes": 2})
    with pytest.raises(ValueError, match="task.backbone"):
        build_task(tiny_config(coco_root, "task.backbone=vgg16")).build_model({"num_classes": 2})
    with pytest.raises(ValueError, match="task.trainable_layers"):
        build_task(tiny_config(coco_root, "task.trainable_layers=7")).build_model({"num_classes": 2})
    with pytest.raises(ValueError, match="task.val_size"):
        build_task(tiny_config(coco_root, "task.val_size=400"))
    with pytest.raises(RuntimeError, match="pretrained_backbone=false"):
        build_task(tiny_config(coco_root, "task.pretrained_backbone=true")
                   ).build_model({"num_classes": 2})


def test_rcnn_recipes_load():
    small, full = C.load_config("detect-faster-rcnn"), C.load_config("detect-faster-rcnn-r50-coco")
    for cfg in (small, full):
        assert cfg.task.name == "rcnn" and cfg.optim.name == "sgd" and cfg.optim.nesterov
        assert (cfg.optim.momentum, cfg.optim.weight_decay) == (0.9, 1e-4)
        assert cfg.eval.metric == "AP" and cfg.schedules["lr"].shape == "poly"
    assert (full.task.backbone, full.task.frozen_bn, full.task.trainable_layers) == ("resnet50", True, 3)
    assert full.data.name == "coco" and full.task.pretrained_backbone


def test_the_recipe_burn_in_lasts_100_steps_also_on_a_few_dozen_images():
    """Half an epoch is 124.5 steps on fashion-mosaic, but 2.5 on neon-trees (42 tiles, batch 8) and 5 at
    batch 4, where lr 0.04 reached that fast diverged (NaN at step 16): warmup_min_steps floors it at 100."""
    cfg = C.load_config("detect-faster-rcnn")
    lr = cfg.schedules["lr"]
    for steps_per_epoch, warmup in ((249, 124.5), (5, 100), (10, 100)):
        clock = StepClock(steps_per_epoch, cfg.trainer.epochs * steps_per_epoch)
        assert build_schedule(lr, cfg.optim.lr, clock, name="lr").warmup_steps == warmup


def test_segment_mask_rcnn_as_shipped_trains_on_real_photographs_of_one_class(tmp_path):
    """A newcomer's 56 aerial tiles with hand-drawn crowns (one class) took segment-mask-rcnn as
    shipped to a mask loss of 1e8 and NaN at step 7. torchvision draws the mask logits layer as a
    ReLU layer, whose weights' std is 1 for one class and background: the first mask loss was 4,
    not ln 2, and the recipe's learning rate amplified it. The layer starts as Detectron2's now."""
    from dataset_trees import build_crowns

    root = build_crowns(tmp_path / "crowns", tmp_path / "cache")
    # the run's length and size: 32 of the 42 training tiles for 2 epochs (8 steps; it was NaN at step
    # 7 or 8), 4 tiles evaluated. trainer.log_every=1 writes each step's losses, which trains nothing
    # differently.
    proc = cli_here("fit", "segment-mask-rcnn", "data.name=coco", f"data.root={root}", "data.limit_train=32",
                    "data.limit_val=4", "trainer.epochs=2", "trainer.log_every=1", "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [{k: v for k, v in r.items() if k.startswith("loss_") or k == "total"} for r in rows
              if r.get("kind") == "train"]
    assert len(losses) == 8 and all(torch.isfinite(torch.tensor(list(r.values()))).all() for r in losses)
    assert 0.6 < losses[0]["loss_mask"] < 0.8  # every pixel at probability 0.5: ln 2
    assert max(r["total"] for r in losses) < 5, losses
