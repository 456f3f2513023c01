"""Panoptic segmentation with Panoptic FPN: every pixel a stuff class or one counted thing.

The network is the ``mask_rcnn`` task's Mask R-CNN with a semantic head on the same FPN
(``models/panoptic.py``), trained on the ``mask_rcnn`` recipe's keys, which this task takes as they
are. What panoptic adds:

- the data: COCO's panoptic format (``data/segmentation/panoptic.py``): each sample's things as
  instances (boxes, masks) and its semantic map (0 every thing, 1 + k the stuff), moved together by
  the R-CNN's flip and multi-scale resize;
- the loss: the Mask R-CNN's five and ``loss_sem``, the semantic head's cross-entropy over the
  labelled pixels (VOID left out), weighted 0.5 by default as Detectron2's Panoptic FPN weighs it;
- the evaluation: each validation image's instances and semantic argmax fused into one id map
  (``models.panoptic.fuse_panoptic``, Detectron2's rule and thresholds, ``task.overlap_thresh``,
  ``task.stuff_area``, ``task.instance_score_thresh``) at the image's own size, scored against its
  PNG with panopticapi's PQ, SQ and RQ, overall, for things (``_th``) and for stuff (``_st``), and per
  class (``evaluation/panoptic.py``);
- the figures: ``val_panoptic`` (the first validation images' ground truth beside the prediction,
  each category in its colour).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from visiontrain.core._tv_compat import ensure_torchvision
from visiontrain.core.config import doc
from visiontrain.core.panoptic_format import SegmentsInfo, parse_segments
from visiontrain.data.segmentation.panoptic import SanitizeThings, build_panoptic_splits
from visiontrain.data.segmentation.sources import IGNORE_INDEX
from visiontrain.engine.optim.param_groups import NormGroups
from visiontrain.engine.protocols.task import ExportSpec, Prediction, TaskData, register_task
from visiontrain.engine.step.eval_loop import EvalData
from visiontrain.evaluation.panoptic import PanopticQuality, pq_metrics
from visiontrain.evaluation.segmentation import segmentation_figure
from visiontrain.tasks.detection import unread_data_keys
from visiontrain.tasks.mask_rcnn import MaskRcnnConfig, MaskRcnnTask
from visiontrain.tasks.rcnn import collate_with_sizes
from visiontrain.tasks.semantic import SemanticTask, labelled_cross_entropy

SHOWN_IMAGES = 4  # the validation images drawn in val_panoptic.png after each evaluation


@dataclass
class PanopticConfig(MaskRcnnConfig):
    unread_data_keys: ClassVar[dict[str, str]] = unread_data_keys(
        "task.train_scales, task.max_size and task.val_size",
        "flips and multi-scale training: task.vertical_flip, task.train_scales")
    name: str = doc("task name", "panoptic")
    semantic_head_width: int = doc("width of the semantic head's convolutions (Detectron2: 128)", 128, minimum=1)
    overlap_thresh: float = doc("fusion: an instance is dropped when more than this share of its mask is already "
                                "taken by higher-scoring ones (Detectron2: 0.5)", 0.5, minimum=0)
    stuff_area: int = doc("fusion: a stuff class becomes a segment only where it covers at least this many free "
                          "pixels of the image (Detectron2: 4096, for COCO's ~800 x 1200 images)", 4096, minimum=0)
    instance_score_thresh: float = doc("fusion: instances scoring below this are left out (Detectron2: 0.5)", 0.5,
                                       minimum=0)


def collate_panoptic(batch: list[tuple[Any, dict[str, Any]]]
                     ) -> tuple[torch.Tensor, torch.Tensor, list[dict[str, Any]], torch.Tensor]:
    """The R-CNN's collate (``collate_with_sizes``) and the semantic maps int64 [B, H, W] at the
    images' padded size, padded with the ignore index (the padding counts in no loss)."""
    images, mask, targets = collate_with_sizes(batch)
    semantic = torch.full((len(batch), *images.shape[-2:]), IGNORE_INDEX, dtype=torch.int64)
    for i, (_, target) in enumerate(batch):
        h, w = target["semantic"].shape[-2:]
        semantic[i, :h, :w] = target["semantic"].as_subclass(torch.Tensor)
    return images, mask, targets, semantic


