"""DETR model, Hungarian matcher and set criterion (tiny configs; CPU)."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn
from torchvision.ops import FrozenBatchNorm2d

from host_reads import count_reads
from visiontrain.models.detr import DETR, DetrSpec, downsample_mask, postprocess, sine_position_encoding
from visiontrain.models.detr_loss import HungarianMatcher, SetCriterion, detr_weight_dict

NUM_CLASSES = 3
TINY = dict(backbone="resnet18", hidden_dim=32, nheads=4, enc_layers=2, dec_layers=2, dim_feedforward=64,
            num_queries=10)


def tiny_detr(**kw) -> DETR:
    torch.manual_seed(0)
    return DETR(NUM_CLASSES, DetrSpec(**{**TINY, **kw}))


def criterion(aux_layers: int = 1, **kw) -> SetCriterion:
    return SetCriterion(NUM_CLASSES, HungarianMatcher(), detr_weight_dict(aux_layers=aux_layers), **kw)


def random_targets(counts, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in counts:
        centre = torch.rand(n, 2, generator=g) * 0.5 + 0.25
        size = torch.rand(n, 2, generator=g) * 0.3 + 0.1
        out.append({"labels": torch.randint(0, NUM_CLASSES, (n,), generator=g), "boxes": torch.cat([centre, size], 1)})
    return out


def random_outputs(b: int, q: int, aux: int = 0, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)

    def one():
        return {"pred_logits": torch.randn(b, q, NUM_CLASSES + 1, generator=g).requires_grad_(),
                "pred_boxes": (torch.rand(b, q, 4, generator=g) * 0.4 + 0.1).requires_grad_()}
    out = one()
    out["aux_outputs"] = [one() for _ in range(aux)]
    return out


def weighted_total(losses: dict, weights: dict) -> torch.Tensor:
    return sum(losses[k] * w for k, w in weights.items() if k in losses)


# ----------------------------------------------------------------------------------------- model


def test_output_shapes_and_aux_outputs():
    model = tiny_detr(dec_layers=3)
    out = model(torch.randn(2, 3, 64, 64), torch.zeros(2, 64, 64, dtype=torch.bool))
    assert out["pred_logits"].shape == (2, 10, NUM_CLASSES + 1)
    assert out["pred_boxes"].shape == (2, 10, 4)
    assert len(out["aux_outputs"]) == 2
    for aux in out["aux_outputs"]:
        assert aux["pred_logits"].shape == (2, 10, NUM_CLASSES + 1) and aux["pred_boxes"].shape == (2, 10, 4)
    assert ((out["pred_boxes"] > 0) & (out["pred_boxes"] < 1)).all()
    assert model(torch.randn(1, 3, 64, 64))["pred_logits"].shape == (1, 10, NUM_CLASSES + 1)  # mask=None


def test_padding_mask_is_respected_by_position_encoding_and_transformer():
    """With the padding mask, the transformer's outputs for an image do not depend on whatever sits
    in the padded feature cells or on how much padding there is.  (The whole model is not padding
    invariant, in DETR either: the CNN's receptive fields straddle the padding border, so the real
    region's *features* change; the mask only keeps the transformer from attending to padding.)"""
    model = tiny_detr().eval()
    image = torch.randn(1, 3, 64, 64)
    feat, fmask = model.encode_image(image, torch.zeros(1, 64, 64, dtype=torch.bool))
    assert feat.shape == (1, 32, 2, 2) and not fmask.any()
    alone = model.forward_features(feat, fmask)

    big = torch.randn(2, 32, 3, 5) * 10  # junk everywhere; image 0 occupies the top-left 2x2
    big[0, :, :2, :2] = feat[0]
    bmask = torch.ones(2, 3, 5, dtype=torch.bool)
    bmask[0, :2, :2] = False
    bmask[1] = False
    with torch.no_grad():
        batched = model.forward_features(big, bmask)
    for key in ("pred_logits", "pred_boxes"):
        torch.testing.assert_close(batched[key][0], alone[key][0], atol=1e-4, rtol=0)
        torch.testing.assert_close(batched["aux_outputs"][0][key][0], alone["aux_outputs"][0][key][0],
                                   atol=1e-4, rtol=0)

    # The position encoding over the real region is normalised by the real extent.
    pos_alone = sine_position_encoding(fmask, 32)
    pos_big = sine_position_encoding(bmask, 32)
    torch.testing.assert_close(pos_big[0, :, :2, :2], pos_alone[0])
    # Pixel mask -> feature mask: a 64x64 image padded to 96x160 covers exactly 2x2 of 3x5 cells.
    pmask = torch.ones(1, 96, 160, dtype=torch.bool)
    pmask[0, :64, :64] = False
    assert torch.equal(downsample_mask(pmask, (3, 5)), bmask[:1])


def test_only_layer2_to_4_transformer_and_heads_train():
    model = tiny_detr()
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert any(isinstance(m, FrozenBatchNorm2d) for m in model.backbone.modules())
    for name, p in model.named_parameters():
        frozen = name.startswith(("backbone.body.conv1.", "backbone.body.bn1.", "backbone.body.layer1."))
        assert p.requires_grad != frozen, name
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    for prefix in ("backbone.body.layer2.", "backbone.body.layer4.", "input_proj.", "encoder.1.", "decoder.1.",
                   "decoder_norm.", "query_embed.", "class_embed.", "bbox_embed."):
        assert any(n.startswith(prefix) for n in names), prefix
    # Frozen BN statistics do not move in train mode.
    model.train()
    before = model.backbone.body.layer2[0].bn1.running_mean.clone()
    model(torch.randn(2, 3, 64, 64) * 3 + 1)
    assert torch.equal(model.backbone.body.layer2[0].bn1.running_mean, before)


def test_pretrained_backbone_without_cached_weights_fails_clearly(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))
    with pytest.raises(RuntimeError, match="task.pretrained_backbone=false"):
        DETR(NUM_CLASSES, DetrSpec(**{**TINY, "pretrained_backbone": True}))
    with pytest.raises(ValueError, match="backbone"):
        DETR(NUM_CLASSES, DetrSpec(**{**TINY, "backbone": "vgg16"}))


