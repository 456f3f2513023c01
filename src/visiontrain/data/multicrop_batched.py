"""DINO's multi-crop made on whole uint8 batches, with the per-view distributions of ``multicrop.py``.

The work is split in two so that a batch can be cropped wherever it lies:
1. the loader (``RawMultiCropDataset``) gives each sample's uint8 image, its label and every random
   parameter of its views, drawn from torch's RNG (``sample_views``), which ``SeededDataset`` seeds
   with each sample's seed in turn: a sample draws the same parameters in a resumed run as in an
   uninterrupted one, with any number of workers and processes, whatever batch it lands in;
2. ``BatchedMultiCrop`` turns (images, parameters) into the crops with a fixed sequence of batched
   tensor ops (``batch_ops``): in the training step, on its device once the batch is moved (the loader
   collates with ``collate_raw``), or on the CPU in the loader's collate (``CropCollate``, in the
   workers); it draws nothing and reads nothing on the host, so where it runs does not change the views
   drawn (only float rounding may differ between devices).

Per view, as the per-sample path: RandomResizedCrop (torchvision's sampler: 10 tries of a uniform
area fraction in ``scale`` and a log-uniform aspect ratio in [3/4, 4/3], whole pixels, else the centre
crop), a horizontal flip p 0.5, colour jitter p 0.8 (brightness 0.4, contrast 0.4, saturation 0.2,
hue 0.1, in a random order per sample), grayscale p 0.2, Gaussian blur (p 1.0 / 0.1 / 0.5 for global 1,
global 2, the locals; sigma uniform in ``blur_sigma``), solarize p 0.2 (global 2), then normalisation.
What differs: the crop is resized from the float pixels and not rounded to uint8 before the colour ops.
"""
from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from visiontrain.data import batch_ops
from visiontrain.data.multicrop import MultiCropSpec, blur_kernel_size

RATIO = (3.0 / 4.0, 4.0 / 3.0)  # RandomResizedCrop's aspect ratio range
TRIES = 10                      # RandomResizedCrop's attempts before the centre crop
JITTER_P, GRAY_P, FLIP_P = 0.8, 0.2, 0.5
# the columns of a view's parameters
X0, Y0, W, H, FLIP, JITTER, FACTORS, ORDER, GRAY, SIGMA, SOLARIZE = 0, 1, 2, 3, 4, 5, 6, 10, 14, 15, 16
N_PARAMS = 17


def view_probabilities(spec: MultiCropSpec) -> list[tuple[float, float]]:
    """(blur p, solarize p) of each view: global 1, global 2, then the locals."""
    return [(1.0, 0.0), (0.1, 0.2)] + [(0.5, 0.0)] * spec.local_crops


def _uniform(shape: Sequence[int], low: float, high: float, generator: torch.Generator | None) -> Tensor:
    return torch.rand(shape, generator=generator, dtype=torch.float64) * (high - low) + low


def crop_boxes(sizes: Tensor, scale: tuple[float, float], generator: torch.Generator | None = None) -> Tensor:
    """torchvision's ``RandomResizedCrop.get_params`` for every sample at once: ``sizes`` [B, 2]
    (height, width) -> boxes [B, 4] (x0, y0, w, h) in whole pixels. All ten tries are drawn, the
    first whose box fits is kept; where none fits, the centre crop at the clamped aspect ratio."""
    n = sizes.shape[0]
    height, width = sizes[:, 0:1].double(), sizes[:, 1:2].double()
    area = height * width
    target = area * _uniform((n, TRIES), *scale, generator)
    ratio = torch.exp(_uniform((n, TRIES), math.log(RATIO[0]), math.log(RATIO[1]), generator))
    w, h = torch.sqrt(target * ratio).round(), torch.sqrt(target / ratio).round()
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = fits.double().argmax(1, keepdim=True)                              # the first try that fits
    w, h = w.gather(1, first), h.gather(1, first)
    pos = torch.rand((n, 2), generator=generator, dtype=torch.float64)        # torch.randint's uniform
    y0, x0 = (pos[:, :1] * (height - h + 1)).floor(), (pos[:, 1:] * (width - w + 1)).floor()
    # the fallback: the whole image, its aspect ratio clamped to the range, centred
    in_ratio = width / height
    cw = torch.where(in_ratio > RATIO[1], (height * RATIO[1]).round(), width)
    ch = torch.where(in_ratio < RATIO[0], (width / RATIO[0]).round(), height)
    none = ~fits.any(1, keepdim=True)
    w, h = torch.where(none, cw, w), torch.where(none, ch, h)
    x0 = torch.where(none, torch.div(width - cw, 2, rounding_mode="floor"), x0)
    y0 = torch.where(none, torch.div(height - ch, 2, rounding_mode="floor"), y0)
    return torch.cat((x0, y0, w, h), 1).float()


