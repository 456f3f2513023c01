"""The options that shorten DETR's training (focal/varifocal class loss, reference boxes with
refinement, two-stage selection, query groups, denoising), each on a hand-checked case, and the
paper's DETR unchanged when they are off."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchvision.ops import box_convert, box_iou, sigmoid_focal_loss

from host_reads import count_reads
from visiontrain.models.detr import DETR, DetrSpec, postprocess
from visiontrain.models.detr_loss import HungarianMatcher, SetCriterion, detr_weight_dict
from visiontrain.models.detr_queries import QueryOptions, cell_anchors, inverse_sigmoid, query_attention_mask

NUM_CLASSES = 3
TINY = dict(backbone="resnet18", hidden_dim=32, nheads=4, enc_layers=2, dec_layers=2, dim_feedforward=64,
            num_queries=10)
FIXTURE = Path(__file__).parents[1] / "fixtures" / "detr_paper_outputs.pt"


def tiny(**kw) -> DETR:
    torch.manual_seed(0)
    return DETR(NUM_CLASSES, DetrSpec(**{**TINY, **kw}))


def targets_of(*boxes_and_labels) -> list[dict[str, torch.Tensor]]:
    return [{"labels": torch.tensor(labels, dtype=torch.int64), "boxes": torch.tensor(boxes).reshape(-1, 4)}
            for boxes, labels in boxes_and_labels]


TARGETS = targets_of(([[0.3, 0.3, 0.2, 0.2], [0.6, 0.6, 0.3, 0.2]], [0, 2]), ([[0.5, 0.5, 0.4, 0.4]], [1]))


def batch(size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(2, size, size, dtype=torch.bool)
    mask[1, :, size * 3 // 4:] = True
    return torch.randn(2, 3, size, size, generator=g), mask


def test_with_every_option_off_the_outputs_are_the_papers():
    """The fixture holds the outputs of this tiny DETR (seed 0, eval mode, 96 px, image 1 padded to
    2/3 of its width) computed by the code before the options existed (commit 1913532); the same
    seed gives the same weights because the parameters are created in the same order."""
    expected = torch.load(FIXTURE, weights_only=True)
    model = tiny().eval()
    g = torch.Generator().manual_seed(0)
    images = torch.randn(2, 3, 96, 96, generator=g)
    mask = torch.zeros(2, 96, 96, dtype=torch.bool)
    mask[1, :, 64:] = True
    with torch.no_grad():
        out = model(images, mask)
    assert list(model.state_dict()) == expected["state_dict_keys"]
    torch.testing.assert_close(out["pred_logits"], expected["pred_logits"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["pred_boxes"], expected["pred_boxes"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out["aux_outputs"][0]["pred_logits"], expected["aux_logits"], rtol=1e-5, atol=1e-5)
    assert set(out) == {"pred_logits", "pred_boxes", "aux_outputs"}


# ------------------------------------------------------------------------------- class losses


def test_focal_loss_equals_torchvisions_on_a_hand_built_target():
    logits = torch.randn(2, 4, NUM_CLASSES, generator=torch.Generator().manual_seed(3))
    boxes = torch.tensor([[0.3, 0.3, 0.2, 0.2], [0.6, 0.6, 0.3, 0.2], [0.5, 0.5, 0.4, 0.4], [0.2, 0.7, 0.1, 0.1]])
    outputs = {"pred_logits": logits, "pred_boxes": boxes.expand(2, 4, 4).clone()}
    crit = SetCriterion(NUM_CLASSES, HungarianMatcher(2, 5, 2, focal=True),
                        detr_weight_dict(aux_layers=0, class_key="loss_focal"), class_loss="focal")
    losses = crit(outputs, TARGETS)
    # the box costs dominate: image 0's targets take queries 0 and 1, image 1's target query 2
    onehot = torch.zeros_like(logits)
    onehot[0, 0, 0] = onehot[0, 1, 2] = onehot[1, 2, 1] = 1.0
    expected = sigmoid_focal_loss(logits, onehot, alpha=0.25, gamma=2.0, reduction="sum") / 3
    torch.testing.assert_close(losses["loss_focal"], expected)
    assert "loss_ce" not in losses and losses["loss_bbox"] == 0


def test_focal_matching_cost_is_the_focal_loss_difference():
    logits = torch.tensor([[2.0, -1.0, 0.0]])
    p = logits.sigmoid()[0, 1]
    positive = 0.25 * (1 - p) ** 2 * -p.log()
    negative = 0.75 * p ** 2 * -(1 - p).log()
    cost = HungarianMatcher(focal=True).class_cost(logits, torch.tensor([1]))
    torch.testing.assert_close(cost[0, 0], positive - negative)


def test_varifocal_targets_the_iou_of_the_matched_box():
    logits = torch.zeros(1, 2, NUM_CLASSES)
    pred = torch.tensor([[[0.3, 0.3, 0.2, 0.2], [0.8, 0.8, 0.1, 0.1]]])
    targets = targets_of(([[0.32, 0.3, 0.2, 0.24]], [1]))
    crit = SetCriterion(NUM_CLASSES, HungarianMatcher(focal=True), detr_weight_dict(aux_layers=0, class_key="loss_vfl"),
                        class_loss="varifocal")
    loss = crit({"pred_logits": logits, "pred_boxes": pred}, targets)["loss_vfl"]
    xyxy = lambda b: box_convert(b, "cxcywh", "xyxy")  # noqa: E731
    iou = box_iou(xyxy(pred[0, :1]), xyxy(targets[0]["boxes"]))[0, 0]
    # p = 0.5 everywhere: the positive weighs its IoU and targets it; the 5 negatives weigh 0.75 * 0.25
    bce = lambda t: -(t * torch.log(torch.tensor(0.5)) + (1 - t) * torch.log(torch.tensor(0.5)))  # noqa: E731
    expected = iou * bce(iou) + 5 * 0.75 * 0.25 * bce(torch.tensor(0.0))
    torch.testing.assert_close(loss, expected)


def test_sigmoid_postprocess_ranks_query_class_pairs():
    logits = torch.full((1, 2, NUM_CLASSES), -5.0)
    logits[0, 0, 2], logits[0, 0, 1], logits[0, 1, 0] = 3.0, 1.0, 2.0
    boxes = torch.tensor([[[0.5, 0.5, 0.2, 0.2], [0.25, 0.25, 0.1, 0.1]]])
    (res,) = postprocess({"pred_logits": logits, "pred_boxes": boxes}, torch.tensor([[100, 200]]), sigmoid=True,
                         top_k=3)
    assert res["labels"].tolist() == [2, 0, 1]  # query 0 offers class 2 then class 1
    torch.testing.assert_close(res["scores"], torch.tensor([3.0, 2.0, 1.0]).sigmoid())
    torch.testing.assert_close(res["boxes"][0], torch.tensor([80.0, 40.0, 120.0, 60.0]))
    torch.testing.assert_close(res["boxes"][2], res["boxes"][0])


# ---------------------------------------------------------------------- reference boxes, two-stage


@pytest.mark.parametrize("two_stage", [False, True])
def test_refined_boxes_stay_valid_even_with_wild_corrections(two_stage):
    model = tiny(sigmoid_class=True, queries=QueryOptions(box_refine=True, two_stage=two_stage)).eval()
    with torch.no_grad():
        for head in model.queries.box_heads:
            head.layers[-1].bias.copy_(torch.tensor([40.0, -40.0, 60.0, -60.0]))
        out = model(*batch())
    for boxes in [out["pred_boxes"]] + [a["pred_boxes"] for a in out["aux_outputs"]]:
        assert torch.isfinite(boxes).all() and (boxes >= 0).all() and (boxes <= 1).all()
    for det in postprocess(out, torch.tensor([[128, 128], [128, 96]]), sigmoid=True):
        b = det["boxes"]
        assert (b[:, 2] >= b[:, 0]).all() and (b[:, 3] >= b[:, 1]).all() and (b >= 0).all() and (b <= 128).all()


def test_refinement_feeds_each_layers_box_to_the_next():
    """Layer 1 corrects layer 0's box (refine) or the same starting reference (no refine)."""
    for refine in (True, False):
        model = tiny(queries=QueryOptions(box_refine=refine, dn_groups=1)).eval()  # dn_groups: references without refine
        with torch.no_grad():
            for head in model.queries.box_heads:
                head.layers[-1].bias.copy_(torch.tensor([0.5, 0.0, 0.0, 0.0]))  # +0.5 on the centre's logit
            out = model(*batch())
        ref = model.queries.ref_embed.weight[:10]
        first, last = out["aux_outputs"][0]["pred_boxes"][0], out["pred_boxes"][0]
        torch.testing.assert_close(inverse_sigmoid(first)[:, 0], ref[:, 0] + 0.5, rtol=1e-4, atol=1e-4)
        shift = 1.0 if refine else 0.5
        torch.testing.assert_close(inverse_sigmoid(last)[:, 0], ref[:, 0] + shift, rtol=1e-4, atol=1e-4)


