"""Mask R-CNN (He et al. 2017): Faster R-CNN with a mask branch, for instance segmentation.

The network is torchvision's (``models/rcnn.py``: the same backbones, FPN, RPN and box head as the
``rcnn`` task, plus the mask RoI pool, the four-convolution mask head and a mask logit map per
class); the training recipe is the ``rcnn`` task's (seamseg's SGD, poly schedule with burn-in,
norm-layer groups), whose keys this task takes as they are. What instance segmentation adds:

- the data: the readers read each object's mask (COCO polygons or RLE, YOLO segmentation
  polygons, fashion-mosaic's visible pixels) as compressed RLE, and the samples carry them as a
  ``tv_tensors.Mask`` that every transform moves with the image and boxes
  (``data/detection/masks.py``);
- the loss: ``loss_mask``, the per-pixel binary cross-entropy of the mask of each positive RoI's
  class against the ground-truth mask cropped to that RoI and resized to 28 x 28;
- the evaluation: COCO mask AP (``mask_AP``, ``mask_AP50``, ... from ``iouType="segm"``) beside box
  AP, through the same backend, with mask AP per class, from masks pasted into each original image
  (``models.rcnn.paste_masks``) and written as compressed RLE;
- the figures: ``val_masks`` (the first validation images with the predicted masks filled and the
  ground truth's outlined) and ``mask_pr_curves`` beside the boxes' ``val_detections`` and ``pr_curves``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from visiontrain.core.config import doc
from visiontrain.engine.protocols.task import ExportSpec, register_task
from visiontrain.evaluation.coco import COCO_METRICS, coco_evaluation
from visiontrain.evaluation.figures import ShownImage, masks_figure, pr_curves_figure
from visiontrain.tasks.detection import SHOWN_SCORE
from visiontrain.tasks.rcnn import LOSSES, RcnnConfig, RcnnTask

MASK_PREFIX = "mask_"  # the mask metrics: mask_AP, mask_AP50, ... beside the boxes' AP, AP50, ...


@dataclass
class MaskRcnnConfig(RcnnConfig):
    name: str = doc("task name", "mask_rcnn")
    mask_head_channels: int = doc("width of the mask head's convolutions", 256, minimum=1)
    mask_head_layers: int = doc("3x3 convolutions in the mask head before its 2x upsampling", 4, minimum=1)
    mask_threshold: float = doc("a pasted mask pixel belongs to the object where its probability is above this "
                                "(evaluation, predict, previews)", 0.5, minimum=0)


@dataclass
class KeptMaskCurves:
    """What ``mask_pr_curves`` needs from the last evaluation (``MaskRcnnTask.score``)."""
    recall: np.ndarray                    # [R] COCO's recall thresholds
    curves: dict[str, np.ndarray]         # class name -> mask precision [R] at IoU 0.5 (classes with gt)
    ap50: dict[str, float]                # class name -> mask AP50


class MaskRcnnTask(RcnnTask):
    name = "mask_rcnn"
    reads_masks = True
    kept_masks: KeptMaskCurves | None = None  # the last evaluation's mask PR curves
    default_loss_weights = {**{k: 1.0 for k in LOSSES}, "loss_mask": 1.0}
    metric, mode = "mask_AP", "max"

    def mask_head(self) -> Any:
        from visiontrain.models.rcnn import MaskHead

        return MaskHead(channels=self.cfg.task.mask_head_channels, layers=self.cfg.task.mask_head_layers)

    def model_targets(self, targets: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
        return [{**t, "masks": target["masks"]} for t, target in zip(super().model_targets(targets), targets)]

    def in_original_image(self, det: dict[str, torch.Tensor], height: int, width: int,
                          orig_size: torch.Tensor) -> dict[str, torch.Tensor]:
        """The boxes' frame change, and each detection's mask pasted into the original image at
        its box: bool [N, H, W] at the original size."""
        from visiontrain.models.rcnn import paste_masks

        out = super().in_original_image(det, height, width, orig_size)
        h, w = (int(v) for v in orig_size.tolist())  # host sync (evaluation and predict: the paste needs ints)
        out["masks"] = paste_masks(det["masks"], out["boxes"], h, w, self.cfg.task.mask_threshold)
        return out

    def score(self, detections: list[dict]) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        """Box AP and its table (``DetectionTask.score``), then mask AP from the same detections'
        masks: ``mask_AP``, ``mask_AP50``, ... and ``mask_AP`` / ``mask_AP50`` a class."""
        metrics, per_class = super().score(detections)
        result = coco_evaluation(self.val_set.coco_ground_truth(), detections, backend=self.cfg.eval.coco_backend,
                                 iou_type="segm")
        metrics = {**metrics, **{MASK_PREFIX + k: result.metrics[k] for k in COCO_METRICS}}
        for name, row in result.per_class().items():
            per_class[name] = {**per_class[name], "mask_AP": row["AP"], "mask_AP50": row["AP50"]}
        self.kept_masks = KeptMaskCurves(result.recall_thresholds, result.pr_curves(0.5),
                                         {name: row["mask_AP50"] for name, row in per_class.items()})
        return metrics, per_class

    def eval_figures(self) -> dict[str, Any]:
        """The boxes' figures (``DetectionTask.eval_figures``), ``val_masks`` (``validation_figures``)
        and the mask PR curves per class at IoU 0.5, each class's mask AP50 in the legend."""
        figures = super().eval_figures()
        kept = self.kept_masks
        if kept is not None:
            figures["mask_pr_curves"] = pr_curves_figure(
                kept.recall, kept.curves, kept.ap50, legend_title="mask AP50",
                title=f"mask precision-recall at IoU 0.5, {len(kept.curves)} classes with ground truth")
        return figures

    def validation_figures(self, shown: list[ShownImage]) -> dict[str, Any]:
        """The detections over the ground truth, and the same images with their masks: ``val_masks``."""
        title = (f"validation images: predicted masks with score >= {SHOWN_SCORE} (filled), ground truth "
                 f"(outlined), in class colours")
        return {**super().validation_figures(shown),
                "val_masks": masks_figure(shown, self.info["class_names"], title=title)}

    def export_spec(self, model: nn.Module, info: dict[str, Any]) -> ExportSpec:
        """The rcnn export (the whole detector, free height and width, checked on two aspect ratios)
        with a fourth output, ``masks`` [N, 1, M, M]: each detection's probabilities over its box,
        for its class. The metadata says how to paste them into an image as ``paste_masks`` does,
        so that a program without visiontrain gets the masks ``predict`` gives."""
        from visiontrain.models.rcnn import MaskRcnnExport

        spec = super().export_spec(model, info)
        metadata = {**spec.metadata, "mask_threshold": self.cfg.task.mask_threshold, "mask_paste": MASK_PASTE,
                    "output": f"{spec.metadata['output']}; masks [N, 1, M, M]: each detection's probability of "
                              f"each of M x M cells over its box being the object (mask_paste makes them masks)"}
        return dataclasses.replace(spec, module=MaskRcnnExport(model).eval(),
                                   output_names=[*spec.output_names, "masks"], metadata=metadata,
                                   dynamic_axes={**spec.dynamic_axes, "masks": {0: "detections"}})


#: How an exported file's ``masks`` output becomes masks, as ``models.rcnn.paste_masks`` does it, in words.
MASK_PASTE = ("for detection i, in the image the masks are wanted in (the original: scale its box there first, "
              "as box_frame says), with box x0, y0, x1, y1: for each pixel column c from max(0, trunc(x0)) to "
              "min(width, trunc(x1) + 1) - 1 and row r likewise, read masks[i, 0] (M x M) bilinearly at "
              "u = (c + 0.5 - x0) / (x1 - x0) * M - 0.5, v = (r + 0.5 - y0) / (y1 - y0) * M - 0.5 "
              "(torch.nn.functional.grid_sample with align_corners=false: cells beyond the grid read 0); "
              "the mask is the pixels where that is above mask_threshold, and no pixel outside those columns "
              "and rows")


register_task("mask_rcnn", MaskRcnnTask, MaskRcnnConfig)