def test_postprocess_gives_absolute_xyxy():
    logits = torch.full((1, 2, NUM_CLASSES + 1), -10.0)
    logits[0, 0, 2] = 10.0  # query 0: class 2
    logits[0, 1, NUM_CLASSES] = 10.0  # query 1: no-object, so a low score for its best real class
    boxes = torch.tensor([[[0.5, 0.5, 0.5, 0.5], [0.25, 0.5, 0.5, 1.0]]])
    (res,) = postprocess({"pred_logits": logits, "pred_boxes": boxes}, torch.tensor([[100, 200]]))
    torch.testing.assert_close(res["boxes"][0], torch.tensor([50.0, 25.0, 150.0, 75.0]))
    torch.testing.assert_close(res["boxes"][1], torch.tensor([0.0, 0.0, 100.0, 100.0]))
    assert res["labels"][0] == 2 and res["scores"][0] > 0.99 and res["scores"][1] < 1e-3
    assert DETR.postprocess({"pred_logits": logits, "pred_boxes": boxes}, torch.tensor([[100, 200]]))[0]["boxes"].shape == (2, 4)


# ------------------------------------------------------------------------------------------ loss


def test_weight_dict():
    w = detr_weight_dict(aux_layers=2)
    assert w == {"loss_ce": 1.0, "loss_bbox": 5.0, "loss_giou": 2.0, "loss_ce_0": 1.0, "loss_bbox_0": 5.0,
                 "loss_giou_0": 2.0, "loss_ce_1": 1.0, "loss_bbox_1": 5.0, "loss_giou_1": 2.0}