class PanopticTask(MaskRcnnTask):
    name = "panoptic"
    predicts = Prediction.PANOPTIC
    default_loss_weights = {**MaskRcnnTask.default_loss_weights, "loss_sem": 0.5}
    metric, mode = "PQ", "max"
    shown: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # the last evaluation's first images (rank 0)

    def transforms(self) -> tuple[Any, Any]:
        """The R-CNN's, with the things sanitized while the semantic map is set aside."""
        ensure_torchvision()
        import torchvision.transforms.v2 as T

        train, val = super().transforms()
        steps = [SanitizeThings() if isinstance(t, T.SanitizeBoundingBoxes) else t for t in train.transforms]
        return T.Compose(steps), val

    def build_data(self) -> TaskData:
        train, val = build_panoptic_splits(self.cfg.data)
        train_tf, val_tf = self.transforms()
        self.val_set, self.train_set = val.with_transform(val_tf), train
        c = train.categories
        self.info = {"num_classes": train.num_classes, "class_names": c.thing_names, "category_ids": list(c.things),
                     "stuff_ids": list(c.stuff), "semantic_names": c.semantic_names,
                     "categories": [dict(x) for x in c.raw]}
        groups = [int(r >= 1.0) for r in train.aspect_ratios()] if self.cfg.task.group_aspect else None
        return TaskData(train.with_transform(train_tf), self.val_set, self.info, random_transforms=True,
                        train_collate=collate_panoptic, eval_collate=collate_panoptic, group_ids=groups)

    def build_model(self, info: dict[str, Any]) -> nn.Module:
        from visiontrain.models.panoptic import PanopticFPN

        self.info = info  # predict's fusion reads the categories from it (a checkpoint's data_info)
        detector = super().build_model(info)
        return PanopticFPN(detector, len(info["semantic_names"]), self.cfg.task.semantic_head_width)

    def param_groups(self, model: nn.Module, rules: Callable[..., list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """The R-CNN's groups (``RcnnTask.param_groups``), except that the semantic head's norm layers
        train under ``task.frozen_bn`` too: frozen batch norm is the pretrained backbone's, and the
        head is new (Detectron2 trains its GroupNorm)."""
        t = self.cfg.task
        return rules(model, norms=NormGroups(frozen=t.frozen_bn, weight_decay=t.weight_decay_norm,
                                             trained=("semantic_head.",)))

    def losses(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        images, _, targets, semantic = batch
        sizes = [t["hw"] for t in targets]  # Python ints from the collate: no device read
        _, losses, logits = model(images, sizes, self.model_targets(targets))
        logits = F.interpolate(logits.float(), size=images.shape[-2:], mode="bilinear", align_corners=False)
        return {**losses, "loss_sem": labelled_cross_entropy(logits, semantic, IGNORE_INDEX)}

    def fusion(self) -> Any:
        from visiontrain.models.panoptic import FusionSettings

        t = self.cfg.task
        return FusionSettings(t.overlap_thresh, t.stuff_area, t.instance_score_thresh)

    def segment_batch(self, model: nn.Module, images: torch.Tensor, mask: torch.Tensor,
                      orig_sizes: torch.Tensor) -> list[dict[str, Any]]:
        """Each image's panoptic segmentation at its original size: ``{"ids": int32 [H, W],
        "segments": segments_info}`` (``fuse_panoptic`` of its instances and semantic argmax)."""
        from visiontrain.models.panoptic import fuse_panoptic

        real = ~mask
        heights, widths = real.any(dim=2).sum(dim=1), real.any(dim=1).sum(dim=1)
        sizes = list(zip(heights.tolist(), widths.tolist()))  # host sync (evaluation: RoI heads need ints)
        detections, _, logits = model(images, sizes)
        logits = F.interpolate(logits.float(), size=images.shape[-2:], mode="bilinear", align_corners=False)
        out = []
        for i, (det, (h, w), orig) in enumerate(zip(detections, sizes, orig_sizes)):
            kept = det["scores"] >= self.cfg.task.instance_score_thresh  # the fusion reads no other: none pasted
            det = self.in_original_image({k: v[kept] for k, v in det.items()}, h, w, orig)
            oh, ow = det["masks"].shape[-2:]
            semantic = SemanticTask.label_maps(logits[i:i + 1], [(h, w, oh, ow)])[0]
            ids, segments = fuse_panoptic(det["scores"], det["labels"], det["masks"], semantic,
                                          self.info["category_ids"], self.info["stuff_ids"], self.fusion())
            out.append({"ids": ids, "segments": segments})
        return out

    def evaluate(self, model: nn.Module, data: EvalData) -> dict[str, Any]:
        """PQ, SQ, RQ (overall, ``_th``, ``_st``) and their per-class table, from every rank's images."""
        quality = PanopticQuality(self.info["categories"])
        shown = []
        for (images, mask, targets, _), real in data:
            orig = torch.stack([t["orig_size"] for t in targets])
            for target, pred in zip(targets[real], self.segment_batch(model, images, mask, orig)[real]):
                index = self.val_set.index_of[int(target["image_id"])]
                truth, truth_segments = self.val_set.truth(index)
                ids = pred["ids"].cpu().numpy()  # host sync (evaluation)
                quality.update(truth, truth_segments, ids, pred["segments"], image=int(target["image_id"]))
                if len(shown) < SHOWN_IMAGES:
                    shown.append((index, truth, truth_segments, ids, pred["segments"]))
        parts = data.gather([quality], dst=0)
        if parts is None:  # not rank 0
            return {}
        for part in parts[1:]:
            parts[0].merge(part)
        self.shown = [self.shown_image(*item) for item in shown]
        return pq_metrics(parts[0].compute())

    def category_map(self, ids: np.ndarray, segments: SegmentsInfo) -> np.ndarray:
        """An id map as category indices for the figures: things 0..T-1, stuff after them, VOID 255."""
        order = [*self.info["category_ids"], *self.info["stuff_ids"]]
        out = np.full(ids.shape, IGNORE_INDEX, dtype=np.int64)
        for segment in parse_segments(segments):
            out[ids == segment.id] = order.index(segment.category_id)
        return out

    def shown_image(self, index: int, truth: np.ndarray, truth_segments: SegmentsInfo, ids: np.ndarray,
                    segments: SegmentsInfo) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One drawn image: its pixels in [0, 1] and both segmentations as category maps."""
        image, _ = self.val_set.with_transform(None).load(index)
        pixels = image.as_subclass(torch.Tensor).permute(1, 2, 0).numpy() / 255.0
        return pixels, self.category_map(truth, truth_segments), self.category_map(ids, segments)

    def eval_figures(self) -> dict[str, Any]:
        """``val_panoptic``: the first validation images' ground truth beside the prediction, by category."""
        if not self.shown:
            return {}
        names = [*self.info["class_names"], *(n for n in self.info["semantic_names"][1:])]
        return {"val_panoptic": segmentation_figure(self.shown, names)}

    def preview_figures(self, batch: Any) -> dict[str, Any]:
        """The first training batch with its things' boxes and masks, as the model receives it."""
        images, _, targets, _ = batch
        return {"train_batch": self.train_batch_figure(images, targets)}

    @torch.no_grad()
    def predict(self, model: nn.Module, images: list[torch.Tensor], device: torch.device
                ) -> list[dict[str, Any]]:
        """Each raw image's panoptic segmentation at its own size: ``{"ids": int32 [H, W], "segments":
        segments_info}``, prepared and fused as evaluation does."""
        from torchvision import tv_tensors

        _, val_tf = self.transforms()
        samples = [val_tf(tv_tensors.Image(img), self.empty_target(*img.shape[-2:])) for img in images]
        batch, mask, targets, _ = collate_panoptic(samples)
        orig = torch.stack([t["orig_size"] for t in targets]).to(device)
        model.eval()
        return [{"ids": p["ids"].cpu(), "segments": p["segments"]}  # host sync (prediction output)
                for p in self.segment_batch(model, batch.to(device), mask.to(device), orig)]

    @staticmethod
    def empty_target(h: int, w: int) -> dict[str, Any]:
        from torchvision import tv_tensors

        return {"boxes": tv_tensors.BoundingBoxes(torch.zeros(0, 4), format="XYXY", canvas_size=(h, w)),
                "labels": torch.zeros(0, dtype=torch.int64), "image_id": 0, "orig_size": torch.tensor([h, w]),
                "semantic": tv_tensors.Mask(torch.zeros((h, w), dtype=torch.uint8))}

    def export_spec(self, model: nn.Module, info: dict[str, Any]) -> ExportSpec:
        """The Mask R-CNN's export (``MaskRcnnTask.export_spec``) with a fifth output, the semantic
        logits at the padded input's size; the metadata says how ``predict`` fuses them."""
        from visiontrain.models.panoptic import PanopticExport

        spec = super().export_spec(model.detector, info)
        t = self.cfg.task
        metadata = {**spec.metadata, "stuff_category_ids": list(info["stuff_ids"]),
                    "semantic_classes": list(info["semantic_names"]), "fusion": {
                        "overlap_thresh": t.overlap_thresh, "stuff_area": t.stuff_area,
                        "instance_score_thresh": t.instance_score_thresh, "rule": FUSION},
                    "output": f"{spec.metadata['output']}; semantic [1, S, H, W]: logits of the semantic classes "
                              f"(semantic_classes: 0 every thing, 1 + k the k-th stuff category) at the padded "
                              f"input's size"}
        return dataclasses.replace(spec, module=PanopticExport(model).eval(),
                                   output_names=[*spec.output_names, "semantic"], metadata=metadata,
                                   dynamic_axes={**spec.dynamic_axes, "semantic": {2: "height", 3: "width"}})


#: How ``predict`` turns an exported file's outputs into a panoptic segmentation, in words.
FUSION = ("in the original image: paste each detection's mask (mask_paste), take the semantic logits cut to the "
          "resized image and resized bilinearly to the original, argmax; then, detections by score, best first, "
          "while score >= instance_score_thresh: skip one whose mask has more than overlap_thresh of its pixels "
          "already taken, else give its free pixels a new segment id; then each stuff class k >= 1 of the argmax: "
          "its free pixels become a segment (category stuff_category_ids[k - 1]) if there are at least stuff_area "
          "of them; the rest is VOID (id 0)")


register_task("panoptic", PanopticTask, PanopticConfig)
