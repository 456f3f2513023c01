"""The embedded detection datasets: fashion-mosaic (synthetic) and neon-trees (deepforest's NEON tiles)."""
from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools import mask as coco_mask

from visiontrain.data.datasets import fashion_mnist
from visiontrain.data.detection import embedded
from visiontrain.data.detection.embedded import (build_fashion_mosaic, build_neon_trees, paste_item, read_voc_boxes,
                                                 tile_boxes)

HAS_DEEPFOREST = importlib.util.find_spec("deepforest") is not None
needs_deepforest = pytest.mark.skipif(not HAS_DEEPFOREST, reason="deepforest not installed: "
                                      "pip install --no-deps deepforest==2.1.0 (scripts/setup.sh does it)")
SMALL = dict(train_images=20, val_images=8)


def fake_fashion(n: int = 40):
    """Train items have labels 0..4, test items 5..9: where a category comes from shows the split."""
    rng = np.random.default_rng(123)
    splits = []
    for offset in (0, 5):
        x = np.zeros((n, 1, 28, 28), np.uint8)
        for i in range(n):
            r0, c0 = rng.integers(0, 10, size=2)
            x[i, 0, r0:r0 + rng.integers(6, 18), c0:c0 + rng.integers(6, 18)] = rng.integers(100, 256)
        splits.append((torch.from_numpy(x), torch.arange(n) % 5 + offset))
    return lambda root=None, download=False: tuple(splits)


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(fashion_mnist, "load_fashion_mnist", fake_fashion())


def load(root: Path, split: str) -> dict:
    return json.loads((root / "annotations" / f"{split}.json").read_text())


def check_coco(root: Path, split: str, names: list[str], masks: bool = True) -> dict:
    """Valid COCO whose image sizes match the files, whose boxes lie inside their images and whose
    masks are the objects' visible pixels inside those boxes."""
    coco = load(root, split)
    assert coco["categories"] == [{"id": i + 1, "name": n} for i, n in enumerate(names)]
    images = {im["id"]: im for im in coco["images"]}
    assert len(images) == len(coco["images"])
    assert len({a["id"] for a in coco["annotations"]}) == len(coco["annotations"])
    for im in images.values():
        with Image.open(root / split / im["file_name"]) as f:
            assert f.size == (im["width"], im["height"])
    for a in coco["annotations"]:
        im = images[a["image_id"]]
        x, y, w, h = a["bbox"]
        assert w > 0 and h > 0 and x >= 0 and y >= 0 and x + w <= im["width"] and y + h <= im["height"]
        assert a["iscrowd"] == 0 and 1 <= a["category_id"] <= len(names)
        if not masks:  # neon-trees: boxes only
            assert a["area"] == w * h and "segmentation" not in a
            continue
        # the visible pixels as a compressed RLE: their count is the area, their tight box the bbox
        rle = a["segmentation"]
        assert rle["size"] == [im["height"], im["width"]] and a["area"] == coco_mask.area(rle) > 0
        assert coco_mask.toBbox(rle).tolist() == [x, y, w, h]
    return coco


def test_paste_item_box_is_the_tight_box_of_the_item(tmp_path):
    item = np.zeros((28, 28), np.uint8)
    item[5:20, 8:14] = 255                         # non-zero rows 5..19, cols 8..13
    canvas = np.zeros((100, 120, 3), np.uint8)
    assert paste_item(canvas, item, 30, 40, 1.0) == (38, 45, 44, 60)
    ys, xs = np.nonzero(canvas.any(2))
    assert (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) == (38, 45, 44, 60)

    canvas[:] = 0
    box = paste_item(canvas, item, 10, 20, 2.0, tint=(1.0, 0.7, 0.6))
    x1, y1, x2, y2 = box
    assert abs(x1 - 26) <= 1 and abs(y1 - 30) <= 1 and abs(x2 - 38) <= 1 and abs(y2 - 60) <= 1  # ~2x
    # re-derived from the saved image: the box is exactly the non-zero region
    Image.fromarray(canvas).save(tmp_path / "c.png")
    saved = np.asarray(Image.open(tmp_path / "c.png"))
    ys, xs = np.nonzero(saved.any(2))
    assert (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) == box
    with pytest.raises(ValueError, match="does not fit"):
        paste_item(canvas, item, 110, 0, 1.0)


