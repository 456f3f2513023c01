"""The evaluation transform of a classification dataset, as plain values.

One object serves three readers, so that none of them keeps a second copy of the rule: the
datasets prepare their validation items with it, its :meth:`EvalTransform.spec` goes into the
checkpoint's ``data_info["preprocess"]`` (and into an exported ONNX file's metadata), and
``visiontrain.use.inference`` rebuilds it from there to prepare a user's image exactly as a validation
item was prepared when the model was scored.

The rule: bring the pixels to [0, 1] (uint8 divided by the format's top value: 255 for an image
file, 16 for scikit-learn's digits), resize the shorter side to ``resize`` and centre-crop to
``size`` x ``size``, then subtract ``mean`` and divide by ``std`` per channel. ``geometry_on_uint8``
says whether the resize sees the 8-bit pixels (image-folder's decoded files, as torchvision's
pipeline does) or the floats (the in-memory sets); the two round differently, so it is recorded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from visiontrain.core._tv_compat import ensure_torchvision

SPEC_KEYS = ("size", "resize", "mean", "std", "geometry_on_uint8")


@dataclass(frozen=True)
class EvalTransform:
    """``images`` uint8 [..., C, H, W] (values 0..``max_value``) or float in [0, 1] -> float32
    [..., C, size, size], normalised. Works on one image or a batch; picklable (plain values)."""
    size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    resize: int | None = None  # shorter side first resized to this; None: to ``size`` (when not size x size)
    geometry_on_uint8: bool = False

    @property
    def channels(self) -> int:
        return len(self.mean)

    def spec(self) -> dict[str, Any]:
        """JSON-ready values for ``data_info["preprocess"]``; ``scale`` is what an 8-bit image file's
        pixels are multiplied by (the dataset's own pixels may use another top value)."""
        return {"size": self.size, "resize": self.resize, "crop": self.size, "mean": list(self.mean),
                "std": list(self.std), "scale": 1 / 255, "channels": self.channels,
                "geometry_on_uint8": self.geometry_on_uint8, "layout": "CHW"}

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> "EvalTransform":
        missing = [k for k in SPEC_KEYS if k not in spec]
        if missing:
            raise ValueError(f"data_info['preprocess'] lacks {', '.join(missing)}: {spec}")
        return cls(size=int(spec["size"]), mean=tuple(spec["mean"]), std=tuple(spec["std"]),
                   resize=spec["resize"], geometry_on_uint8=bool(spec["geometry_on_uint8"]))

    def needs_geometry(self, images: Tensor) -> bool:
        return self.resize is not None or tuple(images.shape[-2:]) != (self.size, self.size)

    def __call__(self, images: Tensor, max_value: float = 255.0) -> Tensor:
        if images.ndim < 3 or images.shape[-3] != self.channels:
            raise ValueError(f"expected images [..., {self.channels}, H, W], got {list(images.shape)}")
        is_float = images.is_floating_point()
        c = self.channels
        if not self.needs_geometry(images):  # one fused pass: scale and normalise together
            top = 1.0 if is_float else max_value
            scale = torch.tensor([1.0 / (top * s) for s in self.std]).view(c, 1, 1)
            shift = torch.tensor([-m / s for m, s in zip(self.mean, self.std)]).view(c, 1, 1)
            # non_blocking: a copy from pageable memory is staged at once and waits for no kernel (a
            # blocking one waits for the device's queue: a host sync on data kept on the GPU)
            return images.float().mul_(scale.to(images.device, non_blocking=True)).add_(
                shift.to(images.device, non_blocking=True))
        x = images
        if not is_float and not self.geometry_on_uint8:
            x = x.float().mul_(1.0 / max_value)
        x = self.geometry(x)
        if not x.is_floating_point():
            x = x.float().mul_(1.0 / max_value)  # torchvision's ToDtype(float32, scale=True) for 8 bits
        mean = torch.tensor(self.mean).view(c, 1, 1).to(x.device, non_blocking=True)
        std = torch.tensor(self.std).view(c, 1, 1).to(x.device, non_blocking=True)
        return x.sub_(mean).div_(std)

    def geometry(self, x: Tensor) -> Tensor:
        """The resize and the centre crop alone (the pixels keep their dtype)."""
        ensure_torchvision()
        import torchvision.transforms.v2.functional as TF

        x = TF.resize(x, [self.resize or self.size], antialias=True)
        return TF.center_crop(x, [self.size, self.size])