def perfect_outputs(targets, q: int, perm: torch.Tensor | None = None) -> dict:
    """Targets placed on queries 0..n-1 (then permuted), logits +20 on the true class, no-object elsewhere."""
    b = len(targets)
    logits = torch.full((b, q, NUM_CLASSES + 1), -20.0)
    logits[..., NUM_CLASSES] = 20.0
    boxes = torch.full((b, q, 4), 0.5)
    for i, t in enumerate(targets):
        n = len(t["labels"])
        logits[i, :n, NUM_CLASSES] = -20.0
        logits[i, torch.arange(n), t["labels"]] = 20.0
        boxes[i, :n] = t["boxes"]
    if perm is not None:
        logits, boxes = logits[:, perm], boxes[:, perm]
    return {"pred_logits": logits, "pred_boxes": boxes}


def test_perfect_prediction_has_zero_box_losses_and_errors():
    targets = random_targets([3, 1])
    out = perfect_outputs(targets, q=6, perm=torch.tensor([5, 2, 0, 4, 1, 3]))
    losses = criterion(aux_layers=0)(out, targets)
    assert losses["loss_bbox"].abs() < 1e-6 and losses["loss_giou"].abs() < 1e-6
    assert losses["class_error"] == 0 and losses["cardinality_error"] == 0
    assert losses["loss_ce"] < 1e-6
    assert losses["class_error"].requires_grad is False and losses["cardinality_error"].requires_grad is False


def test_query_permutation_leaves_losses_unchanged():
    targets = random_targets([3, 2])
    out = random_outputs(2, 8, aux=1)
    crit = criterion(aux_layers=1)
    ref = crit(out, targets)
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(3))

    def permute(o):
        return {"pred_logits": o["pred_logits"][:, perm], "pred_boxes": o["pred_boxes"][:, perm]}
    permuted = permute(out) | {"aux_outputs": [permute(a) for a in out["aux_outputs"]]}
    got = crit(permuted, targets)
    assert set(got) == set(ref) == {"loss_ce", "class_error", "cardinality_error", "loss_bbox", "loss_giou",
                                    "loss_ce_0", "cardinality_error_0", "loss_bbox_0", "loss_giou_0"}
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], atol=1e-6, rtol=1e-6)


def test_matcher_finds_brute_force_optimum():
    matcher = HungarianMatcher()
    for seed in range(5):
        targets = random_targets([3, 2], seed=seed)
        out = random_outputs(2, 4, seed=seed + 10)
        cost = matcher.cost_matrix(out, targets)
        matches = matcher(out, targets)
        start = 0
        for i, t in enumerate(targets):
            n = len(t["labels"])
            c = cost[i, :, start:start + n]
            start += n
            rows, cols = matches[i]
            assert len(rows) == n and sorted(cols.tolist()) == list(range(n)) and len(set(rows.tolist())) == n
            got = c[rows, cols].sum()
            best = min(sum(c[q, j] for j, q in enumerate(qs)) for qs in itertools.permutations(range(4), n))
            torch.testing.assert_close(got, best)


def test_image_without_targets():
    targets = random_targets([0, 2])
    out = random_outputs(2, 5, aux=1)
    crit = criterion(aux_layers=1)
    losses = crit(out, targets)
    assert all(torch.isfinite(v) for v in losses.values())
    assert [len(r) for r, _ in crit.matcher(out, targets)] == [0, 2]
    # loss_ce's gradient on the empty image's logits only pushes towards no-object.
    grad = torch.autograd.grad(losses["loss_ce"], out["pred_logits"])[0][0]
    assert (grad[:, NUM_CLASSES] < 0).all() and (grad[:, :NUM_CLASSES] > 0).all()

    # A batch with no targets at all: no matching, no box loss, class_error 0, finite everywhere.
    none = crit(out, random_targets([0, 0]))
    assert none["loss_bbox"] == 0 and none["loss_giou"] == 0 and none["class_error"] == 0
    assert torch.isfinite(none["loss_ce"]) and none["loss_ce"].requires_grad


