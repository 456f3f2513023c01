"""Decoding an image file to 8-bit RGB whatever its mode, with errors that name the file.

One rule for classification folders and detection readers: grey, palette, RGBA (alpha dropped) and
CMYK go through PIL's ``convert("RGB")``. 16-bit grey is first scaled to 8 bits by its full range
(/257, as torchvision's ``to_dtype(uint8, scale=True)`` does), because ``convert`` would clip every
value above 255 to white; 32-bit integer grey, whose range is unknown, by the image's maximum.
"""
from __future__ import annotations

import numpy as np
from PIL import Image, UnidentifiedImageError

WIDE_GREY_MODES = ("I;16", "I;16B", "I;16L", "I")


class UnreadableImageError(ValueError):
    """An image file that does not exist or cannot be decoded; the message names the file."""


def open_rgb(path: str) -> Image.Image:
    """The decoded RGB image; a missing, corrupt or truncated file raises ``UnreadableImageError``."""
    try:
        with Image.open(path) as im:
            im.load()  # decodes now: a truncated file fails here, not later inside a transform
            if im.mode in WIDE_GREY_MODES:
                arr = np.asarray(im, dtype=np.float64)
                top = 65535.0 if im.mode.startswith("I;16") else max(arr.max(), 1.0)
                arr = (arr / top * 255.0).round().clip(0, 255).astype(np.uint8)
                return Image.fromarray(arr).convert("RGB")
            return im.convert("RGB")
    except FileNotFoundError:
        raise UnreadableImageError(f"image file {path} does not exist") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise UnreadableImageError(f"image file {path} cannot be decoded (corrupt or truncated): {err}") from None
