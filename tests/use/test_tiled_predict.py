"""Sliced prediction (use/tiled.py, `visiontrain predict --tile`): a detector runs on the tiles of
`visiontrain tile`'s grid and on the whole image, each tile's boxes move to the image's pixels, and
what several tiles saw of one object is one detection, its mask pasted at the image's size.

A stand-in detector (``Blobs``: every blob of pure white pixels is an object) makes the geometry
exact; the shared tiny Faster R-CNN and classifier checkpoints (tests/conftest.py) run the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from scipy import ndimage
from torch import nn

from procs import cli_here
from visiontrain.engine.protocols.task import Prediction
from visiontrain.use.inference import Detections, Predictor
from visiontrain.use.tiled import greedy_merge, predict_tiled


class Blobs:
    """A detector of white: each 8-connected blob of (255, 255, 255) pixels in the image it is given is
    an object of class 0, its box the blob's extent, its mask the blob, its score higher the more of
    it there is (a part of an object scores below the whole). It notes each image's size."""

    name, predicts, predict_threshold = "blobs", Prediction.BOXES, 0.5

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def predict(self, model: nn.Module, images: list[torch.Tensor], device: torch.device) -> list[dict]:
        out = []
        for image in images:
            self.seen.append(tuple(image.shape[-2:]))
            blobs, count = ndimage.label((image == 255).all(0).numpy(), structure=np.ones((3, 3)))
            masks = torch.from_numpy(blobs[None] == np.arange(1, count + 1)[:, None, None])
            boxes = [[float(s[1].start), float(s[0].start), float(s[1].stop), float(s[0].stop)]
                     for s in ndimage.find_objects(blobs)]
            area = masks.sum((1, 2)).float()
            out.append({"boxes": torch.tensor(boxes).reshape(-1, 4), "scores": area / (area + 100),
                        "labels": torch.zeros(count, dtype=torch.int64), "masks": masks})
        return out


@pytest.fixture
def blobs() -> Predictor:
    return Predictor(Blobs(), nn.Identity(), {"class_names": ["white"], "category_ids": [7]}, device="cpu")


def scene(height: int, width: int, *boxes: tuple[int, int, int, int]) -> torch.Tensor:
    """uint8 [3, H, W]: grey noise below 255, with each (x1, y1, x2, y2) painted white."""
    pixels = torch.from_numpy(np.random.default_rng(0).integers(0, 200, (3, height, width), dtype=np.uint8))
    for x1, y1, x2, y2 in boxes:
        pixels[:, y1:y2, x1:x2] = 255
    return pixels


def white(pixels: torch.Tensor) -> torch.Tensor:
    return (pixels == 255).all(0)


def test_a_box_found_in_a_tile_is_placed_in_the_image(blobs):
    """200 x 300 px in 128 px tiles a quarter overlapping: tiles start at x 0, 96, 172 and y 0, 72; the
    square at (250, 150) is in the last tile only, found there at (78, 78), reported at (250, 150)."""
    pixels = scene(200, 300, (250, 150, 270, 170))
    found = predict_tiled(blobs, pixels, 128, 0.25, whole_image=False)
    assert isinstance(found, Detections) and found.image_size == (200, 300)
    assert found.boxes.tolist() == [[250, 150, 270, 170]] and found.names == ["white"] and found.category_ids == [7]
    assert found.masks.shape == (1, 200, 300) and torch.equal(found.masks[0], white(pixels))
    assert sorted(blobs.task.seen) == [(128, 128)] * 6  # six tiles, none padded; no whole-image pass
    blobs.task.seen.clear()
    again = predict_tiled(blobs, pixels, 128, 0.25)  # the whole image too: the same object, once
    assert again.boxes.tolist() == found.boxes.tolist() and (200, 300) in blobs.task.seen


