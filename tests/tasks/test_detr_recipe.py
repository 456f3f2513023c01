"""The detect-detr recipe end to end on a small generated COCO dataset, and `visiontrain predict`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

from procs import cli_here
from visiontrain.core import config as C


@pytest.fixture(scope="module")
def coco_root(mosaic_coco) -> Path:
    """A 24/8-image fashion-mosaic laid out as a COCO dataset (instances_<split>.json)."""
    return mosaic_coco(train_images=24, val_images=8)


@pytest.fixture(scope="module")
def fitted(coco_root, tmp_path_factory) -> Path:
    """DETR's losses, evaluation and predict on the COCO reader. Why the overrides: a COCO copy of
    fashion-mosaic (the reader), in-process loading (workers are test_recipes.py's subject), an
    evaluation each epoch."""
    run = tmp_path_factory.mktemp("detr") / "run"
    # in this process: no DataLoader workers to start (data.num_workers 0)
    proc = cli_here("fit", "detect-detr", "data.name=coco", f"data.root={coco_root}", "data.batch_size=4",
                    "data.num_workers=0", "trainer.max_steps=4", "trainer.log_every=2", "eval.every=1",
                    "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_detect_detr_smoke_fit(fitted):
    rows = [json.loads(l) for l in (fitted / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [2, 4]
    # DETR's weighted loss dict: final layer and the aux copy (2 decoder layers -> suffix _0), and
    # the recipe's options: focal class loss, two-stage proposals (_enc), denoising copies (_dn)
    for key in ("loss_focal", "loss_bbox", "loss_giou", "loss_focal_0", "loss_bbox_0", "loss_giou_0", "loss_focal_enc",
                "loss_giou_enc", "loss_focal_dn", "loss_bbox_dn_0", "class_error", "cardinality_error", "loss_bbox_w",
                "grad_norm", "total"):
        assert key in train[-1], key
    assert train[-1]["loss_focal_w"] == pytest.approx(2 * train[-1]["loss_focal"], rel=1e-4)  # focal weighs 2
    weighted = [k for k in train[-1] if k.endswith("_w")]
    assert len(weighted) == 3 * 5  # class, L1, GIoU for: final, aux, encoder, denoising final and aux
    assert train[-1]["total"] == pytest.approx(sum(train[-1][k] for k in weighted), rel=1e-4)
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals and {"AP", "AP50", "AP75", "APs", "APm", "APl"} <= set(evals[-1])
    summary = json.loads((fitted / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["metric"] == "AP50"


def test_predict_draws_boxes_and_writes_coco_results(fitted, coco_root, tmp_path):
    images = sorted((coco_root / "val").glob("*.png"))[:2]
    out = tmp_path / "pred"
    proc = cli_here("predict", str(fitted / "checkpoints" / "last.pt"), *map(str, images), "--out", str(out),
                    "--threshold", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for img in images:
        drawn = Image.open(out / f"{img.stem}.png")
        assert drawn.size == Image.open(img).size and drawn.mode == "RGB"
    dets = json.loads((out / "detections.json").read_text())
    # threshold 0: the 100 best (query, class) pairs of each image (20 queries x 10 classes: sigmoid heads)
    assert len(dets) == 2 * 100
    cats = {c["id"] for c in json.loads((coco_root / "annotations" / "instances_val.json").read_text())["categories"]}
    for d in dets:
        assert d["image_id"] in (1, 2) and d["category_id"] in cats and 0 <= d["score"] <= 1
        w, h = Image.open(images[d["image_id"] - 1]).size
        x, y, bw, bh = d["bbox"]
        assert -1e-3 <= x and -1e-3 <= y and x + bw <= w + 1e-3 and y + bh <= h + 1e-3


def test_detr_recipes_load():
    for name in ("detect-detr", "detect-detr-r50-coco"):
        cfg = C.load_config(name)
        assert cfg.task.name == "detr" and cfg.trainer.clip_grad == 0.1
    cfg = C.load_config("detect-detr-r50-coco")
    assert (cfg.task.enc_layers, cfg.task.dec_layers, cfg.task.hidden_dim, cfg.task.num_queries) == (6, 6, 256, 100)
    assert cfg.optim.lr_mult == {"^backbone\\.": 0.1} and cfg.schedules["lr"].milestones == [200]
    # the paper's recipe keeps the paper's DETR: every fast option off
    t = cfg.task
    assert (t.class_loss, t.box_refine, t.two_stage, t.query_groups, t.dn_groups, t.deformable_levels) == \
        ("ce", False, False, 1, 0, 0)
    fast = C.load_config("detect-detr-fast-r50-coco").task
    assert (fast.class_loss, fast.box_refine, fast.two_stage, fast.dn_groups, fast.deformable_levels) == \
        ("focal", True, True, 5, 2)


def test_the_papers_recipe_builds_the_papers_model():
    from visiontrain.tasks.detr import DetrTask

    task = DetrTask(C.load_config("detect-detr-r50-coco", ["task.pretrained_backbone=false"]))
    model = task.build_model({"num_classes": 3})
    assert not hasattr(model, "queries") and not model.sigmoid_class
    assert set(task.loss_weights) == {f"{k}{s}" for k in ("loss_ce", "loss_bbox", "loss_giou")
                                      for s in ["", "_0", "_1", "_2", "_3", "_4"]}


def test_predict_threshold_follows_the_class_loss():
    from visiontrain.tasks.detr import DetrTask

    assert DetrTask(C.load_config("detect-detr")).predict_threshold == 0.3  # focal scores sit lower
    assert DetrTask(C.load_config("detect-detr", ["task.class_loss=ce"])).predict_threshold == 0.5


def test_the_papers_recipe_page_lists_the_post_processing_it_adds():
    """DETR's and DINO-DETR's post-processing neither clips nor drops boxes; both recipe pages' departures
    say that this one does both, with the code's threshold, and the code does."""
    from visiontrain.models import MIN_BOX_SIZE
    from visiontrain.models.detr import postprocess

    for name, original in (("detect-detr-r50-coco", "DETR"), ("detect-detr-fast-r50-coco", "DINO-DETR")):
        page = (Path(__file__).parents[2] / "docs" / "recipes" / f"{name}.md").read_text()
        start = page.index(f"## Where the recipe departs from {original}")
        departures = " ".join(page[start:page.index("## Small counterpart")].split())  # however the page is wrapped
        assert "**Post-processing clips boxes to the image and drops degenerate ones.**" in departures, name
        assert f"a box narrower or lower than {MIN_BOX_SIZE:g} px after clipping is dropped" in departures, name
        assert "clip_boxes_to_image" in departures and "remove_small_boxes" in departures, name
    logits = torch.zeros(1, 2, 3)
    boxes = torch.tensor([[[0.1, 0.5, 0.4, 0.2], [0.5, 0.5, MIN_BOX_SIZE / 2 / 200, 0.5]]])  # past the left edge
    (res,) = postprocess({"pred_logits": logits, "pred_boxes": boxes}, torch.tensor([[100, 200]]))  # 200 px wide
    torch.testing.assert_close(res["boxes"], torch.tensor([[0.0, 40.0, 60.0, 60.0]]))  # clipped; the thin one gone