def test_num_boxes_is_averaged_over_ranks(monkeypatch):
    targets = random_targets([3, 1])
    out = random_outputs(2, 6)
    crit = criterion(aux_layers=0)
    local = crit(out, targets)
    import torch.distributed as dist

    def all_reduce(t, *a, **k):  # the other rank has 8 boxes: mean = (4 + 8) / 2 = 6
        t.add_(8)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    dist_losses = crit(out, targets)
    torch.testing.assert_close(dist_losses["loss_bbox"], local["loss_bbox"] * 4 / 6)
    torch.testing.assert_close(dist_losses["loss_giou"], local["loss_giou"] * 4 / 6)
    torch.testing.assert_close(dist_losses["loss_ce"], local["loss_ce"])


def test_criterion_reads_from_device_once_per_batch(monkeypatch):
    aux_layers = 3
    targets = random_targets([2, 0, 3])
    out = random_outputs(3, 7, aux=aux_layers)
    crit = criterion(aux_layers=aux_layers)
    calls = count_reads(monkeypatch)
    losses = crit(out, targets)
    total = weighted_total(losses, crit.weight_dict)
    total.backward()
    monkeypatch.undo()
    # One .cpu() of the whole batch's cost matrices (final + every aux layer, stacked), and its
    # host-side .numpy().
    assert calls.pop("cpu") == 1
    assert calls.pop("numpy") == 1
    assert calls == dict.fromkeys(calls, 0)
    assert math.isfinite(total.item())


def test_training_steps_reduce_the_loss():
    model = tiny_detr(dropout=0.0)
    crit = criterion(aux_layers=1)
    images = torch.randn(2, 3, 64, 64)
    mask = torch.zeros(2, 64, 64, dtype=torch.bool)
    mask[1, :, 48:] = True
    targets = random_targets([2, 1], seed=4)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def total() -> torch.Tensor:
        return weighted_total(crit(model(images, mask), targets), crit.weight_dict)
    first = total()
    for _ in range(15):
        opt.zero_grad()
        loss = total()
        loss.backward()
        opt.step()
    with torch.no_grad():
        last = total()
    assert last < 0.8 * first.detach(), (first.item(), last.item())  # 14.2 -> ~9.3 in practice


def test_backbone_weights_from_a_grey_timm_classifier(tmp_path):
    """task.backbone_weights: a timm ResNet-18 trained on 1-channel images starts the DETR trunk
    (stem adapted to RGB, classifier and unused layer4 ignored); a missing file names the key."""
    import timm
    from safetensors.torch import save_file

    from visiontrain.core import config as C
    from visiontrain.tasks.detr import DetrTask

    grey = timm.create_model("resnet18", num_classes=10, in_chans=1)
    save_file({k: v.contiguous() for k, v in grey.state_dict().items()}, str(tmp_path / "grey.safetensors"))
    cfg = C.load_config("detect-detr", [f"task.backbone_weights={tmp_path / 'grey.safetensors'}"])
    task = DetrTask(cfg)
    model = task.build_model({"num_classes": 3})
    report = task.init_weights(model)
    body = model.backbone.body
    assert "conv1.weight 1 -> 3 input channels" in report and "fc.weight" in report
    assert torch.equal(body.layer2[0].conv1.weight, grey.layer2[0].conv1.weight)
    assert torch.equal(body.bn1.running_mean, grey.bn1.running_mean)
    # timm's adaptation: the grey filter repeated over RGB and divided by 3, so a grey image gives the same output
    assert torch.allclose(body.conv1.weight.sum(1), grey.conv1.weight[:, 0], atol=1e-6)
    missing = DetrTask(C.load_config("detect-detr", [f"task.backbone_weights={tmp_path / 'nope.safetensors'}"]))
    with pytest.raises(ValueError, match="task.backbone_weights.*nope.safetensors"):
        missing.init_weights(missing.build_model({"num_classes": 3}))
