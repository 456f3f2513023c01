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

from visiontrain._tv_compat import ensure_torchvision

ensure_torchvision()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from scipy.optimize import linear_sum_assignment  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torchvision.ops import box_convert, generalized_box_iou  # noqa: E402

__all__ = ["HungarianMatcher", "SetCriterion", "detr_weight_dict"]

Targets = Sequence[dict[str, Tensor]]
Matches = list[tuple[Tensor, Tensor]]
LOSSES = ("labels", "boxes", "cardinality")


def _xyxy(boxes: Tensor) -> Tensor:
    return box_convert(boxes, in_fmt="cxcywh", out_fmt="xyxy")


class HungarianMatcher:
    """One-to-one assignment of predictions to targets minimising
    ``cost_class * -p(target class) + cost_bbox * L1(boxes) + cost_giou * -GIoU(boxes)``.

    The class term uses the probability rather than the log-probability (as in the paper) so it
    is on a scale comparable to the box terms.  Returns, per image, ``(pred_idx, tgt_idx)`` int64
    CPU tensors of equal length ``min(Q, n_i)``.
    """

    def __init__(self, cost_class: float = 1.0, cost_bbox: float = 5.0, cost_giou: float = 2.0) -> None:
        if cost_class == 0 and cost_bbox == 0 and cost_giou == 0:
            raise ValueError("HungarianMatcher needs at least one non-zero cost")
        self.cost_class, self.cost_bbox, self.cost_giou = cost_class, cost_bbox, cost_giou

    @torch.no_grad()
    def cost_matrix(self, outputs: dict, targets: Targets) -> Tensor:
        """The [B, Q, sum n_i] cost of every query against every target of the batch, on the device.

        Computing all images at once (then ignoring cross-image blocks) is one set of kernels
        instead of B; the wasted blocks are tiny next to the model.
        """
        b, q = outputs["pred_logits"].shape[:2]
        prob = outputs["pred_logits"].flatten(0, 1).float().softmax(-1)  # [B*Q, C+1]
        boxes = outputs["pred_boxes"].flatten(0, 1).float()  # [B*Q, 4]
        tgt_ids = torch.cat([t["labels"] for t in targets])
        tgt_boxes = torch.cat([t["boxes"] for t in targets]).to(boxes)
        cost = (self.cost_class * -prob[:, tgt_ids]
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

    - ``loss_ce``: cross-entropy over *all* queries; unmatched queries target no-object, whose
      class weight is ``eos_coef`` (the ``empty_weight`` buffer) so the ~Q-n negatives don't
      swamp the n positives.
    - ``loss_bbox``: L1 over matched boxes / num_boxes;  ``loss_giou``: sum(1 - GIoU) / num_boxes.
    - ``class_error`` (100 - top-1 accuracy of matched queries) and ``cardinality_error`` (L1 between
      the number of queries not predicting no-object and the number of targets): logged only,
      computed without gradient, and left on the device.

    ``num_boxes`` is the batch's target count, averaged over ranks when torch.distributed is
    initialised (so every rank normalises by the same global mean), clamped to >= 1.

    Each ``aux_outputs[i]`` adds ``loss_ce_i``, ``loss_bbox_i``, ``loss_giou_i`` and
    ``cardinality_error_i`` (kept, as DETR does, to show how early decoder layers count objects);
    ``class_error`` is reported for the final layer only.  Auxiliary sets are matched separately:
    each decoder layer gets its own optimal assignment, as in the paper.
    """

    def __init__(self, num_classes: int, matcher: HungarianMatcher, weight_dict: dict[str, float],
                 eos_coef: float = 0.1, losses: Sequence[str] = LOSSES) -> None:
        super().__init__()
        unknown = [name for name in losses if name not in LOSSES]
        if unknown:
            raise ValueError(f"unknown DETR losses {unknown}; choose from {LOSSES}")
        self.num_classes, self.matcher, self.weight_dict = num_classes, matcher, dict(weight_dict)
        self.eos_coef, self.losses = eos_coef, tuple(losses)
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
        result: dict[str, Tensor] = {}
        if "labels" in self.losses:
            target_classes = torch.full(logits.shape[:2], self.num_classes, dtype=torch.int64, device=device)
            target_classes[img, qry] = labels[tgt]
            result["loss_ce"] = F.cross_entropy(logits.float().transpose(1, 2), target_classes, self.empty_weight)
            if final:
                with torch.no_grad():
                    if tgt.numel():
                        correct = (logits[img, qry].argmax(-1) == labels[tgt]).float().mean()
                        result["class_error"] = 100 - 100 * correct
                    else:  # no matched query: nothing to be wrong about (and no NaN mean)
                        result["class_error"] = torch.zeros((), device=device)
        if "cardinality" in self.losses:
            with torch.no_grad():
                predicted = (logits.argmax(-1) != self.num_classes).sum(1).float()
                result["cardinality_error"] = F.l1_loss(predicted, sizes)
        if "boxes" in self.losses:
            src = out["pred_boxes"][img, qry].float()
            dst = boxes[tgt]
            result["loss_bbox"] = F.l1_loss(src, dst, reduction="none").sum() / num_boxes
            # generalized_box_iou is pairwise over its last two dims: giving each matched pair its
            # own leading batch entry ([N,1,4] vs [N,1,4] -> [N,1,1]) yields the diagonal of the
            # N x N matrix without building it.
            giou = generalized_box_iou(_xyxy(src)[:, None], _xyxy(dst)[:, None])[:, 0, 0]
            result["loss_giou"] = (1 - giou).sum() / num_boxes
        return result

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
        main = {k: v for k, v in outputs.items() if k != "aux_outputs"}
        aux_sets = list(outputs.get("aux_outputs", []))
        matches = self.matcher.match_many([main, *aux_sets], targets)  # one host transfer in all
        losses = self._set_losses(main, matches[0], *common, final=True)
        for i, (aux, aux_matches) in enumerate(zip(aux_sets, matches[1:])):
            aux_losses = self._set_losses(aux, aux_matches, *common, final=False)
            losses.update({f"{k}_{i}": v for k, v in aux_losses.items()})
        return losses


def detr_weight_dict(ce: float = 1.0, bbox: float = 5.0, giou: float = 2.0, *, aux_layers: int) -> dict[str, float]:
    """Loss weights for ``loss_ce``/``loss_bbox``/``loss_giou`` and their ``_0 .. _{aux_layers-1}``
    copies (``aux_layers`` = decoder layers - 1).  ``class_error``/``cardinality_error*`` get no
    entry: they are logged, never optimised.  ``aux_layers`` has no default because forgetting it
    would silently drop the auxiliary losses."""
    if aux_layers < 0:
        raise ValueError(f"aux_layers must be >= 0, got {aux_layers}")
    base = {"loss_ce": float(ce), "loss_bbox": float(bbox), "loss_giou": float(giou)}
    weights = dict(base)
    for i in range(aux_layers):
        weights.update({f"{k}_{i}": w for k, w in base.items()})
    return weights
