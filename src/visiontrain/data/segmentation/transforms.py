"""The label maps' transforms and collate: the v2 transforms move a ``tv_tensors.Mask`` with the
image (nearest neighbour), and a crop larger than the image pads the image with 0 and the labels
with the ignore index, so padding counts in no loss.

Training (MMSeg's pipeline, without photometric distortion): the shorter side resized to a random
size, a random crop of ``crop`` x ``crop`` px (drawn again while one class fills most of it, MMSeg's
``cat_max_ratio``), a horizontal flip. Evaluation resizes the image only
(``PrepareImage``): its label map stays at the file's size, and the task scores the logits brought
back to it, as MMSeg does, so a metric is one of the dataset's own pixels.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from visiontrain.core._tv_compat import ensure_torchvision

ensure_torchvision()
import torchvision.transforms.v2 as T  # noqa: E402
from torchvision import tv_tensors  # noqa: E402

from visiontrain.data.detection.transforms import to_model_input  # noqa: E402


def train_transform(shorter_sides: Sequence[int], crop: int, ignore: int, on_device: bool = False,
                    cat_max_ratio: float = 1.0) -> T.Compose:
    """Random resize (shorter side drawn in ``shorter_sides`` [low, high]), random crop padded with 0
    and ``ignore`` (``CategoryBalancedCrop``), horizontal flip, then float and ImageNet normalisation
    (unless ``on_device``)."""
    low, high = shorter_sides
    return T.Compose([T.RandomResize(low, high + 1), CategoryBalancedCrop(crop, ignore, cat_max_ratio),
                      T.RandomHorizontalFlip(), *to_model_input(on_device)])


class CategoryBalancedCrop(T.RandomCrop):
    """torchvision's ``RandomCrop`` (padded with 0 and ``ignore`` where the image is smaller) with
    MMSeg's ``cat_max_ratio``: while one class covers ``cat_max_ratio`` or more of the crop's labelled
    pixels (or it holds one class only), the crop is drawn again, up to ``TRIES`` times, the last draw
    kept. Where the background is most of every image, most crops would teach the background; this
    gives the classes that matter more of each step's pixels. At 1 it is ``RandomCrop``, draw for
    draw (the same random numbers)."""

    TRIES = 10  # MMSeg's

    def __init__(self, size: int, ignore: int, cat_max_ratio: float = 1.0) -> None:
        super().__init__(size, pad_if_needed=True, fill={tv_tensors.Image: 0, tv_tensors.Mask: ignore})
        self.ignore, self.cat_max_ratio = ignore, cat_max_ratio

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        params = super().make_params(flat_inputs)
        if self.cat_max_ratio >= 1:
            return params
        labels = next(x for x in flat_inputs if isinstance(x, tv_tensors.Mask)).as_subclass(torch.Tensor)
        for _ in range(self.TRIES):
            if self._varied(labels, params):
                break
            params = super().make_params(flat_inputs)
        return params

    def _varied(self, labels: torch.Tensor, params: dict[str, Any]) -> bool:
        """Whether the crop ``params`` describes holds two classes or more, none of them
        ``cat_max_ratio`` of its labelled pixels (the padding is the ignore index: not counted)."""
        pad_left, pad_top = params["padding"][:2]
        top, left = max(0, params["top"] - pad_top), max(0, params["left"] - pad_left)
        bottom = max(0, params["top"] - pad_top + params["height"])
        right = max(0, params["left"] - pad_left + params["width"])
        window = labels[..., top:bottom, left:right].reshape(-1).long()
        counts = torch.bincount(window[window != self.ignore])
        counts = counts[counts > 0]
        return len(counts) > 1 and bool(counts.max() < self.cat_max_ratio * counts.sum())


class PrepareImage:
    """Evaluation's (and prediction's) preparation: the image resized to ``shorter_side`` (0: kept)
    and normalised; the label map untouched, at the file's size."""

    def __init__(self, shorter_side: int) -> None:
        self.image = T.Compose([*([T.Resize(shorter_side)] if shorter_side else []), *to_model_input()])

    def __call__(self, image: Any, labels: Any) -> tuple[Any, Any]:
        return self.image(image), labels


def collate_label_maps(batch: list[tuple[Any, Any]], ignore: int, size_divisible: int = 32
                       ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int, int]]]:
    """(images [B, 3, h, w] padded with 0 to a multiple of ``size_divisible``, labels int64 [B, H, W]
    padded with ``ignore``, per image (h, w, H, W): its prepared size and its label map's, as Python
    ints so that cutting a prediction to either reads nothing from the device). Training crops all
    have one size; evaluation's images keep their aspect ratios."""
    images = [img.as_subclass(torch.Tensor) for img, _ in batch]
    labels = [lab.as_subclass(torch.Tensor) for _, lab in batch]
    h = -(-max(i.shape[-2] for i in images) // size_divisible) * size_divisible
    w = -(-max(i.shape[-1] for i in images) // size_divisible) * size_divisible
    out = images[0].new_zeros((len(images), images[0].shape[0], h, w))
    maps = torch.full((len(labels), max(lab.shape[-2] for lab in labels), max(lab.shape[-1] for lab in labels)),
                      ignore, dtype=torch.int64)
    sizes = []
    for i, (img, lab) in enumerate(zip(images, labels)):
        out[i, :, :img.shape[-2], :img.shape[-1]] = img
        maps[i, :lab.shape[-2], :lab.shape[-1]] = lab
        sizes.append((int(img.shape[-2]), int(img.shape[-1]), int(lab.shape[-2]), int(lab.shape[-1])))
    return out, maps, sizes
