"""DETR's set prediction loss: Hungarian matching of queries to targets, then per-match losses.

Targets are a list (one per image) of ``{"labels": int64 [n_i], "boxes": float [n_i,4]}`` with
boxes normalised ``cxcywh`` (the model's output format).

Host syncs: the matching problem is solved by scipy on the CPU, so the cost matrices go to the
host -- those of the final layer and of every auxiliary layer stacked into ONE transfer per batch
(not one per image or per layer; none if the batch has no targets at all). There are no other
host reads: every logged value (class_error, cardinality_error) stays a tensor, so the training
loop decides when to read them.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from visiontrain.core._tv_compat import ensure_torchvision

ensure_torchvision()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from scipy.optimize import linear_sum_assignment  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torchvision.ops import box_convert, box_iou, generalized_box_iou, sigmoid_focal_loss  # noqa: E402

__all__ = ["HungarianMatcher", "SetCriterion", "detr_weight_dict"]

Targets = Sequence[dict[str, Tensor]]
Matches = list[tuple[Tensor, Tensor]]
LOSSES = ("labels", "boxes", "cardinality")
CLASS_LOSSES = {"ce": "loss_ce", "focal": "loss_focal", "varifocal": "loss_vfl"}  # class_loss -> loss name
VFL_ALPHA = 0.75  # RT-DETR's weight of the varifocal loss's negatives


def _xyxy(boxes: Tensor) -> Tensor:
    return box_convert(boxes, in_fmt="cxcywh", out_fmt="xyxy")


class HungarianMatcher:
    """One-to-one assignment of predictions to targets minimising
    ``cost_class * -p(target class) + cost_bbox * L1(boxes) + cost_giou * -GIoU(boxes)``.

    The class term uses the probability rather than the log-probability (as in the paper) so it
    is on a scale comparable to the box terms.  With ``focal`` (sigmoid class heads) it is instead
    the focal loss of calling the query positive minus that of calling it negative, as Deformable
    DETR matches, so the cost ranks queries the way the loss will train them.  Returns, per image,
    ``(pred_idx, tgt_idx)`` int64 CPU tensors of equal length ``min(Q, n_i)``.
    """

    def __init__(self, cost_class: float = 1.0, cost_bbox: float = 5.0, cost_giou: float = 2.0, *,
                 focal: bool = False, alpha: float = 0.25, gamma: float = 2.0) -> None:
        if cost_class == 0 and cost_bbox == 0 and cost_giou == 0:
            raise ValueError("HungarianMatcher needs at least one non-zero cost")
        self.cost_class, self.cost_bbox, self.cost_giou = cost_class, cost_bbox, cost_giou
        self.focal, self.alpha, self.gamma = focal, alpha, gamma

    def class_cost(self, logits: Tensor, tgt_ids: Tensor) -> Tensor:
        """[N, C(+1)] logits -> [N, T] cost of giving each prediction each target's class."""
        if not self.focal:
            return -logits.float().softmax(-1)[:, tgt_ids]
        prob = logits.float().sigmoid()[:, tgt_ids]
        positive = self.alpha * (1 - prob) ** self.gamma * -(prob + 1e-8).log()
        negative = (1 - self.alpha) * prob ** self.gamma * -(1 - prob + 1e-8).log()
        return positive - negative

    @torch.no_grad()
    def cost_matrix(self, outputs: dict, targets: Targets) -> Tensor:
        """The [B, Q, sum n_i] cost of every query against every target of the batch, on the device.

        Computing all images at once (then ignoring cross-image blocks) is one set of kernels
        instead of B; the wasted blocks are tiny next to the model.
        """
        b, q = outputs["pred_logits"].shape[:2]
        boxes = outputs["pred_boxes"].flatten(0, 1).float()  # [B*Q, 4]
        tgt_ids = torch.cat([t["labels"] for t in targets])
        tgt_boxes = torch.cat([t["boxes"] for t in targets]).to(boxes)
        cost = (self.cost_class * self.class_cost(outputs["pred_logits"].flatten(0, 1), tgt_ids)
                + self.cost_bbox * torch.cdist(boxes, tgt_boxes, p=1)
                + self.cost_giou * -generalized_box_iou(_xyxy(boxes), _xyxy(tgt_boxes)))
        return cost.view(b, q, -1)

    @torch.no_grad()
    def __call__(self, outputs: dict, targets: Targets) -> Matches:
        return self.match_many([outputs], targets)[0]

    @torch.no_grad()
    def match_many(self, output_sets: Sequence[dict], targets: Targets) -> list[Matches]:
        """Match several output sets (the final layer and every auxiliary one) with ONE transfer
        of all their cost matrices to the host."""
        sizes = [t["boxes"].shape[0] for t in targets]  # shapes are host metadata: no sync
        empty = torch.empty(0, dtype=torch.int64)
        if sum(sizes) == 0:  # nothing to match anywhere: skip the transfer entirely
            return [[(empty, empty) for _ in targets] for _ in output_sets]
        costs = torch.stack([self.cost_matrix(out, targets) for out in output_sets])
        costs = costs.cpu().numpy()  # host sync: one per batch (Hungarian matching runs on the CPU)
        return [self._solve(cost, sizes) for cost in costs]

    @staticmethod
    def _solve(cost: "np.ndarray", sizes: list[int]) -> Matches:
        empty = torch.empty(0, dtype=torch.int64)
        matches: Matches = []
        start = 0
        for i, n in enumerate(sizes):
            block, start = cost[i, :, start:start + n], start + n
            if n == 0:
                matches.append((empty, empty))
                continue
            try:
                rows, cols = linear_sum_assignment(block)
            except ValueError as e:  # scipy rejects NaN/inf: say where they come from
                raise FloatingPointError(f"DETR matcher: cost matrix of image {i} is not finite (NaN/inf "
                                         f"predictions or degenerate target boxes): {e}") from e
            matches.append((torch.as_tensor(rows, dtype=torch.int64), torch.as_tensor(cols, dtype=torch.int64)))
        return matches


