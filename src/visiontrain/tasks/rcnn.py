"""Faster R-CNN with an FPN, trained the way seamseg trains its two-stage detectors.

What comes from seamseg (``scripts/train_detection.py``): the four losses weighted by
``task.loss_weights`` (its ``loss_weights``), SGD with Nesterov momentum, parameter groups that
split norm layers from the rest (norm lr 0 when batch norm is frozen, no weight decay on norms
unless ``weight_decay_norm``), a per-iteration poly schedule with a burn-in from a third of the lr
(``schedules.lr: {shape: poly, warmup: 500, warmup_factor: 0.333}``), frozen first backbone stages
and frozen batch norm. The network is torchvision's (``models/rcnn.py``); DetectionTask supplies the
data, aspect-ratio grouped batches, COCO evaluation and prediction.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from visiontrain.core._tv_compat import ensure_torchvision
from visiontrain.core.config import doc
from visiontrain.engine.optim.param_groups import NormGroups
from visiontrain.engine.protocols.task import ExportSpec, TaskData, register_task
from visiontrain.tasks.detection import DetectionConfig, DetectionTask, unread_data_keys

LOSSES = ("loss_objectness", "loss_rpn_box_reg", "loss_classifier", "loss_box_reg")


@dataclass
class RcnnConfig(DetectionConfig):
    unread_data_keys: ClassVar[dict[str, str]] = unread_data_keys(
        "task.train_scales, task.max_size and task.val_size",
        "flips and multi-scale training: task.vertical_flip, task.train_scales")
    name: str = doc("task name", "rcnn")
    backbone: str = doc("resnet18 | resnet34 | resnet50 | resnet101 | mobilenet_v3_large", "resnet50")
    trainable_layers: int = doc("backbone stages trained, from the top (resnet 0-5, 5 = all; mobilenet 0-6); "
                                "the rest frozen, their batch norm too", 3)
    frozen_bn: bool = doc("FrozenBatchNorm2d in the whole backbone, and lr 0 for any trainable norm layer left "
                          "(seamseg bn_frozen); needs pretrained weights to make sense", True)
    weight_decay_norm: bool = doc("weight decay on norm-layer parameters too (seamseg weight_decay_norm)", False)
    returned_layers: list[int] = doc("backbone stages fed to the FPN (resnet 1-4; mobilenet stage indices)",
                                     factory=lambda: [1, 2, 3, 4])
    fpn_channels: int = doc("FPN width", 256)
    anchor_sizes: list[int] = doc("anchor side per FPN level (one per returned layer + the pooled level)",
                                  factory=lambda: [32, 64, 128, 256, 512])
    aspect_ratios: list[float] = doc("anchor aspect ratios (h/w) at every level", factory=lambda: [0.5, 1.0, 2.0])
    representation_size: int = doc("width of the box head's two fully connected layers", 1024)
    rpn_pre_nms_top_n: list[int] = doc("RPN proposals kept per level before NMS [train, test]",
                                       factory=lambda: [2000, 1000])
    rpn_post_nms_top_n: list[int] = doc("RPN proposals kept per image after NMS [train, test]",
                                        factory=lambda: [2000, 1000])
    rpn_batch_size_per_image: int = doc("anchors sampled per image for the RPN losses", 256)
    box_batch_size_per_image: int = doc("proposals sampled per image for the RoI head losses", 512)
    box_score_thresh: float = doc("evaluation: drop detections scoring below this", 0.05)
    box_nms_thresh: float = doc("evaluation: per-class NMS IoU", 0.5)
    detections_per_img: int = doc("evaluation: detections kept per image", 100)
    train_scales: list[int] = doc("shorter-side sizes drawn for training", factory=lambda: [800])
    max_size: int = doc("cap on the longer side", 1333)
    vertical_flip: bool = doc("also flip training images vertically (aerial photos)", False)


def collate_with_sizes(batch: list[tuple[Any, dict[str, Any]]]) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    """The detection collate plus ``hw``: each image's real (h, w) as Python ints, read from the
    images' shapes here in the data loader, so the training step never reads sizes from the device."""
    from visiontrain.data.detection.transforms import collate_detection

    images, mask, targets = collate_detection(batch)
    for (img, _), target in zip(batch, targets):
        target["hw"] = (int(img.shape[-2]), int(img.shape[-1]))
    return images, mask, targets


