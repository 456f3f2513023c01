"""Fashion-MNIST from its idx files (Debian package ``dataset-fashion-mnist``), or torchvision's download.

The four idx files are decoded with gzip + numpy (uncompressed copies are accepted too) and kept in
memory as one uint8 tensor ``[N, 1, 28, 28]`` per split.
"""

from __future__ import annotations

import functools
import gzip
import os
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from visiontrain.core._tv_compat import ensure_torchvision

DEBIAN_DIR = "/usr/share/datasets/fashion-mnist"
CACHE_ENV = "VISIONTRAIN_DATA_CACHE"
DEFAULT_CACHE = "data-cache"
CLASS_NAMES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", 60000),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte", 10000),
}
_IMAGE_MAGIC, _LABEL_MAGIC = 0x00000803, 0x00000801


class DatasetFormatError(ValueError):
    """A dataset file is corrupt, truncated or not what its name says."""


def _read_bytes(path: Path) -> bytes:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as f:
                return f.read()
        return path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as e:  # BadGzipFile is an OSError; EOFError: truncated
        raise DatasetFormatError(f"cannot read {path}: {type(e).__name__}: {e} (corrupt or truncated file?)") from e


def read_idx(path: str | os.PathLike, *, expect_magic: int, expect_dims: tuple[int | None, ...]) -> np.ndarray:
    """Decode an idx ubyte file (``.gz`` or raw); checks the magic number, the dims and the size."""
    path = Path(path)
    raw = _read_bytes(path)
    ndim = len(expect_dims)
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetFormatError(f"{path}: only {len(raw)} bytes, shorter than the idx header (truncated?)")
    magic = int.from_bytes(raw[:4], "big")
    if magic != expect_magic:
        raise DatasetFormatError(
            f"{path}: bad idx magic number 0x{magic:08x}, expected 0x{expect_magic:08x} (corrupt or wrong file?)"
        )
    dims = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    for got, want in zip(dims, expect_dims):
        if want is not None and got != want:
            raise DatasetFormatError(f"{path}: idx dims {dims}, expected {expect_dims}")
    size = int(np.prod(dims))
    if len(raw) - header != size:
        raise DatasetFormatError(
            f"{path}: {len(raw) - header} data bytes, header says {size} for dims {dims} (truncated or corrupt?)"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _find_file(directory: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (directory / name).is_file():
            return directory / name
    return None


def candidate_dirs(root: str | None) -> list[Path]:
    """Where the idx files are looked for: ``root`` (and torchvision's ``root/FashionMNIST/raw``), or
    without a root the Debian dir and an earlier download in the cache dir."""
    if root is None:
        return [Path(DEBIAN_DIR), cache_dir(None) / "FashionMNIST" / "raw"]
    r = Path(root).expanduser()
    return [r, r / "fashion-mnist", r / "FashionMNIST" / "raw"]


def cache_dir(root: str | None) -> Path:
    """Download target: ``root`` if given, else ``$VISIONTRAIN_DATA_CACHE`` or ``./data-cache``."""
    if root is not None:
        return Path(root).expanduser()
    return Path(os.environ.get(CACHE_ENV, DEFAULT_CACHE)).expanduser()


def locate(root: str | None) -> Path | None:
    for d in candidate_dirs(root):
        if all(_find_file(d, stem) for img, lab, _ in FILES.values() for stem in (img, lab)):
            return d
    return None


@functools.lru_cache(maxsize=4)
def _load_split_cached(directory: str, split: str, stamp: tuple) -> tuple[Tensor, Tensor]:
    img_stem, lab_stem, n = FILES[split]
    d = Path(directory)
    img_path, lab_path = _find_file(d, img_stem), _find_file(d, lab_stem)
    images = read_idx(img_path, expect_magic=_IMAGE_MAGIC, expect_dims=(None, 28, 28))
    labels = read_idx(lab_path, expect_magic=_LABEL_MAGIC, expect_dims=(None,))
    if images.shape[0] != labels.shape[0]:
        raise DatasetFormatError(
            f"{img_path} has {images.shape[0]} images but {lab_path} has {labels.shape[0]} labels"
        )
    if images.shape[0] != n:
        raise DatasetFormatError(f"{img_path}: {images.shape[0]} images, Fashion-MNIST {split} has {n}")
    if labels.size and int(labels.max()) >= len(CLASS_NAMES):
        raise DatasetFormatError(f"{lab_path}: label {int(labels.max())} out of range 0..9")
    x = torch.from_numpy(images.copy()).unsqueeze(1)  # [N,1,28,28] uint8
    y = torch.from_numpy(labels.astype(np.int64))
    return x, y


def load_split(directory: Path, split: str) -> tuple[Tensor, Tensor]:
    """``(images uint8 [N,1,28,28], labels int64 [N])``; cached per directory and file mtimes.

    The returned tensors are shared between callers: do not modify them in place.
    """
    img_stem, lab_stem, _ = FILES[split]
    files = [_find_file(directory, img_stem), _find_file(directory, lab_stem)]
    if None in files:
        raise FileNotFoundError(f"Fashion-MNIST {split} files not found in {directory}")
    stamp = tuple((str(f), f.stat().st_mtime_ns, f.stat().st_size) for f in files)
    return _load_split_cached(str(directory.resolve()), split, stamp)


def _download(cache: Path) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    ensure_torchvision()
    from torchvision.datasets import FashionMNIST

    cache.mkdir(parents=True, exist_ok=True)
    out = []
    for train in (True, False):
        try:
            ds = FashionMNIST(root=str(cache), train=train, download=True)
        except Exception as e:  # network errors come in many types (URLError, RuntimeError, ...)
            raise RuntimeError(
                f"downloading Fashion-MNIST into {cache} failed: {type(e).__name__}: {e}. "
                "Install the Debian package (apt-get install dataset-fashion-mnist) or point "
                "data.root=DIR at a directory holding the four idx .gz files."
            ) from e
        out.append((ds.data.unsqueeze(1).contiguous(), ds.targets.to(torch.int64)))
    return out[0], out[1]


def load_fashion_mnist(root: str | None, download: bool) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """``((train_x, train_y), (test_x, test_y))`` from ``root``/Debian files, else a torchvision download."""
    found = locate(root)
    if found is not None:
        return load_split(found, "train"), load_split(found, "test")
    cache = cache_dir(root)
    if download:
        return _download(cache)
    searched = "\n".join(f"  - {d}" for d in candidate_dirs(root))
    names = ", ".join(f"{s}.gz" for img, lab, _ in FILES.values() for s in (img, lab))
    raise FileNotFoundError(
        f"Fashion-MNIST not found. Searched for {names} in:\n{searched}\n"
        "Fix it with one of:\n"
        f"  - apt-get install dataset-fashion-mnist   (installs the files into {DEBIAN_DIR})\n"
        f"  - data.download=true   (torchvision downloads it into {cache})\n"
        "  - data.root=DIR   (a directory holding the four idx .gz files)"
    )
