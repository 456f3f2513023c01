"""YOLOv3, GluonCV style: Darknet-53 (or a smaller timm backbone), nine anchors over three scales,
four logged losses, batch mixup switched off for the last epochs, multi-scale training, per-class
NMS, and VOC07 11-point mAP next to COCO AP at every evaluation.

The engine settings GluonCV's script hard-codes (SGD momentum 0.9, weight decay 5e-4 with none on
biases and BN, warmup then step / cosine / poly) are recipe keys; what is YOLO-specific lives here
and in ``models.yolo`` / ``models.yolo_loss``: all of it runs on the device without host reads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from visiontrain.core.config import doc
from visiontrain.engine.protocols.hooks import Hook
from visiontrain.engine.protocols.task import ExportSpec, register_task
from visiontrain.engine.step.eval_loop import EvalData
from visiontrain.evaluation.voc import voc_map
from visiontrain.models import MIN_BOX_SIZE
from visiontrain.models.yolo import COCO_ANCHORS, STRIDES, YOLOv3, decode, postprocess
from visiontrain.models.yolo_loss import build_targets, mixup, multiscale_size, pad_targets, rescale_batch, yolo_losses
from visiontrain.rundir.metrics_file import PER_CLASS
from visiontrain.tasks.detection import DetectionConfig, DetectionTask, predictions_and_truths, unread_data_keys


@dataclass
class YoloConfig(DetectionConfig):
    unread_data_keys: ClassVar[dict[str, str]] = unread_data_keys(
        "task.size, task.val_size and task.multiscale_sizes",
        "GluonCV's: task.flip, task.photometric, task.zoom_out, task.iou_crop, task.mixup")
    name: str = doc("task name", "yolo")
    backbone: str = doc("timm feature extractor with stride 8/16/32 maps: darknet53 (the paper), "
                        "cs3darknet_focus_s, resnet18, ...", "darknet53")
    backbone_width: float = doc("channel multiplier for timm's Darknet / CSP-Darknet backbones (0.25: a "
                                "CPU-sized Darknet); 1.0 = as published", 1.0)
    neck_channels: list[int] = doc("widths of the detection blocks at stride 32, 16, 8",
                                   factory=lambda: [512, 256, 128])
    anchors: list[list[float]] = doc("anchor (w, h) in input pixels, 3 x k pairs: k for stride 8, then 16, 32",
                                     factory=lambda: [list(a) for a in COCO_ANCHORS])
    obj_prior: float = doc("initial objectness probability (bias of the objectness outputs)", 0.01)
    size: int = doc("training input side (letterbox: the longer side)", 416)
    val_size: int = doc("evaluation / prediction input side", 416)
    letterbox: bool = doc("keep the aspect ratio (longer side = size, padded) instead of stretching to "
                          "size x size as GluonCV does", False)
    multiscale_sizes: list[int] = doc("input sides drawn every multiscale_interval steps, on the device "
                                      "(multiples of 32; empty = always `size`)",
                                      factory=lambda: list(range(320, 609, 32)))
    multiscale_interval: int = doc("optimizer steps between input-size draws", 10)
    flip: bool = doc("random horizontal flip", True)
    photometric: bool = doc("random brightness / contrast / saturation / hue (SSD's photometric distort)", True)
    zoom_out: float = doc("random expand (zoom out) up to this factor, p=0.5 (1 = off)", 4.0)
    iou_crop: bool = doc("SSD's random IoU-constrained crop", True)
    extra_match_iou: float | None = doc("also assign a box to every other anchor whose shape IoU with it is above "
                                        "this (YOLOv4: more positives, faster from scratch); null = the best "
                                        "anchor only, as GluonCV", None)
    ignore_iou: float = doc("no objectness loss for predictions overlapping a ground truth above this IoU", 0.7)
    label_smoothing: bool = doc("GluonCV's class label smoothing: targets 1 - e and e, e = min(1/C, 1/40)", False)
    mixup: bool = doc("mix each batch with a permutation of itself (boxes of both kept, weighted)", False)
    mixup_alpha: float = doc("mixup ratio ~ Beta(alpha, alpha)", 1.5)
    no_mixup_epochs: int = doc("switch mixup off for the last N epochs", 20)
    conf_threshold: float = doc("drop detections scoring below this before NMS", 0.01)
    nms_iou: float = doc("per-class NMS IoU threshold", 0.45)
    pre_nms_topk: int = doc("(box, class) candidates per image going into NMS", 400)
    max_detections: int = doc("detections kept per image after NMS", 100)
    group_aspect: bool = doc("batch images of like aspect ratio together (useful with letterbox)", True)


def _check_config(t: YoloConfig) -> None:
    """Every value the model, targets and transforms rely on, checked before anything is built."""
    if not t.anchors or len(t.anchors) % 3 or any(len(a) != 2 or min(a) <= 0 for a in t.anchors):
        raise ValueError(f"task.anchors: need 3 x k positive (w, h) pairs, got {t.anchors}")
    for key in ("size", "val_size"):
        if getattr(t, key) < 32:
            raise ValueError(f"task.{key}: must be at least 32, got {getattr(t, key)}")
    bad = [s for s in t.multiscale_sizes if s < 32 or s % 32]
    if bad:
        raise ValueError(f"task.multiscale_sizes: sizes must be multiples of 32 (>= 32), got {bad}")
    if t.multiscale_interval < 1:
        raise ValueError(f"task.multiscale_interval: must be >= 1, got {t.multiscale_interval}")
    if t.mixup and t.mixup_alpha <= 0:
        raise ValueError(f"task.mixup_alpha: must be > 0 with task.mixup=true, got {t.mixup_alpha}")
    if t.zoom_out < 1:
        raise ValueError(f"task.zoom_out: must be >= 1 (1 = off), got {t.zoom_out}")
    if t.extra_match_iou is not None and not 0 < t.extra_match_iou < 1:
        raise ValueError(f"task.extra_match_iou: must be in (0, 1) or null, got {t.extra_match_iou}")
    for key in ("ignore_iou", "nms_iou", "obj_prior"):
        if not 0 < getattr(t, key) < 1:
            raise ValueError(f"task.{key}: must be in (0, 1), got {getattr(t, key)}")
    if t.pre_nms_topk < 1 or t.max_detections < 1:
        raise ValueError(f"task.pre_nms_topk / task.max_detections: must be >= 1, got "
                         f"{t.pre_nms_topk} / {t.max_detections}")


class YoloSchedule(Hook):
    """Tells the task the optimizer step (multi-scale sizes are a function of it) and switches mixup
    off for the last ``no_mixup_epochs`` epochs; both derive from the trainer's checkpointed state."""

    def before_epoch(self) -> None:
        task, epochs = self.trainer.task, self.trainer.progress.epochs
        task.mixing = task.cfg.task.mixup and self.trainer.epoch < epochs - task.cfg.task.no_mixup_epochs

    def before_step(self) -> None:
        self.trainer.task.step = self.trainer.step


