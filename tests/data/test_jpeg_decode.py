"""data.decode=gpu (data/jpeg_decode.py): the device path, run on the CPU through the same code,
against the CPU path (PIL and torchvision's v2 RandomResizedCrop + RandomHorizontalFlip) on the same
files and seeds: the same crop and flip for every sample, pixels within the two decoders' and
resizes' rounding, the same statistics over a batch; the files nvJPEG does not take are decoded on
the host and counted; evaluation is the CPU path's, exactly."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from devices import ON_CUDA, TEST_DEVICE
from resume_checks import assert_bit_identical, fit_and_crash_resume, state_of
from visiontrain.core import config as C
from visiontrain.data.datasets.image_folder import ImageFolderClassification, build_image_folder
from visiontrain.data.datasets.sources import ClassificationReader
from visiontrain.data.images import UnreadableImageError
from visiontrain.data.jpeg_decode import DecodedImage, DeviceDecoder, EncodedBatch, EncodedImage, collate_encoded
from visiontrain.data.normalize import NormalizeOnDevice

SIZE = 48


def _photo(rng: np.random.Generator, h: int, w: int) -> Image.Image:
    """Smooth colour noise: a JPEG of it is photo-like, not a block of noise the decoders round apart."""
    small = rng.integers(0, 256, (max(2, h // 16), max(2, w // 16), 3), dtype=np.uint8)
    return Image.fromarray(small).resize((w, h), Image.BICUBIC)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[tuple[str, int]]:
    root = tmp_path_factory.mktemp("jpegs")
    rng = np.random.default_rng(0)
    samples = []
    for i in range(12):
        im = _photo(rng, *((120, 160) if i % 3 else (160, 120)))
        path = root / f"{i}.jpg"
        im.save(path, quality=90)
        samples.append((str(path), i % 2))
    grey, png, cmyk, turned = (root / n for n in ("grey.jpg", "flat.png", "cmyk.jpg", "turned.jpg"))
    _photo(rng, 100, 140).convert("L").save(grey, quality=90)
    _photo(rng, 90, 130).save(png)
    _photo(rng, 110, 100).convert("CMYK").save(cmyk, quality=90)
    exif = Image.Exif()
    exif[0x0112] = 6  # turned a quarter: the CPU path's upright frame
    _photo(rng, 100, 150).save(turned, quality=90, exif=exif)
    return samples + [(str(grey), 0), (str(png), 1), (str(cmyk), 0), (str(turned), 1)]


def _pair(samples):
    cpu = ImageFolderClassification(samples, ["a", "b"], image_size=SIZE, mode="imagenet", uint8=True)
    device = ImageFolderClassification(samples, ["a", "b"], image_size=SIZE, mode="imagenet", decode_on_device=True)
    return cpu, device


def _loaded(ds, seeds):
    items = []
    for i, seed in enumerate(seeds):
        torch.random.default_generator.manual_seed(seed)  # as SeededDataset loads a sample
        items.append(ds[i])
    return items


@pytest.mark.cuda
def test_each_sample_gets_the_cpu_paths_crop_and_flip(files):
    cpu, device = _pair(files)
    seeds = [1000 + 7 * i for i in range(len(files))]
    expected = NormalizeOnDevice()(torch.stack([x for x, _ in _loaded(cpu, seeds)]))
    decoder = DeviceDecoder(SIZE, say=False)
    items = _loaded(device, seeds)
    encoded, labels = collate_encoded(items)
    got, labels = decoder((encoded, labels.to(TEST_DEVICE)))  # decoded where the labels are
    got, labels = got.cpu(), labels.cpu()
    assert labels.tolist() == [label for _, label in files]
    kinds = [type(x).__name__ for x, _ in items]
    assert kinds == ["EncodedImage"] * 13 + ["DecodedImage"] * 3  # the grey JPEG goes to nvJPEG
    assert decoder.on_host == 3 and decoder.seen == len(files)
    # in 0..255 levels. On the CPU both paths decode with libjpeg-turbo and torchvision's antialiased
    # resize of uint8 tensors follows PIL's: 0 on this project's machines. nvJPEG upsamples chroma and
    # rounds its IDCT its own way: a few levels. Another crop or a missed flip is tens of levels off.
    diff = (got - expected).abs() * torch.tensor(NormalizeOnDevice().std).view(3, 1, 1) * 255
    per_sample = diff.mean(dim=(1, 2, 3))
    assert per_sample.max() < (4.0 if ON_CUDA else 1.5), per_sample
    assert [got.mean().item(), got.std().item()] == pytest.approx([expected.mean().item(), expected.std().item()], abs=0.01)


def test_the_draws_follow_the_seed_not_the_batch(files):
    _, device = _pair(files)
    once = _loaded(device, [5] * 4)
    again = _loaded(device, [5] * 4)
    assert [(x.box, x.flip) for x, _ in once] == [(x.box, x.flip) for x, _ in again]
    boxes = {x.box for x, _ in _loaded(device, range(40, 44))}
    assert len(boxes) == 4  # other seeds, other crops


def test_a_jpeg_the_device_refuses_is_decoded_on_the_host_and_counted(files, monkeypatch):
    import torchvision.io

    _, device = _pair(files[:3])
    items = _loaded(device, [1, 2, 3])
    real = torchvision.io.decode_jpeg

    def refuses_the_second(data, **kw):
        if isinstance(data, list) or torch.equal(data, items[1][0].data):
            raise RuntimeError("nvjpeg: unsupported")
        return real(data, **kw)

    monkeypatch.setattr(torchvision.io, "decode_jpeg", refuses_the_second)
    decoder = DeviceDecoder(SIZE, say=False)
    refused, _ = decoder(collate_encoded(items))
    monkeypatch.setattr(torchvision.io, "decode_jpeg", real)
    straight, _ = DeviceDecoder(SIZE, say=False)(collate_encoded(items))
    assert decoder.on_host == 1
    assert (refused - straight).abs().mean() < 0.05  # PIL for that one: the same image


def test_an_unreadable_file_is_named(tmp_path, files):
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not an image")
    _, device = _pair([(str(bad), 0)] + files[:1])
    with pytest.raises(UnreadableImageError, match="bad.jpg"):
        device[0]
    device.on_bad_image = "skip"  # data.on_bad_image=skip: the next file stands in
    assert isinstance(device[0][0], (EncodedImage, DecodedImage))


@pytest.fixture(scope="module")
def folder(files) -> str:
    """An image folder of the fixture's first 12 files (JPEGs and the grey one): the same files in
    train and val, two classes."""
    root = os.path.join(os.path.dirname(files[0][0]), "folder")
    for i, (path, label) in enumerate(files[:12]):
        for split in ("train", "val"):
            os.makedirs(f"{root}/{split}/{'ab'[label]}", exist_ok=True)
            os.link(path, f"{root}/{split}/{'ab'[label]}/{i}.jpg")
    return root


def test_evaluation_is_the_cpu_paths_exactly(folder):
    """data.decode only changes the training images: validation items are made by the CPU path."""
    cpu = build_image_folder(ClassificationReader(root=folder, image_size=SIZE, augment="imagenet"))
    device = build_image_folder(ClassificationReader(root=folder, image_size=SIZE, augment="imagenet",
                                                     decode_on_device=True))
    assert device[0].decode_on_device and not device[1].decode_on_device
    for i in range(len(cpu[1])):
        assert torch.equal(cpu[1][i][0], device[1][i][0])


def test_a_run_decoding_on_the_device_resumes_bit_exact(folder, tmp_path):
    """The same files in the same order, each with its seed's crop and flip: a run killed mid-epoch
    and resumed ends with the straight run's weights. The imagenet recipe at a small size (ResNet-18,
    32 px, 12 images), the decode done on the CPU through the device path."""
    cfg = C.load_config("classify-mobilevit-imagenet", [
        f"data.root={folder}", "data.decode=gpu", "task.model=resnet18", "data.image_size=32", "data.batch_size=4",
        "trainer.epochs=2", "trainer.log_every=1", "checkpoint.every=2", "checkpoint.unit=steps",
        "data.num_workers=0",  # the worker start (forkserver) is tests/data/test_worker_start.py's subject
        "trainer.precision=fp32",  # the comparison is within one run's precision; fp32 on any CPU
        "trainer.plots=false"])  # the figures at the end: seconds of CPU a run, not the subject
    full, resumed = fit_and_crash_resume(cfg, tmp_path, crash_at=4, position=(4, 1, 1))
    assert isinstance(full.run.source.loader.collate_fn(full.run.source.first_items())[0], EncodedBatch)
    assert_bit_identical(state_of(full), state_of(resumed))