def test_cell_anchors_follow_each_images_real_extent():
    pad = torch.zeros(2, 4, 4, dtype=torch.bool)
    pad[1, :, 2:] = True  # image 1: 2 real columns
    logits, valid = cell_anchors(pad)  # 3 cells a side
    anchors = logits.sigmoid().view(2, 4, 4, 4)
    torch.testing.assert_close(anchors[0, 0, 0], torch.tensor([0.125, 0.125, 0.75, 0.75]))
    torch.testing.assert_close(anchors[1, 3, 1], torch.tensor([0.75, 0.875, 1.0, 0.75]), atol=1e-4, rtol=0)
    assert valid.view(2, 4, 4)[1, :, 2:].sum() == 0 and valid.view(2, 4, 4)[1, :, :2].all() and valid[0].all()


def test_two_stage_takes_the_top_scoring_tokens_as_queries():
    model = tiny(sigmoid_class=True, queries=QueryOptions(two_stage=True)).eval()
    with torch.no_grad():
        out = model(*batch())
        enc = out["enc_outputs"]
        # the picked tokens are the best-scoring real cells: no padded cell of image 1 among them
        assert enc["pred_logits"].shape == (2, 10, NUM_CLASSES)
        centres_x = enc["pred_boxes"][1, :, 0]
        assert (centres_x < 1.0).all()
        # a 2x2 map (4 cells) for 10 queries: every cell is picked, the best ones again to fill up
        small = model(torch.randn(1, 3, 64, 64))["enc_outputs"]["pred_boxes"][0]
    assert small.shape == (10, 4) and len({tuple(b.tolist()) for b in small}) == 4