def sample_views(sizes: Tensor, spec: MultiCropSpec, generator: torch.Generator | None = None) -> Tensor:
    """Every random parameter of every view of a batch: float [B, V, N_PARAMS] (the column
    constants above), from ``generator`` (None: torch's default one, as the per-sample path)."""
    n, views = sizes.shape[0], 2 + spec.local_crops
    out = torch.zeros(n, views, N_PARAMS)
    bright, contrast, saturation, hue = spec.jitter
    low = torch.tensor([max(0.0, 1 - bright), max(0.0, 1 - contrast), max(0.0, 1 - saturation), -hue])
    high = torch.tensor([1 + bright, 1 + contrast, 1 + saturation, hue])
    for v, (blur_p, solarize_p) in enumerate(view_probabilities(spec)):
        p = out[:, v]
        p[:, X0:H + 1] = crop_boxes(sizes, spec.global_scale if v < 2 else spec.local_scale, generator)
        coins = torch.rand((n, 5), generator=generator)
        p[:, FLIP], p[:, JITTER], p[:, GRAY] = coins[:, 0] < FLIP_P, coins[:, 1] < JITTER_P, coins[:, 2] < GRAY_P
        p[:, SOLARIZE] = coins[:, 3] < solarize_p
        p[:, FACTORS:FACTORS + 4] = torch.rand((n, 4), generator=generator) * (high - low) + low
        p[:, ORDER:ORDER + 4] = torch.rand((n, 4), generator=generator).argsort(1).float()  # randperm(4) each
        sigma = _uniform((n,), *spec.blur_sigma, generator).float()
        p[:, SIGMA] = torch.where(coins[:, 4] < blur_p, sigma, torch.zeros_like(sigma))
    return out


