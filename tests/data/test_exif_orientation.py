"""Photos stored turned with an EXIF orientation tag (every phone photo) are read upright, as image
viewers and annotation tools show them: header sizes, decoded pixels, the detection readers' boxes
in all three layouts, image folders, the decoded-image cache, ``Predictor`` and `visiontrain predict`.

Each fixture is written by ``dataset_trees.save_photo``: the upright image transposed, with the tag
that turns it back, so the upright image is known; its upright copy is saved losslessly (PNG) from
PIL's ``exif_transpose`` of the decoded JPEG, so both files hold the same upright pixels."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from dataset_trees import (ALL_ORIENTATIONS, build_coco, build_image_folder, build_voc, build_yolo, save_photo,
                           upright_copy)
from procs import cli_here
from visiontrain.core import config as C
from visiontrain.data.detection.images import BadAnnotationError, image_size
from visiontrain.data.images import image_tensor, open_rgb
from visiontrain.use.inference import Predictor
from visiontrain.tasks import build_task

BUILD = {"coco": build_coco, "yolo": build_yolo, "voc": build_voc}


def picture(seed: int) -> Image.Image:
    """128 x 96: a gradient (no flip or turn of it is the same image) under three filled rectangles."""
    from PIL import ImageDraw

    ys, xs = np.mgrid[0:96, 0:128]
    img = Image.fromarray(np.stack([xs * 2, ys * 2, np.full_like(xs, 90)], -1).astype(np.uint8))
    draw, rng = ImageDraw.Draw(img), np.random.default_rng(seed)
    for _ in range(3):
        x, y = int(rng.integers(0, 96)), int(rng.integers(0, 64))
        draw.rectangle([x, y, x + 24, y + 24], fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    return img


def test_header_sizes_are_upright_and_read_without_decoding(tmp_path, monkeypatch):
    img = Image.new("RGB", (128, 96), (200, 30, 30))
    exif = Image.Exif()
    exif[0x0112] = 6
    save_photo(img, tmp_path / "photo.jpg", 6)  # stored 96 x 128
    img.transpose(Image.Transpose.ROTATE_90).save(tmp_path / "photo.png", exif=exif)  # PNG's eXIf chunk
    save_photo(img, tmp_path / "flipped.jpg", 3)  # a half turn keeps the sides
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("the header read decoded pixels"))
    assert image_size(str(tmp_path / "photo.jpg")) == (96, 128)  # (height, width) upright
    assert image_size(str(tmp_path / "photo.png")) == (96, 128)
    assert image_size(str(tmp_path / "flipped.jpg")) == (96, 128)


@pytest.mark.parametrize("orientation", range(2, 9))
def test_every_orientation_decodes_to_the_upright_image(orientation, tmp_path):
    img = picture(3)
    save_photo(img, tmp_path / "photo.jpg", orientation)
    upright = np.asarray(img, dtype=np.int16)
    decoded = np.asarray(open_rgb(str(tmp_path / "photo.jpg")), dtype=np.int16)
    assert decoded.shape == upright.shape and np.abs(decoded - upright).mean() < 3  # JPEG's loss only
    as_tensor = image_tensor(str(tmp_path / "photo.jpg"), 3)
    assert torch.equal(as_tensor, torch.from_numpy(decoded.astype(np.uint8)).permute(2, 0, 1))
    given = Image.open(tmp_path / "photo.jpg")
    stored = np.asarray(given).copy()
    assert torch.equal(image_tensor(given, 3), as_tensor)  # a PIL image: the same, upright
    assert np.array_equal(np.asarray(given), stored)  # and the caller's image is left as it was


def test_an_image_folder_reads_photos_upright(tmp_path):
    from visiontrain.data.datasets.image_folder import build_image_folder as folder_datasets
    from visiontrain.data.datasets.sources import ClassificationReader

    build_image_folder(tmp_path)
    photo = tmp_path / "train" / "circle" / "photo.jpg"
    img = picture(5)  # not square: a turn changes the sides
    save_photo(img, photo, 8)
    copy = upright_copy(photo)
    train, _, _, _ = folder_datasets(ClassificationReader(root=str(tmp_path), image_size=32))
    index = {Path(p).name: i for i, (p, _) in enumerate(train.samples)}
    assert train.raw_item(index["photo.jpg"])[0].size == (128, 96)
    assert torch.equal(train[index["photo.jpg"]][0], train[index[copy.name]][0])


def boxes_on_objects(image: torch.Tensor, boxes: torch.Tensor) -> None:
    """Each box lies on an object (the scenes' objects are the only pixels with red above 150) and
    every object pixel lies in a box: a box placed in another frame of the image lands on background."""
    from visiontrain.data.normalize import IMAGENET_MEAN, IMAGENET_STD

    red = image[0].float() / 255 if image.dtype == torch.uint8 else image[0] * IMAGENET_STD[0] + IMAGENET_MEAN[0]
    objects = red > 150 / 255
    covered = torch.zeros_like(objects)
    for x1, y1, x2, y2 in boxes.tolist():
        inner = objects[int(y1) + 2:int(y2) - 1, int(x1) + 2:int(x2) - 1]  # resampling blurs the edges
        share = float(inner.float().mean()) if inner.numel() else 0.0
        assert share > 0.9, f"box {[x1, y1, x2, y2]}: {share:.0%} of it on its object"
        covered[max(int(y1) - 1, 0):int(y2) + 2, max(int(x1) - 1, 0):int(x2) + 2] = True
    assert objects.any() and not (objects & ~covered).any()


@pytest.mark.parametrize("layout", ["coco", "yolo", "voc"])
def test_a_detector_trains_on_rotated_photos_with_its_boxes_on_the_objects(layout, tmp_path):
    """The training set's eight photos take all eight orientations; their annotations are upright.
    Every batch of the training loader (the first as `visiontrain preview` draws it) has each box on
    its object's pixels; then two steps train."""
    from visiontrain.engine.loop.trainer import Trainer

    BUILD[layout](tmp_path / "data", ALL_ORIENTATIONS)
    splits = {"coco": ["data.train_split=train2017", "data.val_split=val2017"],
              "voc": ["data.train_split=trainval", "data.val_split=test"]}.get(layout, [])
    cfg = C.load_config("detect-faster-rcnn", [
        f"data.name={layout}", f"data.root={tmp_path / 'data'}", *splits,  # the layout under test
        "data.batch_size=4", "task.train_scales=[96]", "task.val_size=96", "task.max_size=128", "trainer.max_steps=2",
        "task.fpn_channels=32", "task.representation_size=64",  # a smaller network: the subject is the data
        "data.num_workers=0"])  # loaded in-process: the subject is the boxes, not the workers
    trainer = Trainer(cfg, build_task(cfg), tmp_path / "run")
    source = trainer.run.source
    try:
        batches = [source.collate(source.first_items()), *source.batches(0)]
    finally:
        source.close()
    assert sum(len(targets) for _, _, targets in batches[1:]) == 8
    for images, _, targets in batches:
        for image, target in zip(images, targets):
            assert len(target["boxes"]) > 0
            boxes_on_objects(image, target["boxes"])
    trainer.fit()
    assert trainer.step == 2


@pytest.mark.parametrize("layout", ["coco", "voc"])
def test_a_size_written_for_the_stored_frame_is_refused_saying_why(layout, tmp_path):
    """An annotation tool that ignored the tag wrote the stored size (96 x 128) for a photo that is
    128 x 96 upright: the message says how the file is stored, and which tag turns it."""
    from visiontrain.data.detection.coco import read_coco
    from visiontrain.data.detection.voc import read_voc

    BUILD[layout](tmp_path, [6])
    if layout == "coco":
        ann = tmp_path / "annotations" / "instances_train2017.json"
        data = json.loads(ann.read_text())
        data["images"][0].update(width=96, height=128)
        ann.write_text(json.dumps(data))
        read = lambda: read_coco(str(ann), str(tmp_path / "train2017"))  # noqa: E731
    else:
        xml = tmp_path / "Annotations" / "000000.xml"
        xml.write_text(xml.read_text().replace("<width>128</width><height>96</height>",
                                               "<width>96</width><height>128</height>"))
        read = lambda: read_voc(str(tmp_path), "trainval")  # noqa: E731
    with pytest.raises(BadAnnotationError, match=r"says 96x128 \(WxH\), the file is 128x96 upright, as image viewers "
                                                 r"show it \(stored 96x128 with an EXIF orientation tag"):
        read()


def test_the_decoded_image_cache_keeps_photos_upright(tmp_path):
    from visiontrain.data.detection.yolo import read_yolo
    from visiontrain.data.image_cache import ImageCache

    build_yolo(tmp_path, ALL_ORIENTATIONS)
    plain = read_yolo(str(tmp_path), "train")
    cached = plain.with_cache(ImageCache.create(str(tmp_path), plain.image_shapes()))
    for i in range(len(plain)):
        first, _ = cached.load(i)   # decoded, then kept
        again, target = cached.load(i)  # read back from the cache
        assert torch.equal(first, again) and torch.equal(first, plain.load(i)[0])
        assert tuple(first.shape[-2:]) == (96, 128)
        boxes_on_objects(first.as_subclass(torch.Tensor), target["boxes"])
    assert cached.cache.filled() == len(plain)


def test_a_file_whose_size_changed_since_it_was_read_is_named(tmp_path):
    from visiontrain.data.detection.yolo import read_yolo

    build_yolo(tmp_path)
    ds = read_yolo(str(tmp_path), "train")
    Image.new("RGB", (96, 128)).save(ds.records[0].path, format="JPEG")  # the boxes no longer fit it
    with pytest.raises(BadAnnotationError, match=r"000000\.jpg: decoded as 96x128 \(WxH\), but its header said "
                                                 r"128x96"):
        ds.load(0)


@pytest.fixture(scope="module")
def photo_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A turned, non-square JPEG with its orientation tag (6) and its upright copy."""
    folder = tmp_path_factory.mktemp("photos")
    img = picture(1)
    save_photo(img, folder / "photo.jpg", 6)
    return folder / "photo.jpg", upright_copy(folder / "photo.jpg")


def test_predictor_and_predict_give_boxes_in_the_upright_frame(rcnn_checkpoint, photo_pair, tmp_path):
    photo, upright = photo_pair
    detector = Predictor.load(rcnn_checkpoint, device="cpu")
    want = detector(str(upright), threshold=0.0)
    assert len(want) > 0 and want.image_size == (96, 128)
    for given in (str(photo), Image.open(photo)):
        got = detector(given, threshold=0.0)
        assert got.image_size == want.image_size and got.labels.tolist() == want.labels.tolist()
        torch.testing.assert_close(got.boxes, want.boxes, atol=0, rtol=0)

    out = tmp_path / "out"
    proc = cli_here("predict", str(rcnn_checkpoint), str(photo), str(upright), "--out", str(out), "--threshold", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "detections.json").read_text())
    by_image = [[(r["category_id"], r["bbox"]) for r in rows if r["image_id"] == n] for n in (1, 2)]
    assert by_image[0] and by_image[0] == by_image[1]
    for drawing in {r["drawn"] for r in rows}:
        assert Image.open(out / drawing).size == (128, 96)  # drawn on the upright image


def test_a_classifier_and_its_sheet_see_photos_upright(classify_checkpoint, photo_pair, tmp_path):
    photo, upright = photo_pair
    out = tmp_path / "out"
    proc = cli_here("predict", str(classify_checkpoint), str(photo), str(upright), "--out", str(out), "--sheet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "predictions.json").read_text())
    assert rows[0]["top"] == rows[1]["top"]
    classifier = Predictor.load(classify_checkpoint, device="cpu")
    assert torch.equal(classifier.read(str(photo)), classifier.read(str(upright)))  # what the sheet draws
