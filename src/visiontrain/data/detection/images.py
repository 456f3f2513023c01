"""Image files for the detection readers: header sizes, and uint8 RGB [3, H, W] whatever the mode
(the decoding rule is ``visiontrain.data.images.open_rgb``, shared with classification folders).
Both are upright: a photo's EXIF orientation is applied, as the annotation tools that drew its boxes
and the viewers that show it apply it."""
from __future__ import annotations

import torch
from PIL import Image, UnidentifiedImageError

from visiontrain.data.images import QUARTER_TURNS, UnreadableImageError, exif_orientation, image_tensor, upright_size


class BadAnnotationError(ValueError):
    """An annotation or image that cannot be used; the message names the file and annotation id."""


def image_size(path: str) -> tuple[int, int]:
    """(height, width) of the upright image, from the file header (its EXIF orientation included),
    without decoding the pixels."""
    try:
        with Image.open(path) as im:
            w, h = upright_size(im)
    except FileNotFoundError:
        raise BadAnnotationError(f"image file {path} does not exist") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise BadAnnotationError(f"image file {path} cannot be read: {err}") from None
    return h, w


def size_text(path: str, width: int, height: int) -> str:
    """The upright size ``WxH`` of an image file for a size-mismatch message, with how the file is
    stored when an EXIF orientation tag turns it a quarter: an annotation of that stored frame was
    drawn by a tool that ignored the tag."""
    try:
        with Image.open(path) as im:
            turned = exif_orientation(im) in QUARTER_TURNS
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        turned = False
    return f"{width}x{height}" + (f" upright, as image viewers show it (stored {height}x{width} with an EXIF "
                                  f"orientation tag that turns it a quarter)" if turned else "")


def read_rgb(path: str) -> torch.Tensor:
    """uint8 [3, H, W]; a file that cannot be decoded is a ``BadAnnotationError`` (the skip policy applies)."""
    try:
        return image_tensor(path, 3)
    except UnreadableImageError as err:
        raise BadAnnotationError(str(err)) from None
