"""YOLOv3 training targets and losses (GluonCV's prefetch + dynamic target generators and
YOLOV3Loss), batch mixup and the multi-scale input size, all on the device.

Nothing here reads a device value on the host: ground truth arrives padded ([B, M, ...], label -1 =
padding), every box is routed to its prediction slot by index arithmetic and written with one
``scatter`` per target, and boxes that collide in one slot are resolved on the device (a box's best
anchor before another box's extra one, then the highest box index, as in GluonCV's loop where the
later box overwrites).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from visiontrain.models.yolo import STRIDES


@dataclass
class YoloTargets:
    """Dense targets over the N flattened predictions (see ``models.yolo.decode``)."""
    positive: torch.Tensor      # bool [B, N]: a ground-truth box was assigned here
    obj_weight: torch.Tensor    # [B, N]: mixup weight at positives, 0 where ignored, 1 elsewhere
    center: torch.Tensor        # [B, N, 2]: offset of the box centre within its cell, in [0, 1)
    scale: torch.Tensor         # [B, N, 2]: log(box / anchor) for w and h
    box_weight: torch.Tensor    # [B, N]: (2 - box area / image area) x mixup weight; 0 off positives
    cls: torch.Tensor           # [B, N, C]: one-hot (optionally smoothed) class targets
    cls_weight: torch.Tensor    # [B, N]: mixup weight at positives, 0 elsewhere


def shape_iou(wh: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """IoU of boxes [..., 2] with anchors [K, 2] when both are centred at one point: [..., K]."""
    inter = torch.minimum(wh[..., None, 0], anchors[:, 0]) * torch.minimum(wh[..., None, 1], anchors[:, 1])
    return inter / (wh[..., None, 0] * wh[..., None, 1] + anchors[:, 0] * anchors[:, 1] - inter)


def batched_box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of XYXY boxes [B, N, 4] x [B, M, 4] -> [B, N, M] (0 where a union is empty)."""
    lt = torch.maximum(a[:, :, None, :2], b[:, None, :, :2])
    rb = torch.minimum(a[:, :, None, 2:], b[:, None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    area_a = (a[..., 2:] - a[..., :2]).clamp(min=0).prod(-1)
    area_b = (b[..., 2:] - b[..., :2]).clamp(min=0).prod(-1)
    union = area_a[:, :, None] + area_b[:, None, :] - inter
    return inter / union.clamp(min=1e-9)


def _candidate_anchors(wh: torch.Tensor, gt_labels: torch.Tensor, anchors: torch.Tensor,
                       extra_match_iou: float | None, dev: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Each box's J candidate anchors, as assignments [B, M * J]: the anchor id, whether it is the
    box's best (rather than an extra match), whether the assignment is used; and J."""
    b, m = gt_labels.shape
    ious = shape_iou(wh, anchors)                                                 # [B, M, K]
    anchor_id = ious.argmax(-1, keepdim=True)                                     # [B, M, 1]: the best
    first = take = torch.ones_like(anchor_id, dtype=torch.bool)
    if extra_match_iou is not None:
        best, anchor_id = anchor_id, torch.arange(anchors.shape[0], device=dev).expand(b, m, -1)
        first = anchor_id == best
        take = first | (ious > extra_match_iou)
    j = anchor_id.shape[-1]                 # J candidate anchors per box: assignments are [B, M * J]
    use = ((gt_labels >= 0)[..., None] & take).reshape(b, m * j)
    return anchor_id.reshape(b, m * j), first.reshape(b, m * j), use, j


def _cells_and_slots(centre: torch.Tensor, anchor_id: torch.Tensor, first: torch.Tensor, use: torch.Tensor,
                     sizes: Sequence[tuple[int, int]], a: int, n: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each assignment lands: its centre in cells of its anchor's scale, the cell (gx, gy) and
    the prediction slot, ``n`` (a spare slot) for an unused assignment or one that loses its slot."""
    b, mj = anchor_id.shape
    dev = anchor_id.device
    level = anchor_id // a
    # host-made constants, copied without waiting (a blocking copy waits for every queued kernel)
    hw = torch.tensor(sizes).to(dev, non_blocking=True)                           # [L, 2]
    offsets = torch.tensor([0] + [a * h * w for h, w in sizes]).cumsum(0)[:-1].to(dev, non_blocking=True)
    strides = torch.tensor(STRIDES[:len(sizes)], dtype=centre.dtype).to(dev, non_blocking=True)[level]
    cell_xy = centre / strides[..., None]
    lh, lw = hw[level, 0], hw[level, 1]
    gx = cell_xy[..., 0].floor().long().clamp(min=0).minimum(lw - 1)
    gy = cell_xy[..., 1].floor().long().clamp(min=0).minimum(lh - 1)
    slot = offsets[level] + ((anchor_id % a) * lh + gy) * lw + gx
    slot = torch.where(use, slot, torch.full_like(slot, n))                      # unused -> spare slot n
    # one assignment per slot: best-anchor ones before extra ones, then the highest box index
    # (GluonCV's loop, where a later box overwrites an earlier one)
    order = torch.arange(mj, device=dev).expand(b, -1) + first * mj
    winner = torch.full((b, n + 1), -1, device=dev, dtype=torch.long).scatter_reduce(
        1, slot, order, reduce="amax", include_self=True)
    slot = torch.where(use & (winner.gather(1, slot) == order), slot, torch.full_like(slot, n))
    return cell_xy, gx, gy, slot


def build_targets(gt_boxes: torch.Tensor, gt_labels: torch.Tensor, gt_weights: torch.Tensor,
                  pred_boxes: torch.Tensor, anchors: torch.Tensor, sizes: Sequence[tuple[int, int]],
                  image_hw: tuple[int, int], num_classes: int, *, ignore_iou: float = 0.7,
                  label_smoothing: bool = False, extra_match_iou: float | None = None) -> YoloTargets:
    """Assign each ground-truth box to the one anchor (of all scales) whose shape matches it best,
    in the cell of that anchor's scale containing the box centre.

    ``gt_boxes`` [B, M, 4] absolute XYXY in input pixels, ``gt_labels`` [B, M] (-1 = padding),
    ``gt_weights`` [B, M] (mixup weights; 1 without mixup), ``pred_boxes`` [B, N, 4] the decoded
    predictions (for the ignore rule), ``sizes`` the (H, W) of each scale, ``image_hw`` the input
    size. Predictions that are not assigned but overlap some ground truth above ``ignore_iou`` get no
    objectness loss. ``label_smoothing``: GluonCV's, targets 1 - e and e with e = min(1/C, 1/40).
    ``extra_match_iou``: also assign the box to every other anchor whose shape IoU with it is above
    this (YOLOv4's multi-anchor rule: more positives per box); a best-anchor assignment always wins
    a slot over an extra one. None: the best anchor only, as GluonCV.
    """
    b, m = gt_labels.shape
    n = pred_boxes.shape[1]
    dev = pred_boxes.device
    wh = (gt_boxes[..., 2:] - gt_boxes[..., :2]).clamp(min=1e-6)
    anchor_id, first, use, j = _candidate_anchors(wh, gt_labels, anchors, extra_match_iou, dev)

    def per_assignment(x: torch.Tensor) -> torch.Tensor:
        """Per-box values [B, M, *] repeated for each of the box's J candidate anchors."""
        return x[:, :, None].expand(b, m, j, *x.shape[2:]).reshape(b, m * j, *x.shape[2:])

    wh, labels = per_assignment(wh), per_assignment(gt_labels)
    centre = per_assignment((gt_boxes[..., :2] + gt_boxes[..., 2:]) / 2)
    cell_xy, gx, gy, slot = _cells_and_slots(centre, anchor_id, first, use, sizes, anchors.shape[0] // len(sizes), n)
    valid = labels >= 0

    def scatter(values: torch.Tensor) -> torch.Tensor:
        """Per-assignment values [B, M * J, *] -> per-prediction [B, N, *] (0 where none is assigned)."""
        extra = values.shape[2:]
        out = values.new_zeros((b, n + 1, *extra))
        idx = slot.view(b, m * j, *([1] * len(extra))).expand_as(values)
        return out.scatter_(1, idx, values)[:, :n]

    w = per_assignment(gt_weights.to(pred_boxes.dtype)) * valid
    positive = scatter(valid.to(pred_boxes.dtype)) > 0
    area = float(image_hw[0] * image_hw[1])
    box_w = scatter((2.0 - wh.prod(-1) / area) * w)
    anchor_wh = anchors.to(dev)[anchor_id]
    scale = scatter(torch.log(wh.clamp(min=1.0) / anchor_wh))
    center = scatter((cell_xy - torch.stack([gx, gy], -1)).clamp(0.0, 1.0))
    # scatter rather than F.one_hot, whose range checks read the labels on the host (CPU)
    onehot = pred_boxes.new_zeros((b, m * j, num_classes)).scatter_(2, labels.clamp(min=0)[..., None], 1.0)
    if label_smoothing:
        eps = min(1.0 / num_classes, 1.0 / 40)
        onehot = torch.where(onehot > 0.5, 1.0 - eps, eps)
    cls = scatter(onehot)
    pos_w = scatter(w)
    if m:
        iou = batched_box_iou(pred_boxes.detach(), gt_boxes).masked_fill((gt_labels < 0)[:, None, :], -1.0)
        ignored = iou.amax(-1) > ignore_iou
    else:
        ignored = torch.zeros_like(positive)
    obj_weight = torch.where(positive, pos_w, (~ignored).to(pos_w.dtype))
    return YoloTargets(positive, obj_weight, center, scale, box_w, cls, pos_w)


def yolo_losses(pred: torch.Tensor, targets: YoloTargets) -> dict[str, torch.Tensor]:
    """GluonCV's four YOLOv3 losses, each summed over predictions and averaged over images:
    objectness and centre offsets as sigmoid cross-entropy, scale as L1, classes as sigmoid CE."""
    b = pred.shape[0]
    bce = F.binary_cross_entropy_with_logits
    t = targets
    return {
        "loss_obj": bce(pred[..., 4], t.positive.to(pred.dtype), weight=t.obj_weight, reduction="sum") / b,
        "loss_center": bce(pred[..., :2], t.center, weight=t.box_weight[..., None], reduction="sum") / b,
        "loss_scale": ((pred[..., 2:4] - t.scale).abs() * t.box_weight[..., None]).sum() / b,
        "loss_cls": bce(pred[..., 5:], t.cls, weight=t.cls_weight[..., None], reduction="sum") / b,
    }


def pad_targets(targets: Sequence[dict], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's per-image boxes/labels as [B, M, 4] / [B, M] (label -1 pads). Sizes come from
    tensor shapes (host metadata): no device read."""
    m = max((t["labels"].shape[0] for t in targets), default=0)
    boxes = torch.zeros((len(targets), m, 4), device=device)
    labels = torch.full((len(targets), m), -1, dtype=torch.long, device=device)
    for i, t in enumerate(targets):
        k = t["labels"].shape[0]
        boxes[i, :k] = t["boxes"]
        labels[i, :k] = t["labels"]
    return boxes, labels


def mixup(images: torch.Tensor, boxes: torch.Tensor, labels: torch.Tensor, alpha: float
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GluonCV's detection mixup, batched: image i becomes lam * i + (1 - lam) * partner(i), and keeps
    its own boxes (weight lam) and its partner's (weight 1 - lam).

    One lam ~ Beta(alpha, alpha) and one partner permutation (a random cycle, so no image is mixed
    with itself) per batch, drawn from torch's global CPU generator, which the checkpoint saves: a
    resumed run draws the same values. They are moved to the device, never read back.
    Returns (images, boxes [B, 2M, 4], labels [B, 2M], weights [B, 2M]).
    """
    b = images.shape[0]
    # validate_args=False: argument checks would read the (CPU) parameters back with bool()
    lam = torch.distributions.Beta(torch.tensor(alpha), torch.tensor(alpha), validate_args=False).sample()
    order = torch.randperm(b)
    partner = torch.empty_like(order)
    partner[order] = order.roll(-1)
    lam, partner = lam.to(images.device, non_blocking=True), partner.to(images.device, non_blocking=True)
    mixed = images * lam + images[partner] * (1 - lam)
    valid = (labels >= 0).to(images.dtype)
    weights = torch.cat([valid * lam, valid[partner] * (1 - lam)], 1)
    return mixed, torch.cat([boxes, boxes[partner]], 1), torch.cat([labels, labels[partner]], 1), weights


def multiscale_size(seed: int, step: int, sizes: Sequence[int], interval: int = 10) -> int:
    """The input size for optimizer step ``step``: a pure function of (seed, step // interval), so
    every rank picks the same size without communicating and a resumed run picks the same sizes."""
    return random.Random(seed * 1_000_003 + step // interval).choice(list(sizes))


def rescale_batch(images: torch.Tensor, boxes: torch.Tensor, ratio: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Resize a padded batch by ``ratio`` (each side rounded to a multiple of 32, at least 32) on the
    device and scale the boxes by the exact per-axis factors."""
    h, w = images.shape[-2:]
    nh, nw = (max(32, int(round(s * ratio / 32)) * 32) for s in (h, w))
    if (nh, nw) == (h, w):
        return images, boxes
    images = F.interpolate(images, size=(nh, nw), mode="bilinear", align_corners=False)
    factor = torch.tensor([nw / w, nh / h, nw / w, nh / h], dtype=boxes.dtype).to(boxes.device, non_blocking=True)
    return images, boxes * factor
