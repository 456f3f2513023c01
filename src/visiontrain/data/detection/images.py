"""Image files for the detection readers: header sizes, and uint8 RGB [3, H, W] whatever the mode
(the decoding rule is ``visiontrain.data.images.open_rgb``, shared with classification folders)."""
from __future__ import annotations

import torch
from PIL import Image, UnidentifiedImageError

from visiontrain.data.images import UnreadableImageError, image_tensor


class BadAnnotationError(ValueError):
    """An annotation or image that cannot be used; the message names the file and annotation id."""


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
    """uint8 [3, H, W]; a file that cannot be decoded is a ``BadAnnotationError`` (the skip policy applies)."""
    try:
        return image_tensor(path, 3)
    except UnreadableImageError as err:
        raise BadAnnotationError(str(err)) from None
