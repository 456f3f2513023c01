"""Training images decoded on the device (``data.decode=gpu``): the loader's workers read each file's
bytes and draw its crop and flip; the device decodes the batch with nvJPEG, crops, resizes, flips
and normalises it.

Why: on a GPU a ResNet-50 step takes about as long as 20 CPU threads need to decode and resize its
batch of ImageNet JPEGs with PIL, so the step waits for the loader unless a machine has many cores
per GPU. torchvision's batched ``decode_jpeg(device="cuda")`` does the decode on the device.

What stays as on the CPU path (``ImageFolderClassification`` with ``augment: imagenet``): the files
and their order, and each sample's random draws. The crop box and the flip are drawn from torch's
RNG in the worker, in the order torchvision's ``RandomResizedCrop`` and ``RandomHorizontalFlip``
draw them there, so under the same seed a sample gets the same box and flip on both paths (a
sample's seed is its own: ``data.samplers.sample_seed``). What differs: the JPEG decoder
(libjpeg-turbo in PIL, nvJPEG here) and the resize (PIL's antialiased bilinear on the CPU,
torchvision's on a tensor here) round differently, by a few levels of 255.

A file that is not a baseline-decodable JPEG for the device (another format, CMYK, an EXIF
orientation to apply) is decoded in the worker (PIL, the CPU path's rule) and resized there with
the same tensor code; a JPEG that nvJPEG refuses is decoded on the host. Both are counted and said.
Evaluation decodes on the CPU either way: its transform stays the one inference uses.
"""
from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from PIL import Image
from torch import Tensor

from visiontrain.core._tv_compat import ensure_torchvision
from visiontrain.data.images import UnreadableImageError, decode_rgb, exif_orientation, open_rgb
from visiontrain.data.normalize import NormalizeOnDevice

log = logging.getLogger("visiontrain")

SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)  # RandomResizedCrop's defaults: the CPU path's imagenet crop
DEVICE_MODES = ("RGB", "L")  # JPEG colour modes nvJPEG decodes to RGB


@dataclass
class EncodedImage:
    """A training sample as the worker hands it over: the file's bytes and its draws."""
    data: Tensor                      # uint8 [n], the JPEG file
    box: tuple[int, int, int, int]    # top, left, height, width of the crop in the decoded image
    flip: bool
    path: str                         # named if the image cannot be decoded


@dataclass
class DecodedImage:
    """A sample the worker decoded itself (not a JPEG the device decodes): its crop, resized."""
    pixels: Tensor                    # uint8 [3, S, S], not yet flipped
    flip: bool


class EncodedBatch(list):
    """The samples of a batch (``EncodedImage`` or ``DecodedImage``), left on the host by the copy
    to the device: nvJPEG reads the encoded bytes from host memory."""


def crop_box(height: int, width: int) -> tuple[int, int, int, int]:
    """``RandomResizedCrop.get_params`` for an image of this size, drawn from torch's RNG as the CPU
    path draws it (the image itself is not needed: a stand-in of its shape that holds no memory)."""
    ensure_torchvision()
    from torchvision.transforms import RandomResizedCrop

    stand_in = torch.empty(1, 1, 1).expand(1, height, width)
    return RandomResizedCrop.get_params(stand_in, list(SCALE), list(RATIO))


def crop_resize(image: Tensor, box: tuple[int, int, int, int], size: int) -> Tensor:
    """uint8 [3, H, W] -> uint8 [3, size, size]: the box cut out and resized (antialiased bilinear),
    on whatever device the image is."""
    ensure_torchvision()
    import torchvision.transforms.v2.functional as TF

    top, left, height, width = box
    return TF.resize(image[:, top:top + height, left:left + width], [size, size], antialias=True)