class RcnnTask(DetectionTask):
    name = "rcnn"
    default_loss_weights = {k: 1.0 for k in LOSSES}
    metric, mode = "AP", "max"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        t = cfg.task
        if not t.train_scales:
            raise ValueError("task.train_scales: give at least one training size")
        if t.val_size >= t.max_size or max(t.train_scales) > t.max_size:
            raise ValueError(f"task.val_size={t.val_size} must be below and task.train_scales={t.train_scales} at most "
                             f"task.max_size={t.max_size} (the longer side is capped at max_size)")

    def transforms(self) -> tuple[Any, Any]:
        ensure_torchvision()
        import torchvision.transforms.v2 as T

        from visiontrain.data.detection.transforms import sanitize_boxes, to_model_input

        t = self.cfg.task
        flips = [T.RandomHorizontalFlip()] + ([T.RandomVerticalFlip()] if t.vertical_flip else [])
        train = T.Compose([*flips, T.RandomShortestSize(list(t.train_scales), max_size=t.max_size),
                           sanitize_boxes(),
                           *to_model_input(self.cfg.data.normalize_on_device)])
        return train, T.Compose([T.Resize(t.val_size, max_size=t.max_size), *to_model_input()])

    def build_data(self) -> TaskData:
        data = super().build_data()
        data.train_collate = data.eval_collate = collate_with_sizes
        return data

    def build_model(self, info: dict[str, Any]) -> nn.Module:
        from visiontrain.models.rcnn import FasterRcnnSpec, build_faster_rcnn

        t = self.cfg.task  # the spec's keys are this section's, the mask head this task's
        keys = [f.name for f in fields(FasterRcnnSpec) if f.name != "mask_head"]
        return build_faster_rcnn(info["num_classes"],
                                 FasterRcnnSpec(**{k: getattr(t, k) for k in keys}, mask_head=self.mask_head()))

    def mask_head(self) -> Any:
        """The mask branch (``models.rcnn.MaskHead``), None for a box detector: ``mask_rcnn`` has one."""
        return None

    def param_groups(self, model: nn.Module, rules: Callable[..., list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """seamseg's groups: norm-layer parameters (lr 0 under frozen_bn, no weight decay unless
        weight_decay_norm) and the rest. The engine's rules build them, so ``optim.lr_mult`` and
        ``optim.no_decay_bias_norm`` still apply on top and every optim key keeps its meaning."""
        t = self.cfg.task
        return rules(model, norms=NormGroups(frozen=t.frozen_bn, weight_decay=t.weight_decay_norm))

    def model_targets(self, targets: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
        """The targets as torchvision's heads take them: labels from 1 (0 = background)."""
        return [{"boxes": t["boxes"], "labels": t["labels"] + 1} for t in targets]

    def losses(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        images, _, targets = batch
        sizes = [t["hw"] for t in targets]  # Python ints from the collate: no device read
        _, losses = model(images, sizes, self.model_targets(targets))
        return losses

    def predict_batch(self, model: nn.Module, images: torch.Tensor, mask: torch.Tensor,
                      orig_sizes: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        real = ~mask
        heights, widths = real.any(dim=2).sum(dim=1), real.any(dim=1).sum(dim=1)
        sizes = list(zip(heights.tolist(), widths.tolist()))  # host sync (evaluation: RoI heads need ints)
        detections, _ = model(images, sizes)
        return [self.in_original_image(det, h, w, orig) for det, (h, w), orig in zip(detections, sizes, orig_sizes)]

    def in_original_image(self, det: dict[str, torch.Tensor], height: int, width: int,
                          orig_size: torch.Tensor) -> dict[str, torch.Tensor]:
        """One image's detections, made in its prepared (resized) ``height`` x ``width`` pixels, in
        the original image's pixels (``orig_size`` (h, w)) with 0-based labels."""
        scale = torch.stack([orig_size[1] / width, orig_size[0] / height]).repeat(2).to(det["boxes"].dtype)
        return {"boxes": det["boxes"] * scale, "scores": det["scores"], "labels": det["labels"] - 1}

    def export_spec(self, model: nn.Module, info: dict[str, Any]) -> ExportSpec:
        """The whole detector with post-processing on one prepared image (resized so its shorter
        side is ``val_size``, ImageNet-normalised), of any height and width, padded inside the graph
        as ``predict`` pads it: boxes in that image's pixels, 0-based labels, scores. torchvision's
        R-CNN exports to ONNX with its NMS (opset >= 11); the export is checked on a second, wider
        image too, whose width is no multiple of 32 (the padding is not a constant of the graph)."""
        from visiontrain.models.rcnn import RcnnExport

        t = self.cfg.task
        side = -(-t.val_size // 32) * 32
        seed = torch.Generator().manual_seed(0)
        example = torch.randn(1, 3, side, side, generator=seed)
        wide = torch.randn(1, 3, side, side * 3 // 2 + 9, generator=seed)
        detections = {n: {0: "detections"} for n in ("boxes", "labels", "scores")}
        metadata = {**self.export_metadata(info), "input_size": {"height": "dynamic", "width": "dynamic"},
                    "resize": {"mode": "shorter_side", "shorter_side": t.val_size, "max_longer_side": t.max_size},
                    "pad": "in the graph: bottom and right to a multiple of 32 with 0, after normalising; "
                           "feed the resized image unpadded",
                    "box_format": "xyxy", "box_frame": "pixels of the input image (the resized one): multiply by "
                                                      "original / resized width and height for the original image's",
                    "output": "boxes [N, 4], labels [N], scores [N] after NMS, best first; no score threshold "
                              f"beyond task.box_score_thresh={t.box_score_thresh}"}
        return ExportSpec(RcnnExport(model).eval(), (example,), ["image"], ["boxes", "labels", "scores"],
                          dynamic_batch=False, dynamic_axes={"image": {2: "height", 3: "width"}, **detections},
                          check_inputs=[(wide,)], metadata=metadata)


register_task("rcnn", RcnnTask, RcnnConfig)