class SetCriterion(nn.Module):
    """DETR's loss.  ``forward(outputs, targets)`` returns a dict of scalar tensors:

    - the class loss, by ``class_loss``: ``loss_ce`` (the paper), cross-entropy over *all* queries
      where unmatched queries target no-object, whose class weight is ``eos_coef`` (the
      ``empty_weight`` buffer) so the ~Q-n negatives don't swamp the n positives; ``loss_focal``
      (Deformable DETR), ``torchvision.ops.sigmoid_focal_loss`` on one-hot targets summed over
      queries and classes / num_boxes; ``loss_vfl`` (RT-DETR's varifocal loss), a binary
      cross-entropy whose positive target is the IoU of the matched box (detached) and whose
      negatives weigh ``0.75 * p**2``, also / num_boxes.
    - ``loss_bbox``: L1 over matched boxes / num_boxes;  ``loss_giou``: sum(1 - GIoU) / num_boxes.
    - ``class_error`` (100 - top-1 accuracy of matched queries) and ``cardinality_error`` (L1 between
      the number of queries predicting an object and the number of targets): logged only,
      computed without gradient, and left on the device.

    ``num_boxes`` is the batch's target count, averaged over ranks when torch.distributed is
    initialised (so every rank normalises by the same global mean), clamped to >= 1.

    Each ``aux_outputs[i]`` adds ``loss_ce_i``, ``loss_bbox_i``, ``loss_giou_i`` and
    ``cardinality_error_i`` (kept, as DETR does, to show how early decoder layers count objects);
    ``class_error`` is reported for the final layer only.  Auxiliary sets are matched separately:
    each decoder layer gets its own optimal assignment, as in the paper.

    The training-only outputs of the faster options: query groups (``pred_*`` holding several sets
    of ``num_queries``) are matched group by group and their losses averaged, so each object trains
    one query per group; ``enc_outputs`` (two-stage proposals) are matched like a decoder layer and
    add ``*_enc``; ``dn_outputs`` (denoising copies) need no matching, since slot j of every copy
    reconstructs target j, and add ``*_dn`` and ``*_dn_i``, normalised by num_boxes x copies.
    """

    def __init__(self, num_classes: int, matcher: HungarianMatcher, weight_dict: dict[str, float],
                 eos_coef: float = 0.1, losses: Sequence[str] = LOSSES, *, class_loss: str = "ce",
                 focal_alpha: float = 0.25, focal_gamma: float = 2.0, num_queries: int | None = None) -> None:
        super().__init__()
        unknown = [name for name in losses if name not in LOSSES]
        if unknown:
            raise ValueError(f"unknown DETR losses {unknown}; choose from {LOSSES}")
        if class_loss not in CLASS_LOSSES:
            raise ValueError(f"unknown DETR class loss {class_loss!r}; choose from {sorted(CLASS_LOSSES)}")
        self.num_classes, self.matcher, self.weight_dict = num_classes, matcher, dict(weight_dict)
        self.eos_coef, self.losses = eos_coef, tuple(losses)
        self.class_loss, self.class_key = class_loss, CLASS_LOSSES[class_loss]
        self.focal_alpha, self.focal_gamma, self.num_queries = focal_alpha, focal_gamma, num_queries
        empty_weight = torch.ones(num_classes + 1)
        empty_weight[-1] = eos_coef
        self.register_buffer("empty_weight", empty_weight)

    def _num_boxes(self, n: int, device: torch.device) -> Tensor:
        # torch.full is a fill kernel: no host->device copy, let alone a device->host read.
        num = torch.full((), float(n), device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(num)
            num = num / dist.get_world_size()
        return num.clamp(min=1)

    def _class_loss(self, logits: Tensor, img: Tensor, qry: Tensor, tgt_labels: Tensor, iou: Tensor | None,
                    num_boxes: Tensor) -> Tensor:
        """The class loss of one output set given the matched (image, query) -> label."""
        if self.class_loss == "ce":
            target_classes = torch.full(logits.shape[:2], self.num_classes, dtype=torch.int64, device=logits.device)
            target_classes[img, qry] = tgt_labels
            return F.cross_entropy(logits.float().transpose(1, 2), target_classes, self.empty_weight)
        logits = logits.float()
        onehot = torch.zeros_like(logits)
        # The value as a device tensor: a Python 1.0 is copied to the device with a wait for every
        # kernel queued before it (CUDA's sync debug mode: 5 such waits a step in detect-detr)
        one = onehot.new_ones(())
        if self.class_loss == "focal":
            onehot[img, qry, tgt_labels] = one
            return sigmoid_focal_loss(logits, onehot, self.focal_alpha, self.focal_gamma, reduction="sum") / num_boxes
        onehot[img, qry, tgt_labels] = one  # varifocal: the matched class's target is the box's IoU
        score = onehot * 0
        score[img, qry, tgt_labels] = iou.detach().clamp(min=0).to(score.dtype)
        weight = VFL_ALPHA * logits.detach().sigmoid() ** self.focal_gamma * (1 - onehot) + score
        return F.binary_cross_entropy_with_logits(logits, score, weight=weight, reduction="sum") / num_boxes

    def _set_losses(self, out: dict, matches: Matches, starts: list[int], labels: Tensor, boxes: Tensor,
                    sizes: Tensor, num_boxes: Tensor, final: bool) -> dict[str, Tensor]:
        """Losses of one output set; ``labels``/``boxes`` are all targets concatenated, image i's
        starting at ``starts[i]``."""
        logits, device = out["pred_logits"], out["pred_logits"].device
        idx = torch.stack([  # [3, N] on the CPU: (image, query, target in the concatenation)
            torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(matches)]),
            torch.cat([src for src, _ in matches]),
            torch.cat([tgt + start for (_, tgt), start in zip(matches, starts)]),
        ])  # one async host->device copy for all three index vectors
        img, qry, tgt = idx.to(device, non_blocking=True).unbind(0)
        src, dst = out["pred_boxes"][img, qry].float(), boxes[tgt]
        # generalized_box_iou is pairwise over its last two dims: giving each matched pair its
        # own leading batch entry ([N,1,4] vs [N,1,4] -> [N,1,1]) yields the diagonal of the
        # N x N matrix without building it.
        giou = generalized_box_iou(_xyxy(src)[:, None], _xyxy(dst)[:, None])[:, 0, 0]
        result: dict[str, Tensor] = {}
        if "labels" in self.losses:
            iou = box_iou(_xyxy(src)[:, None], _xyxy(dst)[:, None])[:, 0, 0] if self.class_loss == "varifocal" else None
            result[self.class_key] = self._class_loss(logits, img, qry, labels[tgt], iou, num_boxes)
            if final:
                with torch.no_grad():
                    if tgt.numel():
                        correct = (logits[img, qry].argmax(-1) == labels[tgt]).float().mean()
                        result["class_error"] = 100 - 100 * correct
                    else:  # no matched query: nothing to be wrong about (and no NaN mean)
                        result["class_error"] = torch.zeros((), device=device)
        if "cardinality" in self.losses:
            with torch.no_grad():
                if self.class_loss == "ce":
                    predicted = (logits.argmax(-1) != self.num_classes).sum(1).float()
                else:  # sigmoid heads: a query predicts an object when some class has p > 0.5
                    predicted = (logits.max(-1).values > 0).sum(1).float()
                result["cardinality_error"] = F.l1_loss(predicted, sizes)
        if "boxes" in self.losses:
            result["loss_bbox"] = F.l1_loss(src, dst, reduction="none").sum() / num_boxes
            result["loss_giou"] = (1 - giou).sum() / num_boxes
        return result

    def _groups(self, out: dict) -> list[dict]:
        """One output set per query group (a single group when the model gave one set)."""
        total = out["pred_logits"].shape[1]
        q = self.num_queries if self.num_queries and total % self.num_queries == 0 else total
        return [{k: out[k][:, g * q:(g + 1) * q] for k in ("pred_logits", "pred_boxes")} for g in range(total // q)]

    def forward(self, outputs: dict, targets: Targets) -> dict[str, Tensor]:
        if len(targets) != outputs["pred_logits"].shape[0]:
            raise ValueError(f"{len(targets)} targets for a batch of {outputs['pred_logits'].shape[0]} images")
        device = outputs["pred_logits"].device
        counts = [t["labels"].shape[0] for t in targets]
        starts = [sum(counts[:i]) for i in range(len(counts))]
        labels = torch.cat([t["labels"] for t in targets]).to(device)
        boxes = torch.cat([t["boxes"] for t in targets]).to(device=device, dtype=torch.float32)
        # per-image target counts for the cardinality error: built on the host from shapes, copied async
        sizes = torch.tensor(counts, dtype=torch.float32).to(device, non_blocking=True)
        num_boxes = self._num_boxes(sum(counts), device)

        common = (starts, labels, boxes, sizes, num_boxes)
        layers = [("", outputs)] + [(f"_{i}", aux) for i, aux in enumerate(outputs.get("aux_outputs", []))]
        sets = [(suffix, group) for suffix, out in layers for group in self._groups(out)]
        if "enc_outputs" in outputs:
            sets.append(("_enc", outputs["enc_outputs"]))
        matches = self.matcher.match_many([out for _, out in sets], targets)  # one host transfer in all
        per_suffix: dict[str, list[dict[str, Tensor]]] = {}  # a layer's (or the encoder's) losses, per group
        for (suffix, out), set_matches in zip(sets, matches):
            final = suffix == "" and suffix not in per_suffix  # group 0 of the last layer
            per_suffix.setdefault(suffix, []).append(self._set_losses(out, set_matches, *common, final=final))
        losses: dict[str, Tensor] = {}
        for suffix, group_losses in per_suffix.items():
            for key in group_losses[0]:
                values = [gl[key] for gl in group_losses if key in gl]
                losses[f"{key}{suffix}"] = values[0] if len(values) == 1 else torch.stack(values).mean()
        if "dn_outputs" in outputs:
            losses.update(self._denoising_losses(outputs["dn_outputs"], counts, common))
        return losses

    def _denoising_losses(self, dn: dict, counts: list[int], common: tuple) -> dict[str, Tensor]:
        """Slot j of each denoising copy reconstructs target j of its image: the assignment is
        known, built on the host from the target counts (shapes: no device read)."""
        slots = dn["dn_slots"]
        copies = dn["pred_logits"].shape[1] // slots
        matches = [((torch.arange(copies)[:, None] * slots + torch.arange(n)[None]).flatten(),
                    torch.arange(n).repeat(copies)) for n in counts]
        starts, labels, boxes, sizes, num_boxes = common
        common = (starts, labels, boxes, sizes, num_boxes * copies)
        layers = [("_dn", dn)] + [(f"_dn_{i}", aux) for i, aux in enumerate(dn.get("aux_outputs", []))]
        losses = {}
        for suffix, out in layers:
            for key, value in self._set_losses(out, matches, *common, final=False).items():
                if key != "cardinality_error":  # copies padded to the batch's largest count: not a count
                    losses[f"{key}{suffix}"] = value
        return losses


def detr_weight_dict(ce: float = 1.0, bbox: float = 5.0, giou: float = 2.0, *, aux_layers: int,
                     class_key: str = "loss_ce", two_stage: bool = False, denoising: bool = False) -> dict[str, float]:
    """Loss weights for the class loss (``class_key``), ``loss_bbox`` and ``loss_giou``, and their
    ``_0 .. _{aux_layers-1}`` copies (``aux_layers`` = decoder layers - 1); with ``two_stage`` their
    ``_enc`` copies, with ``denoising`` their ``_dn`` and ``_dn_i`` copies.
    ``class_error``/``cardinality_error*`` get no entry: they are logged, never optimised.
    ``aux_layers`` has no default because forgetting it would silently drop the auxiliary losses."""
    if aux_layers < 0:
        raise ValueError(f"aux_layers must be >= 0, got {aux_layers}")
    base = {class_key: float(ce), "loss_bbox": float(bbox), "loss_giou": float(giou)}
    suffixes = [""] + [f"_{i}" for i in range(aux_layers)]
    suffixes += (["_dn"] + [f"_dn_{i}" for i in range(aux_layers)]) if denoising else []
    suffixes += ["_enc"] if two_stage else []
    return {f"{k}{suffix}": w for suffix in suffixes for k, w in base.items()}
