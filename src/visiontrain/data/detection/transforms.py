"""Box-aware detection transforms (torchvision.transforms.v2) and the detection collate.

DETR's train pipeline: horizontal flip, then either a multi-scale resize of the shorter side, or
resize -> random-size crop -> multi-scale resize; SanitizeBoundingBoxes after the crop drops boxes
the crop emptied (with their labels); then to float and ImageNet normalisation (on the CPU, or
on the device with ``data.normalize.NormalizeOnDevice``). Boxes stay absolute
XYXY (tv_tensors keep them in step with every geometric op); a model that wants normalised cxcywh
converts them itself from each image's own size (``normalized_cxcywh``), so the same pipeline
serves every detector.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from visiontrain.core._tv_compat import ensure_torchvision

ensure_torchvision()
import torchvision.transforms.v2 as T  # noqa: E402
import torchvision.transforms.v2.functional as TF  # noqa: E402
from torchvision import tv_tensors  # noqa: E402
from torchvision.ops import box_convert  # noqa: E402

from visiontrain.data.normalize import IMAGENET_MEAN, IMAGENET_STD  # noqa: E402  (re-exported)


class RandomSizeCrop(T.Transform):
    """Crop a random region whose width and height are drawn in [min_size, max_size] (and no larger
    than the image), at a random position: DETR's RandomSizeCrop, as a v2 transform."""

    def __init__(self, min_size: int, max_size: int) -> None:
        super().__init__()
        self.min_size, self.max_size = min_size, max_size

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        h, w = T._utils.query_size(flat_inputs)
        cw = int(torch.randint(min(self.min_size, w), min(w, self.max_size) + 1, ()))
        ch = int(torch.randint(min(self.min_size, h), min(h, self.max_size) + 1, ()))
        top = int(torch.randint(0, h - ch + 1, ()))
        left = int(torch.randint(0, w - cw + 1, ()))
        return {"top": top, "left": left, "height": ch, "width": cw}

    def transform(self, inpt: Any, params: dict[str, Any]) -> Any:
        return self._call_kernel(TF.crop, inpt, **params)


def target_labels(sample: tuple[Any, dict[str, Any]]) -> torch.Tensor:
    """The labels of an (image, target) sample, for SanitizeBoundingBoxes: a module-level function,
    so that a transform holding it pickles (forkserver and spawn workers receive it pickled)."""
    return sample[1]["labels"]


def sanitize_boxes() -> T.SanitizeBoundingBoxes:
    """Drops boxes a crop or a resize left empty or degenerate, with their labels."""
    return T.SanitizeBoundingBoxes(labels_getter=target_labels)


def to_model_input(on_device: bool = False) -> list[Any]:
    """A pipeline's last steps: uint8 -> float in [0, 1] -> ImageNet normalisation. None when the
    device does them (``data.normalize_on_device``, ``data.normalize.NormalizeOnDevice``): the CPU
    then skips a float pass over every pixel, and collates, pins and copies a quarter of the bytes."""
    if on_device:
        return []
    return [T.ToDtype(torch.float32, scale=True), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]


def detr_train_transform(scales: Sequence[int], max_size: int, crop_resize: Sequence[int],
                         crop_min: int, crop_max: int, on_device: bool = False) -> T.Compose:
    """DETR's augmentation with the sizes given (the paper: scales 480..800 step 32, max 1333,
    crop branch resize 400/500/600 and crop 384..600)."""
    return T.Compose([
        T.RandomHorizontalFlip(),
        T.RandomChoice([
            T.RandomShortestSize(list(scales), max_size=max_size),
            T.Compose([T.RandomShortestSize(list(crop_resize)), RandomSizeCrop(crop_min, crop_max),
                       T.RandomShortestSize(list(scales), max_size=max_size)]),
        ]),
        sanitize_boxes(),
        *to_model_input(on_device),
    ])


def detr_val_transform(size: int, max_size: int) -> T.Compose:
    return T.Compose([T.Resize(size, max_size=max_size), *to_model_input()])


def normalized_cxcywh(boxes: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Absolute XYXY -> cxcywh divided by the image's own (unpadded) size, in [0, 1]."""
    scale = torch.tensor([width, height, width, height], dtype=boxes.dtype, device=boxes.device)
    return box_convert(boxes.as_subclass(torch.Tensor), "xyxy", "cxcywh") / scale


def collate_detection(batch: list[tuple[Any, dict[str, Any]]], size_divisible: int = 32
                      ) -> tuple[torch.Tensor, torch.Tensor, list[dict[str, Any]]]:
    """Pad images into one [B, 3, H, W] tensor (H, W rounded up to ``size_divisible``) with a
    pixel mask [B, H, W] (True = padding, DETR's NestedTensor); targets stay a list, each with
    ``size`` = (h, w) of its image after the transforms, and its ``masks`` where the data has them."""
    images = [img.as_subclass(torch.Tensor) for img, _ in batch]
    h = max(i.shape[-2] for i in images)
    w = max(i.shape[-1] for i in images)
    h, w = -(-h // size_divisible) * size_divisible, -(-w // size_divisible) * size_divisible
    out = images[0].new_zeros((len(images), images[0].shape[0], h, w))
    mask = torch.ones((len(images), h, w), dtype=torch.bool)
    targets = []
    for i, (img, (_, target)) in enumerate(zip(images, batch)):
        ih, iw = img.shape[-2:]
        out[i, :, :ih, :iw] = img
        mask[i, :ih, :iw] = False
        targets.append({"boxes": target["boxes"].as_subclass(torch.Tensor), "labels": target["labels"],
                        "image_id": target["image_id"], "orig_size": target["orig_size"],
                        "size": torch.tensor([ih, iw])})
        if "masks" in target:  # instance masks [N, ih, iw], unpadded: the boxes never reach the padding
            targets[-1]["masks"] = target["masks"].as_subclass(torch.Tensor)
    return out, mask, targets
