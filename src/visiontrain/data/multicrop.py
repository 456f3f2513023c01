"""DINO's multi-crop augmentation (torchvision.transforms.v2) and the dataset that applies it.

Two global crops (random resized crop, flip, colour jitter p 0.8, grayscale p 0.2, then blur with
p 1.0 on the first and 0.1 on the second, solarize p 0.2 on the second only) and N local crops
(smaller scale range, blur p 0.5). Crops are taken from the uint8 image (bicubic stays in range),
then converted to float and normalised with the mean/std of the evaluation datasets, so the k-NN
features and the training crops share one input distribution. On single-channel images saturation,
hue and grayscale are identities, as they are for PIL.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from visiontrain.data.datasets.in_memory import tv_v2


@dataclass(frozen=True)
class MultiCropSpec:
    global_size: int
    local_size: int
    local_crops: int
    global_scale: tuple[float, float] = (0.4, 1.0)
    local_scale: tuple[float, float] = (0.05, 0.4)
    jitter: tuple[float, float, float, float] = (0.4, 0.4, 0.2, 0.1)  # brightness, contrast, saturation, hue
    blur_sigma: tuple[float, float] = (0.1, 2.0)
    mean: tuple[float, ...] = (0.5,)
    std: tuple[float, ...] = (0.5,)

    def __post_init__(self) -> None:
        for key in ("global_scale", "local_scale", "blur_sigma"):
            lo, hi = getattr(self, key)
            if not 0 < lo <= hi:
                raise ValueError(f"task.{key}: expected 0 < low <= high, got {[lo, hi]}")
        if self.global_size < 1 or self.local_size < 1 or self.local_crops < 0:
            raise ValueError(f"multi-crop sizes must be >= 1 and local_crops >= 0, got global_crop_size="
                             f"{self.global_size}, local_crop_size={self.local_size}, local_crops={self.local_crops}")


def blur_kernel_size(sigma_max: float, size: int) -> int:
    """Odd kernel covering +-3 sigma, no larger than the crop."""
    k = 2 * math.ceil(3 * sigma_max) + 1
    return max(1, min(k, size if size % 2 else size - 1))


class MultiCrop:
    """``crops = MultiCrop(spec)(image)``: a list of 2 + N float tensors, globals first."""

    def __init__(self, spec: MultiCropSpec) -> None:
        self.spec = spec
        self._build()

    def _build(self) -> None:
        v2, s = tv_v2(), self.spec
        bicubic = v2.InterpolationMode.BICUBIC

        def view(size: int, scale: tuple[float, float], blur_p: float, solarize_p: float) -> Any:
            ops = [v2.ToImage(), v2.RandomResizedCrop(size, scale=scale, interpolation=bicubic, antialias=True),
                   v2.ToDtype(torch.float32, scale=True), v2.RandomHorizontalFlip(),
                   v2.RandomApply([v2.ColorJitter(*s.jitter)], p=0.8), v2.RandomGrayscale(p=0.2)]
            blur = v2.GaussianBlur(blur_kernel_size(s.blur_sigma[1], size), sigma=s.blur_sigma)
            ops.append(blur if blur_p >= 1.0 else v2.RandomApply([blur], p=blur_p))
            if solarize_p > 0:
                ops.append(v2.RandomSolarize(0.5, p=solarize_p))
            ops.append(v2.Normalize(s.mean, s.std))
            return v2.Compose(ops)

        self.global1 = view(s.global_size, s.global_scale, 1.0, 0.0)
        self.global2 = view(s.global_size, s.global_scale, 0.1, 0.2)
        self.local = view(s.local_size, s.local_scale, 0.5, 0.0)

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": asdict(self.spec)}  # v2 objects are rebuilt after the torchvision shim

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.spec = MultiCropSpec(**state["spec"])
        self._build()

    def __call__(self, image: Any) -> list[Tensor]:
        crops = [self.global1(image), self.global2(image)]
        crops += [self.local(image) for _ in range(self.spec.local_crops)]
        return [c.as_subclass(Tensor).contiguous() for c in crops]


class MultiCropDataset(Dataset):
    """Items ``(crops, label)`` from a source with ``raw_item(i) -> (uint8 image or PIL, label)``;
    the default collate turns a batch into ``[crop_0 [B,C,S,S], ..., crop_n], labels``."""

    def __init__(self, source: Any, spec: MultiCropSpec) -> None:
        if not hasattr(source, "raw_item"):
            raise TypeError(f"{type(source).__name__} has no raw_item(); multi-crop needs the raw images")
        self.source, self.transform = source, MultiCrop(spec)

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> tuple[list[Tensor], int]:
        image, label = self.source.raw_item(int(index))
        return self.transform(image), label
