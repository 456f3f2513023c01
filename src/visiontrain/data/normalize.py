"""ImageNet statistics and the device-side normalisation of uint8 batches.

``data.normalize_on_device=true`` ends the CPU pipelines at uint8: the loader collates, pins and
copies a quarter of the bytes and the CPU makes no float pass over the pixels (about a tenth of the
detection pipeline's CPU time, see BENCHMARKS.md); the step then scales and normalises on the GPU.
"""
from __future__ import annotations

from typing import Sequence

import torch

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class NormalizeOnDevice:
    """What ``ToDtype(float32, scale=True)`` + ``Normalize`` do on the CPU, done to a uint8 batch
    where it lies (the GPU): the same ops in the same order, so both paths agree to float rounding.
    Padding (``mask`` True, DETR's pixel mask) is set to 0, as the CPU path pads with 0 after
    normalising."""

    def __init__(self, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD) -> None:
        self.mean, self.std = tuple(mean), tuple(std)
        self._consts: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, images: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if images.dtype != torch.uint8:
            raise TypeError(f"data.normalize_on_device expects uint8 images from the loader, got {images.dtype}")
        consts = self._consts.get(images.device)
        if consts is None:  # made once per device: no per-step host-to-device copy
            c = images.shape[-3]
            # non_blocking: a copy from pageable memory is staged at once and waits for nothing;
            # a blocking one waits for every kernel queued before it (CUDA's sync debug mode says so)
            consts = self._consts[images.device] = (
                torch.tensor(self.mean).view(c, 1, 1).to(images.device, non_blocking=True),
                torch.tensor(self.std).view(c, 1, 1).to(images.device, non_blocking=True))
        mean, std = consts
        x = images.float().div_(255).sub_(mean).div_(std)  # .float() keeps channels_last
        if mask is not None:
            x.masked_fill_(mask.unsqueeze(-3), 0.0)
        return x
