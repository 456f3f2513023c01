"""YOLOv3's box-aware transforms (torchvision.transforms.v2), after GluonCV's YOLO3DefaultTrainTransform:
photometric distortion, random expand (zoom out, filled with the mean colour), SSD's IoU crop, resize,
horizontal flip; boxes stay absolute XYXY through every geometric op.

Resize either stretches to ``size`` x ``size`` (GluonCV) or letterboxes: the longer side becomes
``size`` and the aspect ratio is kept; the collate pads the rest (bottom / right), and the model
maps its boxes back to the original image from each image's unpadded size. Multi-scale training
happens later, on the device, on the whole padded batch (``models.yolo_loss.rescale_batch``).
"""
from __future__ import annotations

from typing import Any

import torch

from visiontrain.core._tv_compat import ensure_torchvision
from visiontrain.data.detection.transforms import IMAGENET_MEAN, sanitize_boxes, to_model_input

ensure_torchvision()
import torchvision.transforms.v2 as T  # noqa: E402
from torchvision import tv_tensors  # noqa: E402

_MEAN_PIXEL = tuple(int(round(255 * m)) for m in IMAGENET_MEAN)  # expand fill: 0 after normalisation


def _resize(size: int, letterbox: bool) -> Any:
    return T.Resize(None, max_size=size) if letterbox else T.Resize((size, size))


def yolo_train_transform(size: int, *, letterbox: bool = False, flip: bool = True, photometric: bool = True,
                         zoom_out: float = 4.0, iou_crop: bool = True, on_device: bool = False) -> T.Compose:
    """GluonCV's training augmentation with each part switchable (the CPU recipe drops the costly ones)."""
    steps: list[Any] = []
    if photometric:
        steps.append(T.RandomPhotometricDistort(p=0.5))
    if zoom_out > 1:
        steps.append(T.RandomZoomOut(fill={tv_tensors.Image: _MEAN_PIXEL, "others": 0},
                                     side_range=(1.0, zoom_out), p=0.5))
    if iou_crop:
        steps.append(T.RandomIoUCrop())
    steps.append(_resize(size, letterbox))
    if flip:
        steps.append(T.RandomHorizontalFlip())
    steps.append(sanitize_boxes())
    return T.Compose(steps + to_model_input(on_device))


def yolo_val_transform(size: int, *, letterbox: bool = False) -> T.Compose:
    return T.Compose([_resize(size, letterbox), *to_model_input()])