# ----------------------------------------------------------------------------------- groups (1:many)


def test_query_groups_match_each_box_once_per_group(monkeypatch):
    groups = 3
    model = tiny(queries=QueryOptions(groups=groups))
    images, mask = batch()
    out = model.train()(images, mask)
    assert out["pred_logits"].shape[1] == groups * 10
    crit = SetCriterion(NUM_CLASSES, HungarianMatcher(), detr_weight_dict(aux_layers=1), num_queries=10)
    seen = []
    original = crit.matcher.match_many
    monkeypatch.setattr(crit.matcher, "match_many", lambda sets, t: seen.extend(original(sets, t)) or seen)
    losses = crit(out, TARGETS)
    assert len(seen) == 2 * groups  # every group of both decoder layers matched on its own
    for image, n in enumerate((2, 1)):
        final_layer = [seen[g][image] for g in range(groups)]
        assigned = torch.cat([tgt for _, tgt in final_layer])
        assert sorted(assigned.tolist()) == sorted(list(range(n)) * groups)  # each box: one query per group
    # the loss is the mean of the groups' own losses
    per_group = [SetCriterion(NUM_CLASSES, HungarianMatcher(), detr_weight_dict(aux_layers=0))(
        {k: out[k][:, g * 10:(g + 1) * 10] for k in ("pred_logits", "pred_boxes")}, TARGETS) for g in range(groups)]
    torch.testing.assert_close(losses["loss_giou"], torch.stack([p["loss_giou"] for p in per_group]).mean())
    assert model.eval()(images, mask)["pred_logits"].shape[1] == 10  # evaluation: group 0 alone


def test_groups_cannot_see_each_other():
    model = tiny(dropout=0.0, queries=QueryOptions(groups=2)).train()
    images, mask = batch()
    with torch.no_grad():
        before = model(images, mask)["pred_logits"][:, :10]
        model.query_embed.weight[10:] += 1.0  # change group 1 only
        after = model(images, mask)["pred_logits"][:, :10]
    torch.testing.assert_close(before, after)


# -------------------------------------------------------------------------------------- denoising


