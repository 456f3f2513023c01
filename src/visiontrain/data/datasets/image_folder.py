"""``root/train/<class>/*.jpg`` + ``root/val/<class>/*.jpg``, scanned with torchvision's ``make_dataset``.

The split directories are ``data.train_split`` and ``data.val_split`` (``train`` and ``val``;
``visiontrain validate --split test`` puts ``data.test_split`` in val's place). Classes are the train
split's sub-directories, and their indices label every split; hidden entries (names starting with
".", such as Jupyter's ``.ipynb_checkpoints``) are neither classes nor images.

Images are decoded with PIL to RGB (any mode: grey, palette, RGBA, 16-bit; ``data.images``) and
transformed with ``torchvision.transforms.v2``; normalisation uses ImageNet mean/std. Every file is
opened before training (``ImageFolderClassification.check_files``, ``data.image_check``): under
``data.on_bad_image=error`` the files that cannot be read stop the run, named in one line with their
count; under ``skip`` they are dropped and counted. A file that fails only when it is decoded in
full is still caught when it is loaded: an error naming it, or under ``skip`` the next image in its
place. An empty split or class directory is an error naming the directory. The dataset object keeps
only the samples, packed (``visiontrain.data.packed``: a worker's copy is the size of the paths), and
a transform spec (the v2 objects are rebuilt after unpickling), so spawned DataLoader workers do not
import torchvision before the compatibility shim.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset

from visiontrain.core._tv_compat import ensure_torchvision
from visiontrain.data.bad_data import check_skipped_share, class_difference, listed
from visiontrain.data.datasets.in_memory import IMAGENET_MEAN, IMAGENET_STD, VAL_CROP_RATIO, check_augment, tv_v2
from visiontrain.data.datasets.sources import ClassificationReader
from visiontrain.data.eval_transform import EvalTransform
from visiontrain.data.image_check import problem_kind, unreadable_images
from visiontrain.data.images import UnreadableImageError, open_rgb
from visiontrain.data.jpeg_decode import DecodedImage, EncodedImage, read_for_device
from visiontrain.data.packed import PackedSamples

DEFAULT_IMAGE_SIZE = 224
LIMIT_SEED = 0  # the fixed seed of the class-balanced data.limit_* subsets (balanced_subset)
LAYOUT = "ROOT/train/<class>/*.jpg and ROOT/val/<class>/*.jpg (one sub-directory per class)"
log = logging.getLogger("visiontrain")


class ImageFolderClassification(Dataset):
    """Items ``(float32 [3,S,S] normalised image, int label)``; ``mode`` is "val", "flip", "basic" or "imagenet"."""

    mean, std = IMAGENET_MEAN, IMAGENET_STD  # the normalisation, also for transforms built elsewhere

    def __init__(self, samples: Sequence[tuple[str, int]], classes: list[str], *, image_size: int, mode: str,
                 uint8: bool = False, source: str = "", decode_on_device: bool = False) -> None:
        self.samples = samples if isinstance(samples, PackedSamples) else PackedSamples(samples)
        self.source = source  # the split directory, for messages
        self.on_bad_image = "error"  # a file that fails when loaded: data.on_bad_image, set by check_files
        self.uint8 = uint8  # True: no ToDtype/Normalize here; the device does them (NormalizeOnDevice)
        # data.decode=gpu (mode imagenet): items are the files' bytes and their draws (data.jpeg_decode)
        self.decode_on_device = decode_on_device
        if decode_on_device and mode != "imagenet":
            raise ValueError(f"data.decode=gpu decodes and crops the training images of data.augment=imagenet on "
                             f"the device; data.augment={mode!r} is done on the CPU (set data.decode=cpu or auto)")
        self.classes = list(classes)
        self.image_size = int(image_size)
        self.mode = mode
        self._tf = None
        self._build()

    @property
    def eval_transform(self) -> EvalTransform:
        """The validation items' transform (on the decoded uint8 pixels); its spec is the checkpoint's
        ``data_info["preprocess"]``."""
        return image_folder_eval_transform(self.image_size)

    def _build(self) -> None:
        v2 = tv_v2()

        s = self.image_size
        if self.mode == "val":  # one rule with inference: the EvalTransform, or its geometry alone for uint8
            tf = self.eval_transform
            self._tf = v2.Compose([v2.ToImage(), tf.geometry if self.uint8 else tf])
            return
        if self.mode == "imagenet":
            geometry = [v2.RandomResizedCrop(s, antialias=True), v2.RandomHorizontalFlip()]
        elif self.mode == "flip":  # the validation geometry, mirrored half of the time
            geometry = [self.eval_transform.geometry, v2.RandomHorizontalFlip()]
        elif self.mode == "basic":
            geometry = [v2.Resize(int(s / VAL_CROP_RATIO), antialias=True), v2.RandomCrop(s), v2.RandomHorizontalFlip()]
        else:
            raise ValueError(f"unknown image-folder transform mode {self.mode!r}")
        finish = [] if self.uint8 else [v2.ToDtype(torch.float32, scale=True),
                                        v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
        self._tf = v2.Compose([v2.ToImage(), *geometry, *finish])

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tf"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._build()

    @property
    def targets(self) -> list[int]:
        return self.samples.labels.tolist()

    def __len__(self) -> int:
        return len(self.samples)

    def raw_item(self, index: int) -> tuple[Any, int]:
        """The decoded RGB PIL image and its label, for transforms built elsewhere (DINO's multi-crop).
        A corrupt or truncated file raises ``UnreadableImageError`` naming it; under ``skip`` the next
        image stands in (the same one every time, so a resumed run loads what it would have)."""
        return self._first_readable(index, self.decoded_item)

    def _first_readable(self, index: int, load: Callable[[int], tuple[Any, int]]) -> tuple[Any, int]:
        """``load(index)``, or under ``skip`` that of the next index whose file can be read."""
        for offset in range(len(self)):
            try:
                return load((index + offset) % len(self))
            except UnreadableImageError as err:
                if self.on_bad_image != "skip":
                    raise
                log.warning("skipping %s (data.on_bad_image=skip: the next image stands in)", err)
        raise UnreadableImageError(f"image-folder split {self.source}: no image of the split can be decoded")

    def decoded_item(self, index: int) -> tuple[Any, int]:
        """Sample ``index`` decoded, or ``UnreadableImageError`` naming its file."""
        path, label = self.samples[index]
        return open_rgb(path), int(label)

    def check_files(self, on_bad_image: str, max_skipped_share: float, check: str = "changed") -> None:
        """Open every file now, before the first step (``visiontrain.data.image_check``). Under
        ``error`` the files that cannot be read are one error naming the first few and their count;
        under ``skip`` they leave the sample list, with one warning, unless they are more than
        ``max_skipped_share`` of the split (then the error gives the likely cause)."""
        self.on_bad_image = on_bad_image
        where = f"image-folder split {self.source}"
        if len(self.samples) >= 50_000:  # ImageNet's 1.28 M files take minutes: say why nothing moves
            log.info("%s: checking that its %d image files can be read (data.on_bad_image)", where, len(self.samples))
        bad = unreadable_images(list(self.samples.paths), check)  # changed: recorded verdicts of unchanged files
        if not bad:
            return
        total, named = len(self.samples), [f"{self.samples[i][0]} {problem}" for i, problem in bad]
        if on_bad_image == "error":
            raise ValueError(f"{where}: {len(bad):,} of {total:,} image files cannot be read: "
                             f"{listed(named, sep='; ')}; set data.on_bad_image=skip to train without them")
        check_skipped_share(where, "image files cannot be read", len(bad), total, max_skipped_share,
                            Counter(problem_kind(problem) for _, problem in bad))
        dropped = {i for i, _ in bad}
        if len(dropped) == total:
            raise ValueError(f"{where}: none of its {total:,} image files can be read: {listed(named, sep='; ')}")
        log.warning("%s: skipped %d of %d image files that cannot be read (data.on_bad_image=skip): %s", where,
                    len(bad), total, listed([self.samples[i][0] for i, _ in bad]))
        self.samples = self.samples.take(i for i in range(total) if i not in dropped)

    def encoded_item(self, index: int) -> tuple[EncodedImage | DecodedImage, int]:
        """Sample ``index`` for the device to decode (``data.decode=gpu``)."""
        path, label = self.samples[index]
        return read_for_device(path, self.image_size), int(label)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        if self.decode_on_device:
            return self._first_readable(index, self.encoded_item)
        img, label = self.raw_item(index)
        return self._tf(img).as_subclass(Tensor).contiguous(), label


def image_folder_eval_transform(image_size: int) -> EvalTransform:
    """Resize the shorter side to size / 0.875 and centre-crop (ImageNet's evaluation), on the decoded
    8-bit pixels, then ImageNet normalisation."""
    return EvalTransform(image_size, IMAGENET_MEAN, IMAGENET_STD, resize=int(image_size / VAL_CROP_RATIO),
                         geometry_on_uint8=True)


def _hidden(name: str) -> bool:
    """Names starting with "." are not data: Jupyter's ``.ipynb_checkpoints``, macOS's ``.DS_Store``
    and ``._x.jpg``, a ``.git``. Counted as a class, such a folder shifts every label after it."""
    return name.startswith(".")


def find_classes(directory: Path) -> list[str]:
    """The class names of a split: its sub-directories, sorted, hidden ones skipped.

    The one class discovery used both to check train against val and to assign label indices, so
    the two cannot disagree (torchvision's ``find_classes`` counts hidden folders as classes)."""
    return sorted(e.name for e in directory.iterdir() if e.is_dir() and not _hidden(e.name))


def scan_split(directory: Path, class_to_idx: dict[str, int]) -> list[tuple[str, int]]:
    """``(path, label)`` of every image under ``directory/<class>/`` (recursively, in the order of
    torchvision's ``make_dataset``), labelled by ``class_to_idx``: the train split's map for both splits.

    Hidden files and files under hidden sub-directories of a class folder are skipped. A symlinked
    directory is followed once per real directory (``_walk_once``): a link back up the tree, or a
    second link to a folder already read, is skipped and said in one line, where torchvision's walk
    reads a folder again through each link (and never ends in a loop). A class folder without a
    readable image is an error naming the split directory and the classes."""
    ensure_torchvision()
    from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension

    prefix = os.path.join(str(directory), "")
    split_dir = Path(os.path.realpath(directory))
    seen = {str(split_dir), *map(str, split_dir.parents)}  # a link up to one of them is a loop
    repeats: list[str] = []
    samples = []
    for name, label in sorted(class_to_idx.items()):
        for root, files in sorted(_walk_once(os.path.join(prefix, name), seen, repeats)):
            below = os.sep + root[len(prefix):]  # hidden parts only below the split (ROOT may be ~/.data)
            samples += [(os.path.join(root, f), label) for f in sorted(files)
                        if not f.startswith(".") and has_file_allowed_extension(f, IMG_EXTENSIONS)
                        and os.sep + "." not in below]
    if repeats:
        log.warning("image-folder split %s: %d symlinked director%s lead%s to a folder already read (a link "
                    "back up the tree, or a second link to it), not read again: %s", directory, len(repeats),
                    "y" if len(repeats) == 1 else "ies", "s" if len(repeats) == 1 else "", ", ".join(repeats[:3]))
    found = {t for _, t in samples}
    empty = sorted(c for c, i in class_to_idx.items() if i not in found)
    if empty:  # torchvision's message names no directory
        raise FileNotFoundError(
            f"image-folder split {directory}: Found no valid file for the classes {', '.join(empty)}. "
            f"Supported extensions are: {', '.join(IMG_EXTENSIONS)} (hidden files and folders, whose "
            f"names start with '.', are skipped); empty: {', '.join(str(directory / c) for c in empty)}")
    return samples


def _walk_once(top: str, seen: set[str], repeats: list[str]) -> Iterator[tuple[str, list[str]]]:
    """``os.walk(top, followlinks=True)`` as ``(directory, file names)``, each real directory once
    (``seen``: real paths read so far); the links that lead to one already read go to ``repeats``."""
    real = os.path.realpath(top)
    if real in seen:
        repeats.append(top)
        return
    seen.add(real)
    for root, dirs, files in os.walk(top, followlinks=True):
        kept = []
        for d in dirs:
            path = os.path.join(root, d)
            real = os.path.realpath(path)
            if real in seen:
                repeats.append(path)
            else:
                seen.add(real)
                kept.append(d)
        dirs[:] = kept
        yield root, files


def balanced_subset(samples: list[tuple[str, int]], n: int | None,
                    seed: int = LIMIT_SEED) -> list[tuple[str, int]]:
    """``n`` samples spread evenly over the classes (``data.limit_train`` / ``data.limit_val``).

    The scan lists files class by class, so its first ``n`` may all be one class: a smoke run
    that then "learns" perfectly, or a val top-1 of a single class. Each class's files are shuffled
    with a fixed seed, then taken round-robin across classes (a class that runs out drops out)
    until ``n``. The seed is a constant, not the run's: the subset is the same in every run, so a
    resumed run sees the samples it started with. The kept samples stay in scan order."""
    if n is None or n >= len(samples):
        return list(samples)
    by_class: dict[int, list[int]] = {}
    for i, (_, label) in enumerate(samples):
        by_class.setdefault(label, []).append(i)
    g = torch.Generator().manual_seed(seed)
    queues = [[idx[j] for j in torch.randperm(len(idx), generator=g).tolist()]
              for _, idx in sorted(by_class.items())]
    keep: list[int] = []
    depth = 0
    while len(keep) < n:
        keep.extend(q[depth] for q in queues if depth < len(q))
        depth += 1
    return [samples[i] for i in sorted(keep[:n])]


def check_same_classes(train_dir: Path, train_classes: list[str], other_dir: Path, other_classes: list[str]) -> None:
    """Another split must have the train split's class folders: the labels are the train split's
    indices. The error names the classes missing from it and those the train split lacks."""
    if train_classes != other_classes:
        difference = class_difference(train_classes, other_classes, f"{train_dir.name}/", f"{other_dir.name}/")
        raise ValueError(f"image-folder: the classes of {other_dir} ({len(other_classes):,}) must be those of "
                         f"{train_dir} ({len(train_classes):,}), one sub-directory each; {difference}")


def build_image_folder(reader: ClassificationReader) -> tuple[Dataset, Dataset, list[str], int]:
    """``(train, val, class_names, image_size)``; the splits are the directories ``root/train_split``
    and ``root/val_split``."""
    root, image_size, augment = reader.root, reader.image_size, reader.augment
    limit_train, limit_val, train_split, val_split = reader.limit_train, reader.limit_val, reader.train_split, \
        reader.val_split
    check_augment(augment)
    if root is None:
        raise FileNotFoundError(f"data.name=image-folder needs data.root=ROOT with the layout {LAYOUT}")
    base = Path(root).expanduser()
    train_dir, val_dir = base / train_split, base / val_split
    for d in (base, train_dir, val_dir):
        if not d.is_dir():
            raise FileNotFoundError(f"image-folder directory {d} does not exist; expected the layout {LAYOUT}"
                                    f"{'' if d == base else ' (data.train_split, data.val_split name the splits)'}")
    train_classes, val_classes = find_classes(train_dir), find_classes(val_dir)
    for d, found in ((train_dir, train_classes), (val_dir, val_classes)):
        if not found:
            raise FileNotFoundError(f"no class sub-directories in {d}; expected the layout {LAYOUT}")
    check_same_classes(train_dir, train_classes, val_dir, val_classes)
    classes = train_classes
    class_to_idx = {name: i for i, name in enumerate(classes)}  # the train split's map, for val too
    train_samples = scan_split(train_dir, class_to_idx)
    val_samples = scan_split(val_dir, class_to_idx)
    size = DEFAULT_IMAGE_SIZE if image_size is None else int(image_size)
    for name, n in (("limit_train", limit_train), ("limit_val", limit_val)):
        if n is not None and n < 1:
            raise ValueError(f"{name} must be >= 1, got {n}")
    train_samples = balanced_subset(train_samples, limit_train)
    val_samples = balanced_subset(val_samples, limit_val)
    train = ImageFolderClassification(train_samples, classes, image_size=size,
                                      mode="val" if augment == "none" else augment, uint8=reader.uint8_train,
                                      source=str(train_dir), decode_on_device=reader.decode_on_device)
    val = ImageFolderClassification(val_samples, classes, image_size=size, mode="val", source=str(val_dir))
    return train, val, classes, size
