from visiontrain.core._tv_compat import ensure_torchvision

ensure_torchvision()

import pickle  # noqa: E402
from collections import Counter  # noqa: E402
from importlib.metadata import version  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from dataset_trees import build_png_tree  # noqa: E402
from visiontrain.data.datasets import ClassificationReader, build_classification_data  # noqa: E402
from visiontrain.data.datasets.fashion_mnist import DEBIAN_DIR, DatasetFormatError, read_idx  # noqa: E402
from visiontrain.data.samplers import SeededDataset, sample_seed  # noqa: E402
from visiontrain.models import SmallCNN, build_model  # noqa: E402

HAVE_FASHION = Path(DEBIAN_DIR, "train-images-idx3-ubyte.gz").is_file()
needs_fashion = pytest.mark.skipif(
    not HAVE_FASHION, reason=f"Fashion-MNIST idx files not in {DEBIAN_DIR} (apt-get install dataset-fashion-mnist)"
)


def digits(augment="none", **kw):
    return build_classification_data("digits", ClassificationReader(augment=augment, **kw))


# ---------------------------------------------------------------- digits
def test_digits_split_sizes_determinism_and_stratification():
    a, b = digits(), digits()
    assert (len(a.train), len(a.val)) == (1437, 360)
    assert a.num_classes == 10 and a.class_names == [str(i) for i in range(10)]
    assert (a.in_channels, a.image_size, a.random_train_transforms) == (1, 8, False)
    assert torch.equal(a.train.images, b.train.images) and torch.equal(a.val.labels, b.val.labels)
    # train and val are disjoint image sets drawn from the 1,797 digits
    assert len(a.train) + len(a.val) == 1797
    # stratified: every class has ~20% of its samples in val
    tr, va = Counter(a.train.targets), Counter(a.val.targets)
    for c in range(10):
        frac = va[c] / (tr[c] + va[c])
        assert abs(frac - 0.2) < 0.01, (c, frac)
    x, y = a.train[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32 and isinstance(y, int)
    # normalised with the train split's statistics
    xs = torch.stack([x for x, _ in a.train.__getitems__(list(range(len(a.train))))])
    assert abs(xs.mean().item()) < 1e-4 and abs(xs.std().item() - 1) < 1e-3


def test_the_digits_split_is_kept_once_and_read_back_without_scikit_learn(tmp_path, monkeypatch):
    """The first process makes the split with scikit-learn and keeps it in the data cache dir; the next
    reads those arrays back exactly, and never imports scikit-learn (3 s of a process's start-up)."""
    import subprocess
    import sys

    from visiontrain.data.datasets import classification as cls

    monkeypatch.setenv("VISIONTRAIN_DATA_CACHE", str(tmp_path))
    cls.digits_split.cache_clear()
    try:
        made = cls.digits_split()
        assert [p.name for p in tmp_path.iterdir()] == [
            f"digits-split-{version('scikit-learn')}-{cls.DIGITS_VAL_FRACTION}-{cls.DIGITS_SPLIT_SEED}.npz"]
        for mine, sklearns in zip(made, cls._split_digits()):
            assert mine.dtype == sklearns.dtype and np.array_equal(mine, sklearns)
        read = subprocess.run([sys.executable, "-c", (
            "import sys; from visiontrain.data.datasets.classification import digits_split; s = digits_split(); "
            "print(sum(int(a.sum()) for a in s), 'sklearn' in sys.modules)")], capture_output=True, text=True,
            check=True)
        assert read.stdout.split() == [str(sum(int(a.sum()) for a in made)), "False"]
    finally:
        cls.digits_split.cache_clear()


def test_digits_limits_and_resize():
    d = digits(limit_train=50, limit_val=20, image_size=16)
    assert (len(d.train), len(d.val), d.image_size) == (50, 20, 16)
    assert d.train[3][0].shape == (1, 16, 16) and d.val[0][0].shape == (1, 16, 16)
    full = digits()
    assert d.train.targets == full.train.targets[:50]


def test_getitems_matches_getitem_for_augment_none():
    for ds in (digits().train, digits(image_size=12).val):
        idx = [5, 0, 17, 5, len(ds) - 1]
        batch = ds.__getitems__(idx)
        for i, (x, y) in zip(idx, batch):
            x1, y1 = ds[i]
            assert torch.equal(x, x1) and y == y1


def test_dataloader_uses_batched_path_and_pickles():
    ds = digits().train
    loader = DataLoader(ds, batch_size=64, shuffle=False)
    x, y = next(iter(loader))
    assert x.shape == (64, 1, 8, 8) and y.dtype == torch.int64
    assert torch.equal(x[7], ds[7][0]) and y[7].item() == ds[7][1]
    clone = pickle.loads(pickle.dumps(digits(augment="basic").train))
    assert clone.random_transforms and clone[0][0].shape == (1, 8, 8)


def test_augment_basic_random_but_reproducible():
    d = digits(augment="basic")
    assert d.random_train_transforms
    idx = list(range(64))
    torch.manual_seed(123)
    first = torch.stack([x for x, _ in d.train.__getitems__(idx)])
    second = torch.stack([x for x, _ in d.train.__getitems__(idx)])
    torch.manual_seed(123)
    again = torch.stack([x for x, _ in d.train.__getitems__(idx)])
    assert torch.equal(first, again)
    assert not torch.equal(first, second)
    plain = torch.stack([x for x, _ in digits().train.__getitems__(idx)])
    assert not torch.equal(first, plain) and first.shape == plain.shape
    # val stays deterministic
    assert torch.equal(d.val[0][0], digits().val[0][0])


def test_augment_imagenet_shapes_and_stats():
    d = digits(augment="imagenet", image_size=16, limit_train=8, limit_val=8)
    assert d.train[0][0].shape == (1, 16, 16) and d.val[0][0].shape == (1, 16, 16)
    assert d.train.mean == pytest.approx((0.449,), abs=1e-3)


def test_bad_names():
    with pytest.raises(ValueError, match="fashion-mnist.*digits.*image-folder"):
        build_classification_data("cifar-1000", ClassificationReader())
    with pytest.raises(ValueError, match="none.*basic.*imagenet"):
        digits(augment="heavy")


# ---------------------------------------------------------------- fashion-mnist
@needs_fashion
def test_fashion_mnist_from_debian_files():
    d = build_classification_data("fashion-mnist", ClassificationReader())
    assert (len(d.train), len(d.val)) == (60000, 10000)
    assert d.class_names[0] == "T-shirt/top" and d.class_names[9] == "Ankle boot" and d.num_classes == 10
    assert (d.in_channels, d.image_size) == (1, 28)
    assert d.train.images.shape == (60000, 1, 28, 28) and d.train.images.dtype == torch.uint8
    assert sorted(Counter(d.train.targets).values()) == [6000] * 10
    assert Counter(d.val.targets) == {c: 1000 for c in range(10)}
    assert d.train.mean == pytest.approx((0.2860,), abs=1e-3) and d.train.std == pytest.approx((0.3530,), abs=1e-3)
    xs = torch.stack([x for x, _ in d.train.__getitems__(list(range(0, 60000, 7)))])
    assert abs(xs.mean().item()) < 0.02 and abs(xs.std().item() - 1) < 0.02
    x, y = d.val[0]
    assert x.shape == (1, 28, 28) and y == 9  # first t10k item is an ankle boot


@needs_fashion
def test_fashion_mnist_resize_limit_and_basic_augment():
    reader = ClassificationReader(image_size=32, augment="basic", limit_train=100, limit_val=10)
    d = build_classification_data("fashion-mnist", reader)
    assert (len(d.train), len(d.val), d.image_size, d.random_train_transforms) == (100, 10, 32, True)
    assert d.train[0][0].shape == (1, 32, 32) and d.val[0][0].shape == (1, 32, 32)
    torch.manual_seed(0)
    a = d.train.__getitems__([0, 1, 2])
    torch.manual_seed(0)
    b = [d.train[i] for i in (0, 1, 2)]
    assert all(torch.equal(x1, x2) and y1 == y2 for (x1, y1), (x2, y2) in zip(a, b))


@needs_fashion
def test_fashion_mnist_flip_is_the_plain_batch_with_half_the_images_mirrored():
    flip = build_classification_data("fashion-mnist", ClassificationReader(augment="flip"))
    plain = build_classification_data("fashion-mnist", ClassificationReader())
    assert flip.random_train_transforms and not plain.random_train_transforms
    idx = list(range(0, 60000, 30))  # 2,000 images
    torch.manual_seed(7)
    got = flip.train.__getitems__(idx)
    want = plain.train.__getitems__(idx)
    mirrored = [torch.equal(x, w.flip(-1)) and not torch.equal(x, w) for (x, _), (w, _) in zip(got, want)]
    kept = [torch.equal(x, w) for (x, _), (w, _) in zip(got, want)]
    assert all(m or k for m, k in zip(mirrored, kept))
    assert [y for _, y in got] == [y for _, y in want]
    assert 900 < sum(mirrored) < 1100  # p = 1/2: a 4.5-sigma band for n = 2,000
    torch.manual_seed(7)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(got, flip.train.__getitems__(idx)))
    assert torch.equal(flip.val[0][0], plain.val[0][0])  # validation is never mirrored
    # as training loads it (SeededDataset, the batched seeded_items): each image's coin is its own seed's,
    # whatever batch it is in, and half of them come up mirrored
    keys = [(i, sample_seed(7, 0, i)) for i in idx]
    seeded = SeededDataset(flip.train).__getitems__(keys)
    halves = SeededDataset(flip.train).__getitems__(keys[1000:]) + SeededDataset(flip.train).__getitems__(keys[:1000])
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(seeded, halves[1000:] + halves[:1000]))
    flipped = [torch.equal(x, w.flip(-1)) and not torch.equal(x, w) for (x, _), (w, _) in zip(seeded, want)]
    assert all(f or torch.equal(x, w) for f, (x, _), (w, _) in zip(flipped, seeded, want))
    assert 900 < sum(flipped) < 1100
    # digits: a mirrored digit is another symbol, so flip mirrors nothing there (as basic drops its flip)
    mirrorless = digits(augment="flip")
    assert not mirrorless.random_train_transforms
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(mirrorless.train.__getitems__(list(range(64))),
                                                            digits().train.__getitems__(list(range(64)))))