def test_attention_mask_blocks_other_blocks():
    mask = query_attention_mask([2, 2, 3])
    expected = torch.ones(7, 7, dtype=torch.bool)
    expected[:2, :2] = expected[2:4, 2:4] = expected[4:, 4:] = False
    assert torch.equal(mask, expected)


def test_matching_queries_cannot_see_the_denoising_queries():
    model = tiny(dropout=0.0, sigmoid_class=True, queries=QueryOptions(box_refine=True, dn_groups=2)).train()
    images, mask = batch()
    other = targets_of(([[0.7, 0.2, 0.1, 0.3]], [2]), ([[0.4, 0.4, 0.2, 0.2], [0.1, 0.1, 0.1, 0.1]], [0, 1]))
    with torch.no_grad():
        a, b = model(images, mask, TARGETS), model(images, mask, other)
        plain = model(images, mask)  # no targets: no denoising queries at all
    torch.testing.assert_close(a["pred_boxes"], b["pred_boxes"])
    torch.testing.assert_close(a["pred_logits"], plain["pred_logits"])
    assert a["dn_outputs"]["pred_boxes"].shape == (2, 2 * 2, 4) and a["dn_outputs"]["dn_slots"] == 2


def test_denoising_copies_reconstruct_their_own_target():
    """Noise-free copies with perfect box heads: the box losses of the reconstruction are zero, so
    slot j of every copy is scored against target j of its own image."""
    model = tiny(sigmoid_class=True, queries=QueryOptions(dn_groups=3, dn_box_noise=0.0, dn_label_noise=0.0)).train()
    out = model(*batch(), TARGETS)
    dn = out["dn_outputs"]
    crit = SetCriterion(NUM_CLASSES, HungarianMatcher(focal=True),
                        detr_weight_dict(aux_layers=1, class_key="loss_focal", denoising=True), class_loss="focal")
    losses = crit(out, TARGETS)
    assert losses["loss_bbox_dn"] < 1e-4 and losses["loss_bbox_dn_0"] < 1e-4  # zero-initialised corrections
    assert "cardinality_error_dn" not in losses
    assert set(crit.weight_dict) <= set(losses)
    total = sum(losses[k] * w for k, w in crit.weight_dict.items())
    total.backward()
    assert model.queries.label_embed.weight.grad.abs().sum() > 0
    assert dn["pred_boxes"].shape == (2, 3 * 2, 4)


def test_denoising_noise_stays_within_its_bounds():
    model = tiny(queries=QueryOptions(dn_groups=50, dn_box_noise=0.4, dn_label_noise=0.5)).train()
    torch.manual_seed(1)
    content, refs, slots = model.queries.denoising_queries(TARGETS, torch.device("cpu"))
    boxes = refs.sigmoid().view(2, 50, slots, 4)
    true = TARGETS[0]["boxes"]
    centre_shift = (boxes[0, :, :2, :2] - true[:, :2]).abs() / true[:, 2:]
    size_ratio = boxes[0, :, :2, 2:] / true[:, 2:]
    assert centre_shift.max() <= 0.2 + 1e-4 and centre_shift.max() > 0.1
    assert size_ratio.min() >= 0.6 - 1e-4 and size_ratio.max() <= 1.4 + 1e-4


# --------------------------------------------------------------------------- host reads, all on


def test_everything_on_reads_from_the_device_once(monkeypatch):
    """Model forward (denoising copies, two-stage selection, groups) and criterion: one host
    transfer per batch, the matching's, however many sets are matched."""
    model = tiny(sigmoid_class=True, queries=QueryOptions(box_refine=True, two_stage=True, groups=2, dn_groups=2))
    crit = SetCriterion(NUM_CLASSES, HungarianMatcher(2, 5, 2, focal=True),
                        detr_weight_dict(aux_layers=1, class_key="loss_focal", two_stage=True, denoising=True),
                        class_loss="focal", num_queries=10)
    images, mask = batch()
    calls = count_reads(monkeypatch)
    losses = crit(model.train()(images, mask, TARGETS), TARGETS)
    sum(losses[k] * w for k, w in crit.weight_dict.items()).backward()
    monkeypatch.undo()
    assert calls.pop("cpu") == 1 and calls.pop("numpy") == 1
    assert calls == dict.fromkeys(calls, 0)


# ------------------------------------------------------------------------------ deformable attention