def test_one_object_seen_by_several_tiles_is_one_detection(blobs):
    """A square inside two tiles' overlap is found whole twice; a bar longer than a tile is found in
    three parts, none whole: each is one detection, the bar's box and mask the union of its parts."""
    pixels = scene(200, 300, (100, 20, 120, 40), (60, 150, 200, 160))
    plain = blobs(pixels)
    for whole_image in (False, True):
        found = predict_tiled(blobs, pixels, 128, 0.5, whole_image=whole_image)
        assert sorted(found.boxes.tolist()) == [[60, 150, 200, 160], [100, 20, 120, 40]]
        assert torch.equal(found.masks.any(0), white(pixels))
        if whole_image:  # the whole bar, seen in the whole image, leads its parts
            assert found.scores.tolist() == plain.scores.tolist()
    parts = predict_tiled(blobs, pixels, 128, 0.5, whole_image=False, match_threshold=1.01)  # nothing merged
    assert len(parts) > 2 * len(found)


def test_an_image_no_larger_than_a_tile_is_predicted_as_it_is(blobs):
    pixels = scene(100, 120, (10, 10, 30, 30), (12, 60, 40, 70))
    found = predict_tiled(blobs, pixels, 128)
    assert blobs.task.seen == [(100, 120)]
    want = blobs(pixels)
    assert found.boxes.tolist() == want.boxes.tolist() and torch.equal(found.masks, want.masks)


def test_greedy_merging_is_by_class_and_over_the_smaller_box():
    boxes = torch.tensor([[0, 0, 100, 100], [80, 0, 110, 20], [90, 90, 200, 200], [0, 0, 10, 10], [0, 0, 10, 10.]])
    scores, labels = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.95]), torch.tensor([0, 0, 0, 0, 1])
    # 1: 20x20 of its 30x20 inside 0 (2/3); 2: 10x10 of 110x110 (IoU and IoS small); 3 inside 0; 4 another class
    assert greedy_merge(boxes, scores, labels) == [[4], [0, 1, 3], [2]]
    assert greedy_merge(boxes, scores, labels, threshold=0.7) == [[4], [0, 3], [1], [2]]


def test_a_classifier_and_a_bad_tiling_are_refused(blobs):
    blobs.task.predicts = Prediction.CLASS_SCORES
    with pytest.raises(ValueError, match="tiled prediction applies to detectors; this model predicts classification"):
        predict_tiled(blobs, scene(10, 10), 8)
    with pytest.raises(ValueError, match="overlap: .* in \\[0, 1\\)"):
        predict_tiled(blobs, scene(10, 10), 8, 1.0)


def test_cli_predict_tile_writes_the_api_detections(rcnn_checkpoint, tmp_path):
    """`visiontrain predict --tile 64` on a validation image of the tiny Faster R-CNN's data (larger than
    a tile) writes what ``predict_tiled`` gives, boxes within the image."""
    detector = Predictor.load(rcnn_checkpoint, device="cpu")
    path = detector.task.build_data().val.records[0].path
    width, height = Image.open(path).size
    assert width > 64 and height > 64
    out = tmp_path / "out"
    proc = cli_here("predict", str(rcnn_checkpoint), path, "--out", str(out), "--threshold", "0", "--tile", "64",
                    "--tile-overlap", "0.25")
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads((out / "detections.json").read_text())
    api = predict_tiled(detector, path, 64, 0.25, threshold=0.0)
    assert len(written) == len(api) > 0
    for row, box in zip(written, api.boxes.tolist()):
        np.testing.assert_allclose(row["bbox"], [box[0], box[1], box[2] - box[0], box[3] - box[1]], atol=1e-3)
        assert 0 <= row["bbox"][0] and row["bbox"][0] + row["bbox"][2] <= width + 1e-3
        assert 0 <= row["bbox"][1] and row["bbox"][1] + row["bbox"][3] <= height + 1e-3
    assert Path(out / Path(path).with_suffix(".png").name).is_file()


def test_cli_tile_on_a_classifier_is_one_line(classify_checkpoint, tmp_path, capsys):
    from visiontrain.app.cli import main

    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "ok.png")
    assert main(["predict", str(classify_checkpoint), str(tmp_path / "ok.png"), "--out", str(tmp_path / "o"),
                 "--tile", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("visiontrain: error: --tile applies to detection checkpoints") and "Traceback" not in err
