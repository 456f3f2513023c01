"""Decoding an image file to 8-bit RGB whatever its mode, with errors that name the file.

One rule for classification folders and detection readers: grey, palette, RGBA (alpha dropped) and
CMYK go through PIL's ``convert("RGB")``. 16-bit grey is first scaled to 8 bits by its full range
(/257, as torchvision's ``to_dtype(uint8, scale=True)`` does), because ``convert`` would clip every
value above 255 to white; 32-bit integer grey, whose range is unknown, by the image's maximum.
An image given in memory (a PIL image, a numpy array, a tensor) follows the same rule
(:func:`image_tensor`, what ``visiontrain.inference`` reads its inputs with).
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

WIDE_GREY_MODES = ("I;16", "I;16B", "I;16L", "I")


class UnreadableImageError(ValueError):
    """An image file that does not exist or cannot be decoded; the message names the file."""


def to_rgb(im: Image.Image) -> Image.Image:
    """``im`` (any mode, decoded) as 8-bit RGB by the rule above."""
    if im.mode in WIDE_GREY_MODES:
        arr = np.asarray(im, dtype=np.float64)
        top = 65535.0 if im.mode.startswith("I;16") else max(arr.max(), 1.0)
        arr = (arr / top * 255.0).round().clip(0, 255).astype(np.uint8)
        return Image.fromarray(arr).convert("RGB")
    return im.convert("RGB")


def open_rgb(path: str) -> Image.Image:
    """The decoded RGB image; a missing, corrupt or truncated file raises ``UnreadableImageError``."""
    try:
        with Image.open(path) as im:
            im.load()  # decodes now: a truncated file fails here, not later inside a transform
            return to_rgb(im)
    except FileNotFoundError:
        raise UnreadableImageError(f"image file {path} does not exist") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise UnreadableImageError(f"image file {path} cannot be decoded (corrupt or truncated): {err}") from None


# ------------------------------------------------------------------ images given in memory
GREY_WEIGHTS = (0.299, 0.587, 0.114)  # ITU-R 601-2 luma, PIL's "L" conversion, for float pixels


def _from_pil(im: Image.Image, channels: int) -> torch.Tensor:
    rgb = to_rgb(im)
    arr = np.array(rgb.convert("L") if channels == 1 else rgb, dtype=np.uint8)
    return torch.from_numpy(arr.reshape(arr.shape[0], arr.shape[1], -1)).permute(2, 0, 1).contiguous()


def _from_tensor(x: torch.Tensor, channels: int, what: str) -> torch.Tensor:
    """[C, H, W] (or [H, W]) uint8, or float in [0, 1], to ``channels``; 8-bit colour goes to grey
    through PIL, so that a tensor, an array and a file of the same pixels give the same input."""
    x = x.detach().cpu()
    if x.ndim == 2:
        x = x[None]
    if x.ndim != 3 or x.shape[0] not in (1, 3):
        raise ValueError(f"{what}: expected a tensor [3, H, W] or [1, H, W] (or a batch [B, 3, H, W]), "
                         f"got {list(x.shape)}")
    if x.dtype != torch.uint8:
        if not x.is_floating_point():
            raise ValueError(f"{what}: expected uint8 pixels (0..255) or floats in [0, 1], got {x.dtype}")
        x = x.float()
        low, high = (float(x.min()), float(x.max())) if x.numel() else (0.0, 0.0)
        if low < 0.0 or high > 1.0:
            raise ValueError(f"{what}: float pixels must lie in [0, 1], got values in [{low:g}, {high:g}] "
                             f"(divide 8-bit values by 255, or pass uint8)")
    if x.shape[0] == channels:
        return x
    if channels == 3:  # grey to RGB: the value in every channel, as PIL converts it
        return x.expand(3, -1, -1).contiguous()
    if x.dtype == torch.uint8:
        return _from_pil(Image.fromarray(x.permute(1, 2, 0).numpy()), 1)
    return torch.tensordot(torch.tensor(GREY_WEIGHTS), x, dims=1)[None]


def image_tensor(image: Any, channels: int, what: str = "image") -> torch.Tensor:
    """One image as the tasks' ``predict`` takes it: [channels, H, W], uint8 (0..255) or float in
    [0, 1]. ``image``: a file path (decoded by :func:`open_rgb`), a PIL image (any mode), a numpy
    uint8 array (H, W), (H, W, 1), (H, W, 3) or (H, W, 4) (RGBA: alpha dropped), or a tensor [C, H, W]
    (uint8, or float in [0, 1]). Colour becomes grey for a one-channel model (PIL's "L"), grey
    becomes RGB for a three-channel one. Anything else is a ``ValueError`` that names ``what``."""
    if isinstance(image, (str, os.PathLike)):
        return _from_pil(open_rgb(str(image)), channels)
    if isinstance(image, Image.Image):
        return _from_pil(image, channels)
    if isinstance(image, np.ndarray):
        shape_ok = image.ndim == 2 or (image.ndim == 3 and image.shape[2] in (1, 3, 4))
        if image.dtype != np.uint8 or not shape_ok:
            raise ValueError(f"{what}: a numpy image must be uint8 (H, W, 3) RGB, (H, W, 4) RGBA or (H, W) grey, "
                             f"got {image.dtype} {image.shape}")
        return _from_pil(Image.fromarray(image[..., 0] if image.ndim == 3 and image.shape[2] == 1 else image),
                         channels)
    if isinstance(image, torch.Tensor):
        return _from_tensor(image, channels, what)
    raise ValueError(f"{what}: expected a file path, a PIL image, a numpy uint8 array or a torch tensor, "
                     f"got {type(image).__name__}")