def test_deformable_attention_reads_the_cell_under_the_box_centre():
    """One level, one head, one point, no offset: the output is the projected value of the cell
    under the query box's centre -- found through the padding (valid ratio) of each image."""
    from visiontrain.models.detr_deformable import DeformableCrossAttention

    attn = DeformableCrossAttention(4, heads=1, levels=1, points=1)
    with torch.no_grad():
        attn.sampling_offsets.bias.zero_()
        for proj in (attn.value_proj, attn.output_proj):
            proj.weight.copy_(torch.eye(4))
            proj.bias.zero_()
    values = torch.arange(2 * 4 * 4 * 8, dtype=torch.float32).view(2, 4, 4, 8)  # [B,D,h,w]
    pad = torch.zeros(2, 4, 8, dtype=torch.bool)
    pad[1, :, 4:] = True  # image 1 is real in its left half only
    # centre of cell (row 1, col 2) of image 0's real 4x8 map; of cell (row 1, col 2) of image 1's real 4x4
    boxes = torch.tensor([[[2.5 / 8, 1.5 / 4, 0.1, 0.1]], [[2.5 / 4, 1.5 / 4, 0.1, 0.1]]])
    out = attn(torch.zeros(2, 1, 4), boxes, [(values, pad)])
    torch.testing.assert_close(out[0, 0], values[0, :, 1, 2])
    torch.testing.assert_close(out[1, 0], values[1, :, 1, 2])


def test_deformable_attention_ignores_padding_values():
    from visiontrain.models.detr_deformable import DeformableCrossAttention

    torch.manual_seed(0)
    attn = DeformableCrossAttention(8, heads=2, levels=1, points=4)
    values = torch.randn(1, 8, 4, 8)
    pad = torch.zeros(1, 4, 8, dtype=torch.bool)
    pad[0, :, 6:] = True
    boxes = torch.tensor([[[0.9, 0.5, 0.6, 0.6]]])  # near the real right edge: some points land on padding
    before = attn(torch.randn(1, 1, 8, generator=torch.Generator().manual_seed(1)), boxes, [(values, pad)])
    values[0, :, :, 6:] = 1000.0
    after = attn(torch.randn(1, 1, 8, generator=torch.Generator().manual_seed(1)), boxes, [(values, pad)])
    torch.testing.assert_close(before, after)


@pytest.mark.parametrize("levels", [1, 2])
def test_deformable_model_trains_and_keeps_valid_boxes(levels):
    model = tiny(sigmoid_class=True, queries=QueryOptions(box_refine=True, two_stage=True, deformable_levels=levels))
    assert not hasattr(model, "query_embed") and hasattr(model, "fine_proj") == (levels == 2)
    crit = SetCriterion(NUM_CLASSES, HungarianMatcher(2, 5, 2, focal=True),
                        detr_weight_dict(aux_layers=1, class_key="loss_focal", two_stage=True), class_loss="focal",
                        num_queries=10)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    images, mask = batch(96)
    totals = []
    for _ in range(6):
        losses = crit(model.train()(images, mask), TARGETS)
        total = sum(losses[k] * w for k, w in crit.weight_dict.items())
        opt.zero_grad()
        total.backward()
        opt.step()
        totals.append(total.item())
    assert totals[-1] < totals[0], totals
    assert model.decoder[0].cross_attn.sampling_offsets.weight.grad.abs().sum() > 0
    if levels == 2:
        assert model.fine_proj[0].weight.grad.abs().sum() > 0


def test_two_stage_with_a_softmax_head_ranks_tokens_by_real_classes_only():
    """The no-object column of a softmax head must not pick the queries: a token sure it is
    background would otherwise win."""
    model = tiny(queries=QueryOptions(two_stage=True)).eval()
    with torch.no_grad():
        model.queries.enc_class.weight.zero_()
        model.queries.enc_class.bias.copy_(torch.tensor([0.0, -50.0, -50.0, 50.0]))  # no-object dominates
        model.queries.enc_class.weight[0, 0] = 1.0  # class 0 follows the feature's first channel
        out = model(*batch())
        memory_scores = out["enc_outputs"]["pred_logits"][..., 0]
    # the picked tokens are those with the highest class-0 logit, in order
    assert torch.equal(memory_scores, memory_scores.sort(dim=1, descending=True).values)
