"""An image-classification dataset held in memory as one uint8 tensor, with batched loading.

``InMemoryClassification.__getitems__`` (called by ``torch.utils.data.DataLoader`` with a whole
batch of indices) indexes the uint8 tensor once, converts and normalises the batch in one op and
returns per-sample ``(image, label)`` tuples, so the loader pays no per-sample Python transform
cost.  Random (augmenting) train transforms run per sample with ``torchvision.transforms.v2``, which
draws from torch's global RNG only.

torchvision is imported lazily (after ``ensure_torchvision()``), and the v2 transform objects are
left out of the pickled state and rebuilt on unpickling, so spawned DataLoader workers never import
torchvision before the compatibility shim has run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from visiontrain.core._tv_compat import ensure_torchvision
from visiontrain.data.eval_transform import EvalTransform
from visiontrain.data.normalize import IMAGENET_MEAN, IMAGENET_STD  # noqa: F401  (re-exported)
from visiontrain.data.samplers import seed_coins
from visiontrain.data.stacked import Stacked

AUGMENTS = ("none", "flip", "basic", "imagenet")
VAL_CROP_RATIO = 0.875  # val: Resize(int(size / 0.875)) then CenterCrop(size)


def tv_v2():
    """``torchvision.transforms.v2``, imported after the torchvision compatibility shim."""
    ensure_torchvision()
    from torchvision.transforms import v2

    return v2


def check_augment(augment: str) -> None:
    if augment not in AUGMENTS:
        raise ValueError(f"unknown augment {augment!r}; valid values: {', '.join(AUGMENTS)}")


def imagenet_stats(channels: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """ImageNet mean/std; for 1-channel images the channel average (timm's convention)."""
    if channels == 3:
        return IMAGENET_MEAN, IMAGENET_STD
    if channels == 1:
        return (sum(IMAGENET_MEAN) / 3,), (sum(IMAGENET_STD) / 3,)
    raise ValueError(f"ImageNet statistics need 1 or 3 channels, got {channels}")


def channel_stats(images: Tensor, max_value: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Exact per-channel mean/std of a uint8 [N,C,H,W] tensor in [0, 1] units (via a histogram)."""
    means, stds = [], []
    values = torch.arange(256, dtype=torch.float64) / max_value
    for c in range(images.shape[1]):
        hist = torch.bincount(images[:, c].reshape(-1), minlength=256).to(torch.float64)
        n = hist.sum()
        mean = (hist * values).sum() / n
        var = (hist * (values - mean) ** 2).sum() / n
        means.append(float(mean))
        stds.append(max(float(var.sqrt()), 1e-6))
    return tuple(means), tuple(stds)


class InMemoryClassification(Dataset):
    """``images`` uint8 [N,C,H,W] (values 0..max_value), ``labels`` int64 [N].

    Items are ``(float32 [C,S,S] normalised image, int label)``.  Deterministic preprocessing
    (to float, optional resize / centre crop, normalise) is batched; ``train_spec`` (random
    transforms) runs per sample.
    """

    def __init__(
        self,
        images: Tensor,
        labels: Tensor,
        *,
        classes: Sequence[str],
        max_value: float,
        mean: Sequence[float],
        std: Sequence[float],
        image_size: int,
        resize_to: int | None = None,
        train_spec: dict[str, Any] | None = None,
    ) -> None:
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[-1] != images.shape[-2]:
            raise ValueError(f"images must be square uint8 [N,C,H,W], got {images.dtype} {list(images.shape)}")
        if labels.shape != (images.shape[0],):
            raise ValueError(f"labels shape {list(labels.shape)} does not match {images.shape[0]} images")
        self.images = images
        self.labels = labels.to(torch.int64)
        self.classes = list(classes)
        self.max_value = float(max_value)
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.image_size = int(image_size)
        self.resize_to = resize_to  # deterministic path: resize the short side to this (None: no resize)
        # the deterministic path (validation items, train items without augmentation): resize, centre
        # crop to image_size, normalise; its spec is the checkpoint's data_info["preprocess"]
        self.eval_transform = EvalTransform(self.image_size, self.mean, self.std, resize=resize_to)
        # train_spec: {"kind": "flip"} (batched: the deterministic path, then a random mirror per image),
        # {"kind": "basic", "padding": int, "flip": bool} or {"kind": "imagenet", "flip": bool} (per sample)
        self.train_spec = train_spec
        self.stacked = False  # placed_on: batches come out whole (data.stacked.Stacked), where the images are
        self._random_tf = None
        self._build_transforms()

    # ------------------------------------------------------------------ transforms
    def _build_transforms(self) -> None:
        native = self.images.shape[-1]
        self._random_tf = None
        spec = self.train_spec
        if spec is None or spec["kind"] == "flip":  # flip: batched in __getitems__, no per-sample ops
            return
        v2 = tv_v2()
        size = self.image_size
        if spec["kind"] == "basic":
            ops = []
            if native != size:
                ops.append(v2.Resize(size, antialias=True))
            ops.append(v2.RandomCrop(size, padding=int(spec["padding"]), fill=0.0))
        elif spec["kind"] == "imagenet":
            ops = [v2.RandomResizedCrop(size, antialias=True)]
        else:  # pragma: no cover - guarded by the builders
            raise ValueError(f"unknown train transform kind {spec['kind']!r}")
        if spec.get("flip"):
            ops.append(v2.RandomHorizontalFlip())
        ops.append(v2.Normalize(self.mean, self.std))
        self._random_tf = v2.Compose(ops)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_random_tf"] = None  # torchvision objects: rebuilt after ensure_torchvision()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._build_transforms()

    @property
    def random_transforms(self) -> bool:
        return self.train_spec is not None

    @property
    def targets(self) -> list[int]:
        return self.labels.tolist()

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return self.images.shape[0]

    def _batch(self, indices: Sequence[int] | Tensor) -> Tensor:
        """Deterministic preprocessing of a batch -> float32 [B,C,S,S], normalised."""
        return self.eval_transform(self.images[indices], self.max_value)

    def raw_item(self, index: int) -> tuple[Tensor, int]:
        """The untransformed uint8 image [C,H,W] (values 0..max_value) and its label: the input of
        transforms built elsewhere (e.g. DINO's multi-crop)."""
        x = self.images[index]
        if self.max_value != 255.0:
            x = (x.float() * (255.0 / self.max_value)).round_().to(torch.uint8)
        return x, int(self.labels[index])

    def _random_item(self, index: int) -> tuple[Tensor, int]:
        x = self.images[index].float().mul_(1.0 / self.max_value)
        label = -1 if self.stacked else int(self.labels[index])  # stacked: labels indexed for the batch
        return self._random_tf(x).contiguous(), label

    def __getitem__(self, index: int) -> tuple[Tensor, int]:
        if self.stacked:
            raise TypeError("a set placed on the device (data.on_device) makes whole batches: "
                            "load it with __getitems__")
        index = int(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for a dataset of {len(self)} items")
        if self._random_tf is not None:
            return self._random_item(index)
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[tuple[Tensor, int]] | Stacked:
        if self._random_tf is not None:
            # Per-sample random transforms, in index order (each draws from torch's global RNG).
            return self._items([self._random_item(int(i)) for i in indices], indices)
        idx = self._index(indices)
        x = self._batch(idx)
        if self.train_spec is not None:  # "flip": each image mirrored with probability 1/2, the batch at once
            flip = (torch.rand(len(indices)) < 0.5).to(x.device, non_blocking=True)
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        return self._batch_out(x, idx)

    def seeded_items(self, indices: Sequence[int], seeds: Sequence[int]) -> list[tuple[Tensor, int]]:
        """``__getitems__`` as ``SeededDataset`` loads a training batch: sample k's random draws come
        from ``seeds[k]`` alone (the batch it lands in changes nothing), the deterministic part still
        computed for the batch at once."""
        if self._random_tf is not None:
            items = []
            for index, seed in zip(indices, seeds):
                torch.random.default_generator.manual_seed(seed)
                items.append(self._random_item(int(index)))
            return self._items(items, indices)
        idx = self._index(indices)
        x = self._batch(idx)
        if self.train_spec is not None:  # "flip": each image mirrored with probability 1/2, a coin of its seed
            flip = seed_coins(seeds).to(x.device, non_blocking=True)
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        return self._batch_out(x, idx)

    # ------------------------------------------------------------------ on the device (data.on_device)
    @property
    def nbytes(self) -> int:
        return self.images.nbytes + self.labels.nbytes

    def placed_on(self, device: torch.device) -> "InMemoryClassification":
        """This set with its images and labels in ``device``'s memory, batches made there and handed
        over whole (:class:`Stacked`). The same samples and draws as here: only where they are made moves."""
        placed = self.with_data(self.images.to(device), self.labels.to(device))
        placed.stacked = True
        return placed

    def _index(self, indices: Sequence[int]) -> Tensor:
        # non_blocking: an index copied to the GPU from pageable memory is staged at once; a blocking
        # copy would wait for every kernel queued before it (a host sync each batch)
        return torch.as_tensor(indices, dtype=torch.int64).to(self.images.device, non_blocking=True)

    def _batch_out(self, x: Tensor, idx: Tensor) -> list[tuple[Tensor, int]] | Stacked:
        if self.stacked:
            return Stacked((x, self.labels[idx]))
        return list(zip(x.unbind(0), self.labels[idx].tolist()))

    def _items(self, items: list[tuple[Tensor, int]], indices: Sequence[int]) -> list[tuple[Tensor, int]] | Stacked:
        if self.stacked:
            return Stacked((torch.stack([x for x, _ in items]), self.labels[self._index(indices)]))
        return items

    def subset(self, n: int | None) -> "InMemoryClassification":
        """The first ``n`` items as a dataset of the same kind (shares memory); ``None``: self."""
        if n is None or n >= len(self):
            return self
        if n < 1:
            raise ValueError(f"limit must be >= 1, got {n}")
        return self.with_data(self.images[:n], self.labels[:n])

    def with_data(self, images: Tensor, labels: Tensor) -> "InMemoryClassification":
        return InMemoryClassification(
            images, labels, classes=self.classes, max_value=self.max_value, mean=self.mean,
            std=self.std, image_size=self.image_size, resize_to=self.resize_to, train_spec=self.train_spec,
        )


@dataclass(frozen=True)
class ImageSetFacts:
    """What an in-memory image set is: its class names, the value of a white pixel, the padding of
    its "basic" crop at native size, and whether a mirrored image is still of its class (a
    mirrored digit is another symbol)."""
    classes: Sequence[str]
    max_value: float
    basic_padding: int
    flip_ok: bool


def make_in_memory_pair(train: tuple[Tensor, Tensor], val: tuple[Tensor, Tensor], facts: ImageSetFacts, *,
                        image_size: int | None, augment: str) -> tuple[InMemoryClassification,
                                                                        InMemoryClassification, int]:
    """Train/val datasets for an in-memory image set, each ``(uint8 images [N,C,H,W], labels [N])``,
    under one augment policy.

    Returns ``(train, val, image_size)``.  Statistics for "none"/"basic" come from the whole
    train split (before any limit); "imagenet" uses ImageNet mean/std.
    """
    (train_images, train_labels), (val_images, val_labels) = train, val
    classes, max_value, basic_padding, flip_ok = facts.classes, facts.max_value, facts.basic_padding, facts.flip_ok
    check_augment(augment)
    native = train_images.shape[-1]
    size = native if image_size is None else int(image_size)
    if size < 1:
        raise ValueError(f"image_size must be positive, got {image_size}")
    channels = train_images.shape[1]
    if augment == "imagenet":
        mean, std = imagenet_stats(channels)
        val_resize = int(size / VAL_CROP_RATIO)
        train_spec = {"kind": "imagenet", "flip": flip_ok}
    else:
        mean, std = channel_stats(train_images, max_value)
        val_resize = None if size == native else size
        # a mirrored digit is another symbol: where flip_ok is False, "flip" mirrors nothing (as "basic"
        # then crops without its flip), so a recipe's augment carries over to such a dataset
        no_random = augment == "none" or (augment == "flip" and not flip_ok)
        train_spec = None if no_random else {"kind": "flip"} if augment == "flip" else {
            "kind": "basic",
            "padding": max(1, round(basic_padding * size / native)),
            "flip": flip_ok,
        }
    common = dict(classes=classes, max_value=max_value, mean=mean, std=std, image_size=size)
    train_set = InMemoryClassification(
        train_images, train_labels, resize_to=val_resize, train_spec=train_spec, **common,
    )
    val_set = InMemoryClassification(val_images, val_labels, resize_to=val_resize, **common)
    return train_set, val_set, size