def test_mosaic_boxes_are_tight_around_visible_items(tmp_path, fake, monkeypatch):
    # a black wall and floor: every non-zero pixel belongs to an item
    monkeypatch.setattr(embedded, "_texture", lambda rng, h, w: np.zeros((h, w, 3), np.uint8))
    monkeypatch.setattr(embedded, "_floor_texture", lambda rng, h, w: np.zeros((h, w, 3), np.uint8))
    root = build_fashion_mosaic(tmp_path, **SMALL, min_size=64, max_size=160)
    assert root.name == "fashion-mosaic-s0-20-8-400-64-160"
    for split in ("train", "val"):
        coco = check_coco(root, split, fashion_mnist.CLASS_NAMES)
        for im in coco["images"]:
            pix = np.asarray(Image.open(root / split / im["file_name"])).any(2)
            anns = [a for a in coco["annotations"] if a["image_id"] == im["id"]]
            assert 1 <= len(anns) <= 8
            covered = np.zeros_like(pix)
            for a in anns:
                x, y, w, h = a["bbox"]
                assert 64 <= im["width"] <= 160 and 64 <= im["height"] <= 160
                box = pix[y:y + h, x:x + w]
                covered[y:y + h, x:x + w] = True
                assert box[0].any() and box[-1].any() and box[:, 0].any() and box[:, -1].any()  # tight
            assert not (pix & ~covered).any()    # every item pixel is inside some box
            if len(anns) == 1:
                ys, xs = np.nonzero(pix)
                assert [xs.min(), ys.min(), np.ptp(xs) + 1, np.ptp(ys) + 1] == anns[0]["bbox"]
        # train items come from the (fake) train split, val items from the test split
        cats = {a["category_id"] for a in coco["annotations"]}
        assert cats <= ({1, 2, 3, 4, 5} if split == "train" else {6, 7, 8, 9, 10})


def test_mosaic_deterministic_cached_and_atomic(tmp_path, fake, monkeypatch, caplog):
    with caplog.at_level(logging.INFO, logger="visiontrain"):
        a = build_fashion_mosaic(tmp_path / "a", **SMALL)
    assert [r.message for r in caplog.records if "building fashion-mosaic" in r.message]
    b = build_fashion_mosaic(tmp_path / "b", **SMALL)
    c = build_fashion_mosaic(tmp_path / "c", **SMALL, seed=1)
    assert a.name == "fashion-mosaic-s0-20-8-400" and c.name == "fashion-mosaic-s1-20-8-400"
    for split in ("train", "val"):
        ja, jb = (r / "annotations" / f"{split}.json" for r in (a, b))
        assert ja.read_bytes() == jb.read_bytes()
        assert ja.read_bytes() != (c / "annotations" / f"{split}.json").read_bytes()
        assert (a / split / "000003.png").read_bytes() == (b / split / "000003.png").read_bytes()
    # reused: no rebuild, nothing rewritten
    mtime = (a / "annotations" / "train.json").stat().st_mtime_ns
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="visiontrain"):
        assert build_fashion_mosaic(tmp_path / "a", **SMALL) == a
    assert not caplog.records and (a / "annotations" / "train.json").stat().st_mtime_ns == mtime
    # a crash mid-build leaves neither the target nor a temporary dir
    calls = []

    def crash(*args, **kwargs):
        calls.append(1)
        if len(calls) > 5:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    real = embedded._mosaic
    monkeypatch.setattr(embedded, "_mosaic", crash)
    with pytest.raises(RuntimeError, match="boom"):
        build_fashion_mosaic(tmp_path / "d", **SMALL)
    assert list((tmp_path / "d").iterdir()) == []


