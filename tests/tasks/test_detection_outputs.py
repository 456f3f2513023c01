"""What a detector hands a user: no degenerate box from any post-processing (YOLOv3, DETR, Faster
R-CNN), one drawing per input in `visiontrain predict` (inputs of the same name from two directories
do not overwrite each other) with detections.json naming each input, and no warning for an image
with nothing detected. Raw outputs are built by hand; predict runs in-process on an untrained tiny
YOLOv3 through the Python API (the CLI only parses arguments around ``predict_images``)."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn

from visiontrain.core import config as C
from visiontrain.use.inference import Predictor
from visiontrain.use.predict import predict_images
from visiontrain.tasks import build_task

# YOLOv3 on a 64 x 64 input: 3 anchors per stride 8 / 16 / 32 (as tests/tasks/test_yolo.py), 3 classes
ANCHORS = torch.tensor([[8., 8.], [6., 14.], [14., 6.], [20., 20.], [14., 34.], [34., 14.],
                        [48., 48.], [36., 80.], [80., 36.]])
SIZES = [(8, 8), (4, 4), (2, 2)]
TINY_YOLO = ["task.backbone=darknet21", "task.backbone_width=0.125", "task.neck_channels=[16,16,8]",
             "task.val_size=64"]
INFO = {"num_classes": 2, "class_names": ["a", "b"], "category_ids": [1, 2]}


def assert_no_degenerate(boxes: torch.Tensor, h: int, w: int) -> None:
    assert boxes.numel() == 0 or ((boxes[:, 2:] - boxes[:, :2]).min() > 0), boxes
    assert boxes.numel() == 0 or (boxes[:, :2].min() >= 0 and boxes[:, 2].max() <= w and boxes[:, 3].max() <= h), boxes


def yolo_cell(raw: list[torch.Tensor], gx: int, gy: int, cls: int, obj: float, scale: float = 0.0,
              anchor: int = 0) -> None:
    """One stride-8 prediction: centre in cell (gx, gy) (offset 0.5), size anchor x exp(scale)."""
    base = anchor * 8
    raw[0][0, base:base + 2, gy, gx] = 0.0
    raw[0][0, base + 2:base + 4, gy, gx] = scale
    raw[0][0, base + 4, gy, gx] = obj
    raw[0][0, base + 5 + cls, gy, gx] = 20.0


def test_yolo_drops_degenerate_boxes_before_nms_and_the_max_detections_cut():
    from visiontrain.models.yolo import postprocess

    raw = [torch.full((1, 3 * 8, h, w), -20.0) for h, w in SIZES]
    # the 64 x 64 input holds a 32 x 48 (w x h) letterboxed image of an original 64 x 96: x > 32 and
    # y > 48 are padding. Three predictions scoring ~1.0 that clip to nothing in the original ...
    yolo_cell(raw, gx=6, gy=1, cls=0, obj=20.0)             # in the right padding: zero width
    yolo_cell(raw, gx=1, gy=7, cls=1, obj=20.0)             # in the bottom padding: zero height
    yolo_cell(raw, gx=1, gy=1, cls=2, obj=20.0, scale=-20)  # collapsed size: ~1e-8 px
    yolo_cell(raw, gx=2, gy=3, cls=2, obj=2.0, anchor=1)    # ... and a real box scoring ~0.88
    valid_hw, orig = torch.tensor([[48, 32]]), torch.tensor([[96, 64]])
    (det,) = postprocess(raw, ANCHORS, 3, valid_hw, orig, max_detections=1)
    assert det["labels"].tolist() == [2] and 0.8 < float(det["scores"][0]) < 0.9
    torch.testing.assert_close(det["boxes"], torch.tensor([[34., 42., 46., 70.]]))
    (every,) = postprocess(raw, ANCHORS, 3, valid_hw, orig, conf_threshold=0.0, pre_nms_topk=1)
    assert_no_degenerate(every["boxes"], 96, 64)
    # the one candidate going into NMS is the real box, not one of the three scoring higher
    torch.testing.assert_close(every["boxes"], torch.tensor([[34., 42., 46., 70.]]))


def test_detr_drops_queries_whose_box_is_degenerate():
    from visiontrain.models.detr import postprocess

    logits = torch.full((1, 4, 3), -10.0)
    logits[0, :3, 0] = 10.0  # three confident queries with degenerate boxes
    logits[0, 3, 1:] = torch.tensor([2.0, 1.0])  # a real one, less confident (~0.73)
    boxes = torch.tensor([[[0.5, 0.5, 0.0, 0.5],      # zero width
                           [0.5, 0.5, 0.3, 0.0],      # zero height
                           [0.5, 0.5, 1e-6, 0.5],     # 2e-4 px wide
                           [0.1, 0.5, 0.4, 0.2]]])    # reaches out of the left edge: clipped there
    (res,) = postprocess({"pred_logits": logits, "pred_boxes": boxes}, torch.tensor([[100, 200]]))
    assert res["labels"].tolist() == [1] and res["scores"].shape == (1,) and 0.7 < float(res["scores"][0]) < 0.75
    torch.testing.assert_close(res["boxes"], torch.tensor([[0.0, 40.0, 60.0, 60.0]]))


class _Fixed(nn.Module):
    """Stands in for a Faster R-CNN part: returns what it was given, whatever its input."""

    def __init__(self, *outputs: object) -> None:
        super().__init__()
        self.outputs = outputs

    def forward(self, *args: object) -> object:
        return self.outputs


def test_faster_rcnn_emits_no_degenerate_box_after_mapping_to_the_original():
    """torchvision's RoI heads clip to the prepared image and drop boxes under 1e-2 px before NMS
    and the per-image cut; the task's mapping to the original size only scales by a positive
    factor. Proposals and head outputs are fixed by hand; everything after them is the real code."""
    cfg = C.load_config("detect-faster-rcnn", ["task.backbone=resnet18", "task.fpn_channels=16",
                                               "task.representation_size=16", "task.detections_per_img=1"])
    task = build_task(cfg)
    model = task.build_model({"num_classes": 3}).eval()
    proposals = torch.tensor([[40., 40., 40., 80.],     # zero width, confident
                              [130., 10., 150., 50.],   # right of the 128 x 128 image: clips to zero width
                              [10., 10., 60., 60.]])    # real, less confident
    logits = torch.tensor([[0., 10., 0., 0.], [0., 0., 10., 0.], [0., 0., 0., 3.]])
    model.rpn = _Fixed([proposals], {})
    model.roi_heads.box_predictor = _Fixed(logits, torch.zeros(3, 4 * 4))
    images, mask = torch.zeros(1, 3, 128, 128), torch.zeros(1, 128, 128, dtype=torch.bool)
    with torch.no_grad():
        (det,) = task.predict_batch(model, images, mask, torch.tensor([[64, 64]]))
        model.roi_heads.detections_per_img = 100
        (every,) = task.predict_batch(model, images, mask, torch.tensor([[64, 64]]))
    assert det["labels"].tolist() == [2]
    torch.testing.assert_close(det["boxes"], torch.tensor([[5., 5., 30., 30.]]))
    assert_no_degenerate(every["boxes"], 64, 64)


def test_output_names_are_unique_and_keep_the_inputs_tree(tmp_path):
    from visiontrain.use.predict import output_names

    d = str(tmp_path)
    assert output_names([f"{d}/x/p.jpg", f"{d}/x/q.png"]) == [Path("p.png"), Path("q.png")]  # as before
    assert output_names([f"{d}/a/img.png", f"{d}/b/c/img.png"]) == [Path("a/img.png"), Path("b/c/img.png")]
    assert output_names([f"{d}/x.jpg", f"{d}/x.png", f"{d}/x.jpg"]) == [Path("x.png"), Path("x-2.png"),
                                                                        Path("x-3.png")]


@pytest.fixture(scope="module")
def tiny_yolo():
    """An untrained tiny YOLOv3 (what predict gets from a restored checkpoint)."""
    task = build_task(C.load_config("detect-yolov3", TINY_YOLO + ["task.conf_threshold=0"]))
    return task, task.build_model(INFO)


def test_predict_writes_one_drawing_per_input_and_names_inputs_in_the_json(tiny_yolo, tmp_path):
    task, model = tiny_yolo
    images = [tmp_path / "a" / "img.png", tmp_path / "b" / "img.png"]
    for path, size in zip(images, [(40, 30), (50, 20)]):
        path.parent.mkdir()
        Image.new("RGB", size, (90, 120, 30)).save(path)
    out = tmp_path / "out"
    count = predict_images(Predictor(task, model, INFO, device="cpu"), [str(p) for p in images], out,
                           score_threshold=0.0)
    assert Image.open(out / "a" / "img.png").size == (40, 30)
    assert Image.open(out / "b" / "img.png").size == (50, 20)
    dets = json.loads((out / "detections.json").read_text())
    assert len(dets) == count and {d["image_id"] for d in dets} == {1, 2}
    for d in dets:
        assert d["file_name"] == str(images[d["image_id"] - 1])
        assert d["drawn"] == ["a/img.png", "b/img.png"][d["image_id"] - 1]


def test_predict_with_nothing_detected_warns_nothing(tiny_yolo, tmp_path):
    task, model = tiny_yolo
    Image.new("RGB", (40, 30), (10, 20, 30)).save(tmp_path / "empty.png")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        count = predict_images(Predictor(task, model, INFO, device="cpu"), [str(tmp_path / "empty.png")],
                               tmp_path / "out", score_threshold=1.1)
    assert count == 0 and (tmp_path / "out" / "empty.png").exists()
    assert not caught, [str(w.message) for w in caught]