class BatchedMultiCrop:
    """``crops = BatchedMultiCrop(spec)(images, params)``: uint8 [B, C, H, W] (padded where the
    images differ in size) and ``sample_views``' [B, V, N_PARAMS] -> 2 + N float [B, C, S, S],
    normalised, globals first; on the device the inputs are on."""

    def __init__(self, spec: MultiCropSpec) -> None:
        self.spec = spec
        self.kernels = [blur_kernel_size(spec.blur_sigma[1], size) for size in self.sizes()]
        self._stats: dict[torch.device, tuple[Tensor, Tensor]] = {}

    def sizes(self) -> list[int]:
        return [self.spec.global_size] * 2 + [self.spec.local_size] * self.spec.local_crops

    def _mean_std(self, device: torch.device, channels: int) -> tuple[Tensor, Tensor]:
        stats = self._stats.get(device)
        if stats is None:  # made once per device (and copied without waiting for queued kernels)
            mean, std = (torch.tensor(v).to(device, non_blocking=True).expand(channels).reshape(1, channels, 1, 1)
                         for v in (self.spec.mean, self.spec.std))
            stats = self._stats[device] = (mean, std)
        return stats

    def __call__(self, images: Tensor, params: Tensor) -> list[Tensor]:
        if images.dtype != torch.uint8:
            raise TypeError(f"the batched multi-crop takes the uint8 images, got {images.dtype}")
        x = images.float().div_(255.0)
        mean, std = self._mean_std(images.device, images.shape[1])
        params = params.to(device=images.device, dtype=torch.float32)
        crops = []
        for v, (size, kernel) in enumerate(zip(self.sizes(), self.kernels)):
            p = params[:, v]
            y = batch_ops.crop_resize(x, p[:, X0:H + 1], size, flip=p[:, FLIP] > 0)
            y = batch_ops.color_jitter(y, p[:, FACTORS:FACTORS + 4], p[:, ORDER:ORDER + 4].long(), p[:, JITTER] > 0)
            y = batch_ops.random_grayscale(y, p[:, GRAY] > 0)
            y = batch_ops.gaussian_blur(y, p[:, SIGMA], kernel)
            if v == 1:
                y = batch_ops.solarize(y, p[:, SOLARIZE] > 0)
            crops.append(y.sub_(mean).div_(std).contiguous())
        return crops

    def __getstate__(self) -> dict[str, Any]:
        return {"spec": asdict(self.spec)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(MultiCropSpec(**state["spec"]))


def _as_uint8(image: Any) -> Tensor:
    """A raw item's image (uint8 tensor [C, H, W], or a PIL image) as a uint8 tensor."""
    if isinstance(image, Tensor):
        return image

    array = np.asarray(image, dtype=np.uint8)
    array = array[:, :, None] if array.ndim == 2 else array
    return torch.from_numpy(array.copy()).permute(2, 0, 1)


class RawMultiCropDataset(Dataset):
    """Items ``(uint8 image [C, H, W], label, view parameters [V, N_PARAMS])`` from a source with
    ``raw_item(i)``; the parameters of the samples asked for together (``__getitems__``) are drawn
    together from torch's RNG; ``SeededDataset`` asks for one sample at a time, seeded by its own
    seed. ``collate_raw`` stacks them; ``BatchedMultiCrop`` makes the crops."""

    def __init__(self, source: Any, spec: MultiCropSpec) -> None:
        if not hasattr(source, "raw_item"):
            raise TypeError(f"{type(source).__name__} has no raw_item(); multi-crop needs the raw images")
        self.source, self.spec = source, spec

    def __len__(self) -> int:
        return len(self.source)

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Tensor, int, Tensor]]:
        raw = [self.source.raw_item(int(i)) for i in indices]
        images = [_as_uint8(image) for image, _ in raw]
        params = sample_views(torch.tensor([image.shape[-2:] for image in images]), self.spec)
        return [(image, label, p) for image, (_, label), p in zip(images, raw, params.unbind(0))]

    def __getitem__(self, index: int) -> tuple[Tensor, int, Tensor]:
        return self.__getitems__([index])[0]


def collate_raw(items: list[tuple[Tensor, int, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    """``(images uint8 [B, C, H, W], labels [B], params [B, V, N_PARAMS])``; images of different
    sizes are padded at the bottom and right (each sample's boxes stay inside its own pixels)."""
    images = [item[0] for item in items]
    height, width = max(i.shape[-2] for i in images), max(i.shape[-1] for i in images)
    if all(i.shape[-2:] == (height, width) for i in images):
        batch = torch.stack(images)
    else:
        batch = images[0].new_zeros(len(images), images[0].shape[0], height, width)
        for out, image in zip(batch, images):
            out[:, :image.shape[-2], :image.shape[-1]] = image
    labels = torch.tensor([item[1] for item in items], dtype=torch.int64)
    return batch, labels, torch.stack([item[2] for item in items])


class CropCollate:
    """The loader's collate when the crops are made in the loader: ``collate_raw``, then
    ``BatchedMultiCrop`` on the CPU in the process that loaded the batch (a DataLoader worker, or the
    training process without workers). Gives ``(crops, labels)``, the per-sample path's batch, so the
    crops overlap the training step as the per-sample path's do, at a fraction of its cost."""

    def __init__(self, spec: MultiCropSpec) -> None:
        self.crop = BatchedMultiCrop(spec)

    def __call__(self, items: list[tuple[Tensor, int, Tensor]]) -> tuple[list[Tensor], Tensor]:
        images, labels, params = collate_raw(items)
        return self.crop(images, params), labels
