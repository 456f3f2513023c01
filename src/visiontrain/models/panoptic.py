"""Panoptic FPN (Kirillov et al., "Panoptic Feature Pyramid Networks", 2019): a Mask R-CNN and a
semantic head on the same FPN, and the fusion of their outputs into one segmentation of the image.

The network is the project's Mask R-CNN (``models/rcnn.py``: torchvision's backbone, FPN, RPN, box
and mask heads on a prepared batch) with semantic FPN's fusion (``models.segmentation.PyramidFusion``)
on the FPN levels the RoI heads read, predicting the stuff classes and one class for every thing
(class 0), as Detectron2's ``PanopticFPN`` does. The forward pass computes the features once for
both branches.

``fuse_panoptic`` is Detectron2's ``combine_semantic_and_instance_outputs``: instances by score,
each kept above ``score_thresh`` unless more than ``overlap_thresh`` of its mask is already taken,
on the pixels still free; then each stuff class of the semantic argmax on the pixels still free, if
it covers at least ``stuff_area`` of them. What no segment takes stays VOID (id 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from visiontrain.core._tv_compat import ensure_torchvision

ensure_torchvision()

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torchvision.models.detection.image_list import ImageList  # noqa: E402

from visiontrain.models.rcnn import PreparedMaskRCNN  # noqa: E402
from visiontrain.models.segmentation import PyramidFusion  # noqa: E402


class PanopticFPN(nn.Module):
    """``forward(images, image_sizes, targets=None)`` -> (detections, losses, semantic logits): the
    Mask R-CNN's detections (eval mode) and losses (train mode) as ``PreparedMaskRCNN`` gives them,
    and the semantic head's logits [B, classes, H / s, W / s] at the stride ``s`` of the finest FPN
    level it reads."""

    def __init__(self, detector: PreparedMaskRCNN, semantic_classes: int, width: int = 128) -> None:
        super().__init__()
        self.detector = detector
        self.levels = list(detector.roi_heads.box_roi_pool.featmap_names)  # the FPN levels, not the pooled one
        self.semantic_head = PyramidFusion(len(self.levels), detector.backbone.out_channels, semantic_classes, width)

    def forward(self, images: Tensor, image_sizes: list[tuple[int, int]],
                targets: list[dict[str, Tensor]] | None = None
                ) -> tuple[list[dict[str, Tensor]], dict[str, Tensor], Tensor]:
        d = self.detector
        features = d.backbone(images)
        proposals, rpn_losses = d.rpn(ImageList(images, image_sizes), features, targets)
        detections, roi_losses = d.roi_heads(features, proposals, image_sizes, targets)
        semantic = self.semantic_head([features[name] for name in self.levels])
        return detections, {**rpn_losses, **roi_losses}, semantic


@dataclass(frozen=True)
class FusionSettings:
    """Detectron2's ``MODEL.PANOPTIC_FPN.COMBINE`` (its defaults: 0.5, 4096 px, 0.5)."""
    overlap_thresh: float = 0.5
    stuff_area: int = 4096
    score_thresh: float = 0.5


def fuse_panoptic(scores: Tensor, labels: Tensor, masks: Tensor, semantic: Tensor, thing_ids: Sequence[int],
                  stuff_ids: Sequence[int], settings: FusionSettings = FusionSettings()
                  ) -> tuple[Tensor, list[dict[str, Any]]]:
    """One image's panoptic segmentation: (ids int32 [H, W], segments_info), ``category_id`` the
    dataset's. ``scores`` [N], ``labels`` [N] (0-based things), ``masks`` bool [N, H, W] (pasted into
    the image); ``semantic`` [H, W] the semantic argmax (0 things, 1 + k the k-th of ``stuff_ids``)."""
    ids = torch.zeros(semantic.shape, dtype=torch.int32, device=semantic.device)
    segments: list[dict[str, Any]] = []
    order = torch.argsort(scores, descending=True, stable=True).tolist()  # host sync (evaluation and predict)
    kept_scores = scores.tolist()
    for i in order:
        if kept_scores[i] < settings.score_thresh:
            break
        mask = masks[i]
        area = int(mask.sum())
        if area == 0:
            continue
        taken = int((mask & (ids > 0)).sum())
        if taken / area > settings.overlap_thresh:
            continue
        mask = mask & (ids == 0)
        segments.append({"id": len(segments) + 1, "category_id": int(thing_ids[int(labels[i])]), "iscrowd": 0,
                         "isthing": 1, "score": round(kept_scores[i], 4), "area": int(mask.sum())})
        ids[mask] = len(segments)
    for k in torch.unique(semantic).tolist():
        if k == 0 or k > len(stuff_ids):  # the things' class: the instances decide those pixels
            continue
        mask = (semantic == k) & (ids == 0)
        area = int(mask.sum())
        if area < settings.stuff_area:
            continue
        segments.append({"id": len(segments) + 1, "category_id": int(stuff_ids[k - 1]), "iscrowd": 0, "isthing": 0,
                         "area": area})
        ids[mask] = len(segments)
    return ids, segments


class PanopticExport(nn.Module):
    """One prepared image [1, 3, H, W] -> the Mask R-CNN's four outputs (``MaskRcnnExport``) and the
    semantic logits [1, classes, H', W'] at the padded input's size: the fusion is left to the
    caller, as the exported file's metadata describes it."""

    def __init__(self, model: PanopticFPN, size_divisible: int = 32) -> None:
        super().__init__()
        self.model, self.size_divisible = model, size_divisible

    def forward(self, image: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        h, w = image.shape[-2], image.shape[-1]
        k = self.size_divisible
        padded = nn.functional.pad(image, (0, (k - w % k) % k, 0, (k - h % k) % k))
        detections, _, semantic = self.model(padded, [(h, w)])
        det = detections[0]
        logits = nn.functional.interpolate(semantic, size=padded.shape[-2:], mode="bilinear", align_corners=False)
        return det["boxes"], det["labels"] - 1, det["scores"], det["masks"], logits


__all__ = ["FusionSettings", "PanopticExport", "PanopticFPN", "fuse_panoptic"]