def read_for_device(path: str, size: int) -> EncodedImage | DecodedImage:
    """What a worker hands over for one training sample under ``data.decode=gpu``; a file that
    cannot be read raises ``UnreadableImageError`` naming it (the dataset's skip policy applies)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        with Image.open(io.BytesIO(data)) as im:  # the header only: size, format, mode, orientation
            width, height = im.size
            on_device = im.format == "JPEG" and im.mode in DEVICE_MODES and exif_orientation(im) == 1
    except FileNotFoundError:
        raise UnreadableImageError(f"image file {path} does not exist") from None
    except (OSError, SyntaxError, ValueError) as err:
        raise UnreadableImageError(f"image file {path} cannot be read: {err}") from None
    image = None if on_device else _to_tensor(open_rgb(path))  # upright: the frame the CPU path crops
    if image is not None:
        height, width = image.shape[-2:]
    box = crop_box(height, width)
    flip = bool(torch.rand(1).item() < 0.5)  # RandomHorizontalFlip's draw, after the crop's
    if image is None:
        return EncodedImage(torch.frombuffer(bytearray(data), dtype=torch.uint8), box, flip, path)
    return DecodedImage(crop_resize(image, box, size), flip)


def collate_encoded(items: Sequence[tuple[Any, int]]) -> tuple[EncodedBatch, Tensor]:
    """The training loader's collate under ``data.decode=gpu``."""
    return EncodedBatch(x for x, _ in items), torch.tensor([label for _, label in items], dtype=torch.int64)


class DeviceDecoder:
    """The step's device transform under ``data.decode=gpu``: ``(EncodedBatch, labels)`` ->
    ``(float32 [B, 3, S, S] normalised, labels)`` on the labels' device."""

    def __init__(self, size: int, channels_last: bool = False, *, say: bool = True) -> None:
        self.size, self.channels_last, self.say = size, channels_last, say
        self.normalize = NormalizeOnDevice()
        self.seen = self.on_host = 0   # samples, and those decoded on the host (counted, said)
        self._said = 0

    def __call__(self, batch: tuple[EncodedBatch, Tensor]) -> tuple[Tensor, Tensor]:
        items, labels = batch
        device = labels.device
        out = torch.empty(len(items), 3, self.size, self.size, dtype=torch.uint8, device=device)
        encoded = [(i, item) for i, item in enumerate(items) if isinstance(item, EncodedImage)]
        for (i, item), image in zip(encoded, self._decode([item for _, item in encoded], device)):
            out[i] = crop_resize(image, item.box, self.size)
        for i, item in enumerate(items):
            if isinstance(item, DecodedImage):
                out[i] = item.pixels.to(device, non_blocking=True)
        flips = torch.tensor([item.flip for item in items]).to(device, non_blocking=True)
        out = torch.where(flips[:, None, None, None], out.flip(-1), out)
        self._count(len(items), len(items) - len(encoded))
        if self.channels_last:
            out = out.contiguous(memory_format=torch.channels_last)
        return self.normalize(out), labels

    def _decode(self, items: list[EncodedImage], device: torch.device) -> list[Tensor]:
        """Each JPEG decoded to uint8 RGB [3, H, W] on ``device``: the batch at once, else (nvJPEG
        refused one of them) one at a time, a refused file on the host with PIL."""
        if not items:
            return []
        ensure_torchvision()
        from torchvision.io import ImageReadMode, decode_jpeg

        try:
            return decode_jpeg([it.data for it in items], mode=ImageReadMode.RGB, device=device)
        except RuntimeError:  # one file nvJPEG refuses fails the whole batch: each on its own
            return [self._decode_one(item, device) for item in items]

    def _decode_one(self, item: EncodedImage, device: torch.device) -> Tensor:
        """One JPEG on ``device``, or (refused by nvJPEG) decoded on the host with PIL and counted."""
        from torchvision.io import ImageReadMode, decode_jpeg

        try:
            return decode_jpeg(item.data, mode=ImageReadMode.RGB, device=device)
        except RuntimeError:
            self.on_host += 1
            pixels = _to_tensor(decode_rgb(item.data.numpy().tobytes(), f"image file {item.path}"))
            return pixels.to(device, non_blocking=True)

    def _count(self, samples: int, decoded_in_workers: int) -> None:
        """Counts the samples not decoded on the device, and says so the first time and each time
        the count doubles (a folder of PNGs is said a few times, not at every batch)."""
        self.seen += samples
        self.on_host += decoded_in_workers
        if self.say and self.on_host > 0 and self.on_host >= 2 * self._said:
            self._said = max(self.on_host, 1)
            log.warning("data.decode=gpu: %s of %s training images so far decoded on the CPU (not a JPEG the "
                        "device decodes: another format, CMYK, an EXIF orientation, or refused by nvJPEG)",
                        f"{self.on_host:,}", f"{self.seen:,}")


def _to_tensor(image: Image.Image) -> Tensor:
    """A decoded RGB PIL image as uint8 [3, H, W]."""
    ensure_torchvision()
    import torchvision.transforms.v2.functional as TF

    return TF.pil_to_tensor(image)

