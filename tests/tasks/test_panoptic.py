"""The panoptic task's network and fusion: Panoptic FPN's semantic head on the detector's own FPN
levels (logits at the finest level's stride), its loss beside the Mask R-CNN's, and Detectron2's
fusion of instances and stuff (score order, the overlap and stuff-area thresholds, the things' class
never a segment)."""
from __future__ import annotations

import pytest
import torch

from visiontrain.core import config as C
from visiontrain.models.panoptic import FusionSettings, fuse_panoptic
from visiontrain.tasks.panoptic import PanopticTask


def box_mask(y0: int, y1: int, x0: int, x1: int, size: int = 10) -> torch.Tensor:
    mask = torch.zeros(size, size, dtype=torch.bool)
    mask[y0:y1, x0:x1] = True
    return mask


def test_instances_go_first_by_score_each_on_the_pixels_still_free():
    masks = torch.stack([box_mask(0, 4, 0, 4), box_mask(2, 6, 2, 6), box_mask(0, 4, 0, 4)])
    scores, labels = torch.tensor([0.6, 0.9, 0.4]), torch.tensor([0, 1, 0])
    semantic = torch.zeros(10, 10, dtype=torch.int64)
    ids, segments = fuse_panoptic(scores, labels, masks, semantic, [5, 7], [20], FusionSettings(stuff_area=1))
    # the 0.9 one first, whole; the 0.6 one keeps its 12 free pixels (4 of 16 taken: 0.25 <= 0.5); 0.4 < 0.5: out
    assert [(s["id"], s["category_id"], s["area"]) for s in segments] == [(1, 7, 16), (2, 5, 12)]
    assert torch.equal(ids == 1, masks[1]) and torch.equal(ids == 2, masks[0] & ~masks[1])
    assert (ids[6:] == 0).all()  # the things' class 0 of the semantic map is never a segment: VOID


def test_an_instance_mostly_under_better_ones_is_dropped():
    masks = torch.stack([box_mask(0, 4, 0, 4), box_mask(0, 4, 1, 5)])  # the second: 12 of its 16 taken
    ids, segments = fuse_panoptic(torch.tensor([0.9, 0.8]), torch.tensor([0, 0]), masks,
                                  torch.zeros(10, 10, dtype=torch.int64), [1], [], FusionSettings())
    assert len(segments) == 1 and (ids > 0).sum() == 16
    _, segments = fuse_panoptic(torch.tensor([0.9, 0.8]), torch.tensor([0, 0]), masks,
                                torch.zeros(10, 10, dtype=torch.int64), [1], [], FusionSettings(overlap_thresh=0.8))
    assert [s["area"] for s in segments] == [16, 4]


def test_stuff_fills_the_free_pixels_where_it_covers_enough_of_them():
    semantic = torch.zeros(10, 10, dtype=torch.int64)
    semantic[:5] = 1   # 50 pixels of the first stuff class, 16 of them under the instance
    semantic[9, :3] = 2  # 3 pixels of the second: below the stuff area
    masks = box_mask(0, 4, 0, 4)[None]
    ids, segments = fuse_panoptic(torch.tensor([0.99]), torch.tensor([0]), masks, semantic, [3], [11, 12],
                                  FusionSettings(stuff_area=4))
    assert [(s["category_id"], s["isthing"], s["area"]) for s in segments] == [(3, 1, 16), (11, 0, 34)]
    assert (ids[9, :3] == 0).all()


def test_the_semantic_head_reads_the_detectors_fpn_levels_and_the_losses_are_the_mask_rcnns_and_loss_sem():
    task = PanopticTask(C.load_config("segment-panoptic", []))
    info = {"num_classes": 3, "class_names": ["a", "b", "c"], "category_ids": [1, 2, 3], "stuff_ids": [4],
            "semantic_names": ["things", "d"], "categories": []}
    model = task.build_model(info)
    assert model.levels == ["0", "1", "2"]  # P3-P5 (returned_layers [2, 3, 4]), not the pooled level
    images = torch.randn(2, 3, 64, 96)
    targets = [{"boxes": torch.tensor([[4.0, 4.0, 30.0, 40.0]]), "labels": torch.tensor([1]),
                "masks": torch.ones(1, 64, 96, dtype=torch.uint8), "hw": (64, 96)} for _ in range(2)]
    semantic = torch.randint(0, 2, (2, 64, 96))
    semantic[:, :, 90:] = 255
    losses = task.losses(model.train(), (images, None, targets, semantic))
    assert set(losses) == {"loss_objectness", "loss_rpn_box_reg", "loss_classifier", "loss_box_reg", "loss_mask",
                           "loss_sem"}
    assert all(torch.isfinite(v) for v in losses.values())
    _, _, logits = model.eval()(images, [(64, 96)] * 2)
    assert logits.shape == (2, 2, 8, 12)  # stride 8, the finest level read
    assert task.default_loss_weights["loss_sem"] == pytest.approx(0.5)


def test_under_frozen_bn_the_semantic_heads_norm_layers_still_train():
    """frozen_bn freezes the pretrained backbone's norms (lr 0); the semantic head is new, and its
    norm layers train, as Detectron2's GroupNorm does (the full-scale recipe sets frozen_bn)."""
    from visiontrain.engine.optim.param_groups import NormGroups, group_rules, norm_param_names

    cfg = C.load_config("segment-panoptic", ["task.frozen_bn=true", "task.trainable_layers=3"])
    task = PanopticTask(cfg)
    info = {"num_classes": 2, "class_names": ["a", "b"], "category_ids": [1, 2], "stuff_ids": [3],
            "semantic_names": ["things", "c"], "categories": []}
    model = task.build_model(info)
    lr_of = {name: g["lr_mult"] for g in task.param_groups(model, group_rules(cfg.optim))
             for name in g["param_names"]}
    head_norms = [n for n in norm_param_names(model) if n.startswith("semantic_head.")]
    assert head_norms and all(lr_of[n] == 1.0 for n in head_norms)
    frozen = {name: g["lr_mult"] for g in group_rules(cfg.optim)(model, norms=NormGroups(frozen=True))
              for name in g["param_names"]}  # the R-CNN's rule alone would stop them
    assert all(frozen[n] == 0.0 for n in head_norms)