def test_mosaic_from_real_fashion_mnist(tmp_path):
    try:
        fashion_mnist.load_fashion_mnist(root=None, download=False)
    except FileNotFoundError:
        pytest.skip("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
    root = build_fashion_mosaic(tmp_path, **SMALL)
    for split, n in (("train", 20), ("val", 8)):
        coco = check_coco(root, split, fashion_mnist.CLASS_NAMES)
        assert len(coco["images"]) == n and len(coco["annotations"]) >= n
        assert "Fashion-MNIST " + ("train" if split == "train" else "test") in coco["info"]["description"]
    read_back(root, 10)


def read_back(root: Path, num_classes: int) -> None:
    try:
        from visiontrain.data.detection.coco import read_coco
    except ImportError:
        pytest.skip("visiontrain.data.detection.coco (read_coco) is not written yet")
    for split in ("train", "val"):
        ds = read_coco(str(root / "annotations" / f"{split}.json"), str(root / split))
        assert len(ds) == len(load(root, split)["images"]) and ds.num_classes == num_classes
        image, target = ds[0]
        h, w = image.shape[-2:]
        assert image.dtype == torch.uint8 and image.shape[0] == 3
        assert target["boxes"].shape[1] == 4 and len(target["labels"]) == len(target["boxes"]) > 0
        assert tuple(target["orig_size"].tolist()) == (h, w)
        assert (target["boxes"][:, 2:] <= torch.tensor([w, h])).all()


def test_tile_boxes_clipping_rule():
    boxes = np.array([[10, 10, 50, 50],      # inside
                      [380, 0, 420, 40],     # half in tile 0: kept (exactly 50%)
                      [390, 0, 430, 40],     # 25% in tile 0: dropped
                      [399, 100, 430, 160],  # 1 px wide in tile 0: dropped
                      [0, 380, 20, 450]], float)  # 20 of 70 rows in tile 0: dropped
    out = tile_boxes(boxes, 0, 0, 400)
    assert out.tolist() == [[10, 10, 50, 50], [380, 0, 400, 40]]
    assert tile_boxes(boxes, 400, 0, 400).tolist() == [[0, 0, 20, 40], [0, 0, 30, 40], [0, 100, 30, 160]]


@needs_deepforest
def test_neon_trees(tmp_path):
    data = embedded.deepforest_data_dir()
    source = {n: read_voc_boxes(data / f"{n}.xml") for n in embedded.NEON_IMAGES}
    assert sum(len(b) for b in source.values()) == 61 + 37 + 279 + 574
    root = build_neon_trees(tmp_path)
    assert root.name == "neon-trees-t400-s0-v0.25"
    cocos = {s: check_coco(root, s, ["Tree"], masks=False) for s in ("train", "val")}
    names = {s: [im["file_name"] for im in c["images"]] for s, c in cocos.items()}
    assert not set(names["train"]) & set(names["val"])
    assert len(names["train"]) + len(names["val"]) == 1 + 1 + 4 * 3 + 6 * 7   # 56 tiles, none dropped
    assert len(names["val"]) == 14 and len(cocos["val"]["annotations"]) > 0
    assert all(im["width"] == im["height"] == 400 for c in cocos.values() for im in c["images"])
    total = sum(len(c["annotations"]) for c in cocos.values())
    assert 0.9 * 951 <= total <= 951
    # a tile's pixels are the source image's (padded with black past the image's edge)
    stem, x0, y0 = "2019_YELL_2_541000_4977000_image_crop", 1200, 800
    split = "train" if f"{stem}_x{x0}_y{y0}.png" in names["train"] else "val"
    tile = np.asarray(Image.open(root / split / f"{stem}_x{x0}_y{y0}.png"))
    src = np.asarray(Image.open(data / f"{stem}.png").convert("RGB"))
    assert (tile[:235, :49] == src[800:, 1200:]).all() and not tile[235:].any() and not tile[:, 49:].any()
    # deterministic split; another seed gives another one
    again = build_neon_trees(tmp_path / "again")
    assert (again / "annotations" / "val.json").read_bytes() == (root / "annotations" / "val.json").read_bytes()
    other = load(build_neon_trees(tmp_path, seed=1), "val")
    assert {im["file_name"] for im in other["images"]} != set(names["val"])
    read_back(root, 1)


def test_neon_trees_without_deepforest(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepforest" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps deepforest==2.1.0"):
        build_neon_trees(tmp_path)