class YoloTask(DetectionTask):
    name = "yolo"
    default_loss_weights = {"loss_obj": 1.0, "loss_center": 1.0, "loss_scale": 1.0, "loss_cls": 1.0}
    metric, mode = "AP50", "max"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        _check_config(cfg.task)
        self.mixing = cfg.task.mixup
        self.step = 0
        self.num_classes = 0
        self._anchors: dict[torch.device, torch.Tensor] = {}

    def transforms(self) -> tuple[Any, Any]:
        from visiontrain.data.detection.yolo_transforms import yolo_train_transform, yolo_val_transform

        t = self.cfg.task
        train = yolo_train_transform(t.size, letterbox=t.letterbox, flip=t.flip, photometric=t.photometric,
                                     zoom_out=t.zoom_out, iou_crop=t.iou_crop,
                                     on_device=self.cfg.data.normalize_on_device)
        return train, yolo_val_transform(t.val_size, letterbox=t.letterbox)

    def build_model(self, info: dict[str, Any]) -> nn.Module:
        t = self.cfg.task
        self.num_classes = info["num_classes"]
        return YOLOv3(info["num_classes"], len(t.anchors) // 3, backbone=t.backbone, backbone_width=t.backbone_width,
                      neck_channels=t.neck_channels, pretrained_backbone=t.pretrained_backbone,
                      obj_prior=t.obj_prior)

    def losses(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Multi-scale resize, then mixup, then targets from the decoded predictions: in that order
        so the targets see the boxes exactly as the network sees the pixels. All on the device."""
        t = self.cfg.task
        images, _, targets = batch
        boxes, labels = pad_targets(targets, images.device)
        if t.multiscale_sizes:
            size = multiscale_size(self.cfg.seed, self.step, t.multiscale_sizes, t.multiscale_interval)
            images, boxes = rescale_batch(images, boxes, size / t.size)
        if self.mixing and images.shape[0] > 1:
            images, boxes, labels, weights = mixup(images, boxes, labels, t.mixup_alpha)
        else:
            weights = (labels >= 0).to(images.dtype)
        anchors = self.anchors(images.device)
        pred, pred_boxes, sizes = decode(model(images), anchors, self.num_classes)
        assigned = build_targets(boxes, labels, weights, pred_boxes, anchors, sizes, tuple(images.shape[-2:]),
                                 self.num_classes, ignore_iou=t.ignore_iou, label_smoothing=t.label_smoothing,
                                 extra_match_iou=t.extra_match_iou)
        return yolo_losses(pred, assigned)

    def anchors(self, device: torch.device) -> torch.Tensor:
        """The configured anchors as a [K, 2] tensor on ``device``: copied once per device, without
        waiting (a blocking copy each step waited for the step's queued kernels on CUDA)."""
        cached = self._anchors.get(device)
        if cached is None:
            anchors = torch.tensor(self.cfg.task.anchors, dtype=torch.float32)
            cached = self._anchors[device] = anchors.to(device, non_blocking=True)
        return cached

    def predict_batch(self, model: nn.Module, images: torch.Tensor, mask: torch.Tensor,
                      orig_sizes: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        t = self.cfg.task
        valid_hw = torch.stack([(~mask).any(2).sum(1), (~mask).any(1).sum(1)], 1)  # unpadded (h, w)
        return postprocess(model(images), self.anchors(images.device), self.num_classes, valid_hw, orig_sizes,
                           conf_threshold=t.conf_threshold, nms_iou=t.nms_iou, pre_nms_topk=t.pre_nms_topk,
                           max_detections=t.max_detections)

    def evaluate(self, model: nn.Module, data: EvalData) -> dict[str, Any]:
        """COCO AP (``eval.coco_backend``) and the VOC07 11-point mAP at IoU 0.5 (``voc07_mAP``, GluonCV's
        validation metric, difficult boxes ignored) from one pass over the validation set; the
        per-class table holds both (``voc07_AP`` beside COCO's columns)."""
        detections = self.collect_detections(model, data)
        if detections is None:  # not rank 0
            return {}
        metrics, per_class = self.score(detections)
        voc = voc07_from_coco_results(self.val_set.records, detections, self.info["category_ids"])
        metrics["voc07_mAP"] = voc["mAP"]
        for row, ap in zip(per_class.values(), voc["per_class"], strict=True):  # both in the dataset's class order
            row["voc07_AP"] = ap
        return {**metrics, PER_CLASS: per_class}

    def hooks(self) -> list[Hook]:
        return [YoloSchedule()]

    def export_spec(self, model: nn.Module, info: dict[str, Any]) -> ExportSpec:
        """The network up to its three raw maps (decoding and NMS are left to the caller, described
        in the metadata) on a square ``val_size`` batch of two (torch.export would specialise a batch
        of one to 1); batch, height and width left free, checked on a wider image too."""
        model.eval()
        size = self.cfg.task.val_size
        names = [f"out_stride{s}" for s in STRIDES]
        axes = {"images": {2: "height", 3: "width"},
                **{n: {2: f"height/{s}", 3: f"width/{s}"} for n, s in zip(names, STRIDES)}}
        wide = torch.randn(1, 3, size, size * 3 // 2, generator=torch.Generator().manual_seed(0))
        return ExportSpec(module=model, example_inputs=(torch.zeros(2, 3, size, size),), input_names=["images"],
                          output_names=names, dynamic_batch=True, dynamic_axes=axes, check_inputs=[(wide,)],
                          metadata=self._export_metadata(info))

    def _export_metadata(self, info: dict[str, Any]) -> dict[str, Any]:
        """How a program without visiontrain prepares an image and decodes the three maps (what
        ``predict_batch`` does, docs/inference.md's script does from these keys)."""
        t = self.cfg.task
        resize = {"mode": "longer_side", "longer_side": t.val_size} if t.letterbox else \
            {"mode": "stretch", "height": t.val_size, "width": t.val_size}
        return {**self.export_metadata(info), "input_size": {"height": "dynamic", "width": "dynamic"},
                "resize": resize, "anchors": t.anchors, "strides": list(STRIDES),
                "anchors_per_scale": len(t.anchors) // 3,
                "output": "per stride s: [B, A * (5 + C), H / s, W / s]; for anchor a the channels "
                          "a * (5 + C) + (tx, ty, tw, th, objectness, C class logits)",
                "decode": "centre = (sigmoid(tx, ty) + cell (x, y)) * s; size = exp(min(tw, 10), min(th, 10)) * "
                          "anchor (w, h) of that scale (anchors_per_scale anchors per stride, stride 8 first); "
                          "score = sigmoid(objectness) * sigmoid(class); boxes scaled to the original image and "
                          "clipped, sides under min_box_size dropped, the pre_nms_topk best (box, class) pairs above "
                          "conf_threshold, per-class NMS at nms_iou, the max_detections best",
                "pad": {"multiple": 32, "value": 0, "where": "bottom and right, after normalisation"},
                "box_format": "xyxy", "min_box_size": MIN_BOX_SIZE,
                "box_frame": "pixels of the input image (the resized one, without padding), once decoded",
                "conf_threshold": t.conf_threshold, "nms_iou": t.nms_iou, "pre_nms_topk": t.pre_nms_topk,
                "max_detections": t.max_detections}


register_task("yolo", YoloTask, YoloConfig)


def voc07_from_coco_results(records: list[Any], detections: list[dict], category_ids: list[int]) -> dict[str, Any]:
    """VOC07 11-point AP at IoU 0.5 of COCO-format results against the dataset's own records
    (absolute XYXY, contiguous labels, VOC ``difficult`` flags where the reader has them):
    ``voc_map``'s ``{"mAP", "per_class"}``, per class in the order of ``category_ids``."""
    preds, gts = predictions_and_truths(records, detections, category_ids)
    return voc_map(preds, gts, len(category_ids), use_07_metric=True)
