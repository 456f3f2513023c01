"""Decoding an image file to 8-bit RGB whatever its mode, with errors that name the file.

One rule for classification folders and detection readers: grey, palette, RGBA (alpha dropped) and
CMYK go through PIL's ``convert("RGB")``. 16-bit grey is first scaled to 8 bits by its full range
(/257, as torchvision's ``to_dtype(uint8, scale=True)`` does), because ``convert`` would clip every
value above 255 to white; 32-bit integer grey, whose range is unknown, by the image's maximum.
An image given in memory (a PIL image, a numpy array, a tensor) follows the same rule
(:func:`image_tensor`, what ``visiontrain.use.inference`` reads its inputs with).

Orientation: a file (or a PIL image) with an EXIF orientation tag, as every phone photo has, is
turned upright as image viewers and annotation tools show it (PIL's ``exif_transpose``), so pixels,
sizes and the boxes drawn on them are all in the frame a user sees. A reader that takes sizes from
headers only uses :func:`upright_size`, which reads the tag without decoding the pixels.
"""
from __future__ import annotations

import io
import os
from typing import Any

import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps, PngImagePlugin, UnidentifiedImageError

WIDE_GREY_MODES = ("I;16", "I;16B", "I;16L", "I")
ORIENTATION = ExifTags.Base.Orientation  # EXIF tag 0x0112: 1 as stored, 2-8 flipped and / or turned
QUARTER_TURNS = (5, 6, 7, 8)  # the orientations whose upright image has width and height swapped


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


def exif_orientation(im: Image.Image) -> int:
    """The EXIF orientation tag (1-8; 1 when there is none) of an opened, not yet decoded, file.

    Read from the header only: JPEG, WebP and TIFF hold it there. PIL's PNG ``getexif`` decodes the
    whole file to look for an eXIf chunk after the pixels; the PNG specification puts that chunk
    before them, where opening the file has already read it, so the base ``getexif`` is asked."""
    exif = Image.Image.getexif(im) if isinstance(im, PngImagePlugin.PngImageFile) else im.getexif()
    return int(exif.get(ORIENTATION, 1))


def upright_size(im: Image.Image) -> tuple[int, int]:
    """(width, height) of an opened file as a viewer shows it (its EXIF orientation applied),
    without decoding the pixels."""
    w, h = im.size
    return (h, w) if exif_orientation(im) in QUARTER_TURNS else (w, h)


def open_rgb(path: str) -> Image.Image:
    """The decoded RGB image, upright (its EXIF orientation applied); a missing, corrupt or
    truncated file raises ``UnreadableImageError``."""
    return _decoded(path, f"image file {path}")


def decode_rgb(data: bytes, name: str) -> Image.Image:
    """An encoded image held in memory (a shard member), decoded as :func:`open_rgb` decodes a file;
    ``name`` says in an error where the bytes came from."""
    return _decoded(io.BytesIO(data), name)


def _decoded(source: str | io.BytesIO, name: str) -> Image.Image:
    try:
        with Image.open(source) as im:
            im.load()  # decodes now: a truncated file fails here, not later inside a transform
            ImageOps.exif_transpose(im, in_place=True)  # a no-op without the tag
            return to_rgb(im)
    except FileNotFoundError:
        raise UnreadableImageError(f"{name} does not exist") from None
    except Image.DecompressionBombError as err:  # a small file that decodes to billions of pixels
        raise UnreadableImageError(f"{name} is refused: {err}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise UnreadableImageError(f"{name} cannot be decoded (corrupt or truncated): {err}") from None


# ------------------------------------------------------------------ images given in memory
GREY_WEIGHTS = (0.299, 0.587, 0.114)  # ITU-R 601-2 luma, PIL's "L" conversion, for float pixels


def _from_pil(im: Image.Image, channels: int) -> torch.Tensor:
    """``im`` (decoded, upright) as uint8 [channels, H, W]."""
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
    [0, 1]. ``image``: a file path (decoded by :func:`open_rgb`), a PIL image (any mode; turned
    upright by its EXIF orientation, as the file it was opened from would be), a numpy uint8 array
    (H, W), (H, W, 1), (H, W, 3) or (H, W, 4) (RGBA: alpha dropped), or a tensor [C, H, W] (uint8,
    or float in [0, 1]). Colour becomes grey for a one-channel model (PIL's "L"), grey
    becomes RGB for a three-channel one. Anything else is a ``ValueError`` that names ``what``."""
    if isinstance(image, (str, os.PathLike)):
        return _from_pil(open_rgb(str(image)), channels)
    if isinstance(image, Image.Image):
        return _from_pil(ImageOps.exif_transpose(image), channels)  # a copy: the caller's image stays as it is
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