def test_fashion_missing_path_error(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        build_classification_data("fashion-mnist", ClassificationReader(root=str(tmp_path)))
    msg = str(info.value)
    assert str(tmp_path) in msg and str(tmp_path / "FashionMNIST" / "raw") in msg
    assert "train-images-idx3-ubyte.gz" in msg
    assert "apt-get install dataset-fashion-mnist" in msg
    assert "data.download=true" in msg and "data.root=" in msg


def test_idx_reader_validates(tmp_path):
    import gzip

    good = tmp_path / "ok-labels.gz"
    with gzip.open(good, "wb") as f:
        f.write((0x801).to_bytes(4, "big") + (3).to_bytes(4, "big") + bytes([1, 2, 3]))
    assert read_idx(good, expect_magic=0x801, expect_dims=(None,)).tolist() == [1, 2, 3]
    truncated = tmp_path / "short-labels.gz"
    with gzip.open(truncated, "wb") as f:
        f.write((0x801).to_bytes(4, "big") + (5).to_bytes(4, "big") + bytes([1, 2, 3]))
    with pytest.raises(DatasetFormatError, match="short-labels.gz"):
        read_idx(truncated, expect_magic=0x801, expect_dims=(None,))
    with pytest.raises(DatasetFormatError, match="magic"):
        read_idx(good, expect_magic=0x803, expect_dims=(None,))
    cut = tmp_path / "cut.gz"
    cut.write_bytes(good.read_bytes()[:15])
    with pytest.raises(DatasetFormatError, match="cut.gz"):
        read_idx(cut, expect_magic=0x801, expect_dims=(None,))


def test_image_folder(tmp_path):
    build_png_tree(tmp_path, {"train": ["cat", "dog"], "val": ["cat", "dog"]})
    d = build_classification_data("image-folder", ClassificationReader(root=str(tmp_path), image_size=16))
    assert (d.num_classes, d.class_names, d.in_channels, d.image_size) == (2, ["cat", "dog"], 3, 16)
    assert (len(d.train), len(d.val), d.random_train_transforms) == (6, 6, False)
    x, y = d.train[4]
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and y == 1 and type(x) is torch.Tensor
    assert torch.equal(x, d.train[4][0])
    xb, yb = next(iter(DataLoader(d.val, batch_size=4)))
    assert xb.shape == (4, 3, 16, 16) and yb.tolist() == [0, 0, 0, 1]
    reader = ClassificationReader(root=str(tmp_path), image_size=16, augment="imagenet", limit_train=2)
    aug = build_classification_data("image-folder", reader)
    assert aug.random_train_transforms and len(aug.train) == 2 and aug.train[0][0].shape == (3, 16, 16)
    torch.manual_seed(5)
    a = aug.train[0][0]
    torch.manual_seed(5)
    assert torch.equal(a, aug.train[0][0])
    assert build_classification_data("image-folder", ClassificationReader(root=str(tmp_path))).image_size == 224
    flip = build_classification_data("image-folder",
                                     ClassificationReader(root=str(tmp_path), image_size=16, augment="flip"))
    seen = set()
    for seed in range(12):
        torch.manual_seed(seed)
        x, plain = flip.train[4][0], d.train[4][0]
        seen.add("kept" if torch.equal(x, plain) else "mirrored" if torch.equal(x, plain.flip(-1)) else "?")
    assert seen == {"kept", "mirrored"}


def test_image_folder_errors(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="train/<class>") as info:
        build_classification_data("image-folder", ClassificationReader(root=str(missing), image_size=16))
    assert str(missing) in str(info.value) and "val/<class>" in str(info.value)
    build_png_tree(tmp_path / "bad", {"train": ["cat", "dog"], "val": ["cat", "emu"]}, n=1)
    with pytest.raises(ValueError) as info:
        build_classification_data("image-folder", ClassificationReader(root=str(tmp_path / "bad"), image_size=16))
    msg = str(info.value)
    assert "missing from val/: 1 ('dog'); not in train/: 1 ('emu')" in msg and "\n" not in msg


# ---------------------------------------------------------------- models
@pytest.mark.parametrize("shape", [(1, 28, 28), (1, 8, 8), (3, 32, 32)])
def test_small_cnn_shapes(shape):
    model = SmallCNN(shape[0], 10).eval()
    with torch.no_grad():
        out = model(torch.randn(2, *shape))
    assert out.shape == (2, 10) and torch.isfinite(out).all()


def test_build_model_small_cnn_and_timm():
    m = build_model("small_cnn", num_classes=5, in_channels=3, image_size=32, widths=(8, 16, 32), dropout=0.0)
    assert isinstance(m, SmallCNN) and m(torch.randn(2, 3, 32, 32)).shape == (2, 5)
    r = build_model("resnet18", num_classes=7, in_channels=1, image_size=32).eval()
    with torch.no_grad():
        assert r(torch.randn(2, 1, 32, 32)).shape == (2, 7)


def test_build_model_errors(monkeypatch):
    with pytest.raises(ValueError, match="resnet18"):
        build_model("resnet_18", num_classes=7, in_channels=1, image_size=32)
    with pytest.raises(ValueError, match="pretrained"):
        build_model("small_cnn", num_classes=7, in_channels=1, image_size=32, pretrained=True)
    import visiontrain.models as models

    monkeypatch.setattr(models, "_cached_weights", lambda timm, name: False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="resnet18.*pretrained=false"):
        build_model("resnet18", num_classes=7, in_channels=1, image_size=32, pretrained=True)


def test_small_cnn_with_a_flattened_head_is_the_plain_three_block_network():
    """classify-fashion's network: 3 blocks of conv + BN + ReLU + pool (32-64-128), flatten, linear."""
    m = build_model("small_cnn", num_classes=10, in_channels=1, image_size=28, dropout=0.2, double_last=False,
                    head="flatten")
    # convs 288 + 18,432 + 73,728, BN 64 + 128 + 256, linear 1,152 x 10 + 10
    assert sum(p.numel() for p in m.parameters()) == 104_426 and m.num_features == 128 * 3 * 3
    assert m(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    with pytest.raises(ValueError, match="task.model_args"):
        build_model("small_cnn", num_classes=10, in_channels=1, image_size=28, depth=3)


def test_plain_cnn_is_the_preset_and_a_recipe_on_it_takes_another_model():
    torch.manual_seed(0)
    plain = build_model("plain_cnn", num_classes=10, in_channels=1, image_size=28, dropout=0.2)
    torch.manual_seed(0)
    spelled = SmallCNN(1, 10, dropout=0.2, double_last=False, head="flatten", init="torch", image_size=28)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), spelled.state_dict().values()))
    assert sum(p.numel() for p in plain.parameters()) == 104_426
    # the preset is the model's name, not task.model_args, so the recipe's model can be swapped for a timm one
    from visiontrain.core import config as C
    from visiontrain.tasks import build_task

    cfg = C.load_config("classify-fashion", ["task.model=resnet18", "data.name=digits"])
    model = build_task(cfg).build_model({"num_classes": 10, "in_channels": 1, "image_size": 8})
    assert type(model).__name__ == "ResNet"


def test_small_cnn_init_kaiming_or_torch_defaults():
    def first_conv_std(init):
        torch.manual_seed(0)
        return SmallCNN(1, 10, init=init).blocks[0][0][0].weight.std().item()

    # He normal, fan-out (32 * 9): std sqrt(2 / 288) = 0.083; torch's uniform(+-1/sqrt(fan_in = 9)): 0.19
    assert first_conv_std("kaiming") == pytest.approx((2 / 288) ** 0.5, rel=0.15)
    assert first_conv_std("torch") == pytest.approx(1 / 3 / 3 ** 0.5, rel=0.15)
    with pytest.raises(ValueError, match="task.model_args.init.*kaiming or torch.*'he'"):
        SmallCNN(1, 10, init="he")
