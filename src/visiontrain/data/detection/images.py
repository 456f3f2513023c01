"""Decoding an image file to uint8 RGB [3, H, W], whatever its mode (grey, RGBA, palette, 16-bit)."""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from visiontrain.data.detection.base import BadAnnotationError


def image_size(path: str) -> tuple[int, int]:
    """(height, width) from the file header, without decoding the pixels."""
    try:
        with Image.open(path) as im:
            w, h = im.size
    except FileNotFoundError:
        raise BadAnnotationError(f"image file {path} does not exist") from None
    except (UnidentifiedImageError, OSError) as err:
        raise BadAnnotationError(f"image file {path} cannot be read: {err}") from None
    return h, w


def read_rgb(path: str) -> torch.Tensor:
    try:
        with Image.open(path) as im:
            im.load()
            if im.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16/32-bit grey: scale to 8 bits
                arr = np.asarray(im, dtype=np.float64)
                arr = (arr / max(arr.max(), 1.0) * 255.0).round().astype(np.uint8)
                im = Image.fromarray(arr, mode="L")
            rgb = im.convert("RGB")  # grey, RGBA (alpha dropped), palette, CMYK
    except FileNotFoundError:
        raise BadAnnotationError(f"image file {path} does not exist") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise BadAnnotationError(f"image file {path} cannot be decoded (corrupt or truncated): {err}") from None
    return torch.from_numpy(np.array(rgb, dtype=np.uint8)).permute(2, 0, 1).contiguous()
