"""Using a Mask R-CNN checkpoint: ``Predictor`` returns masks at the input's size, `visiontrain
predict` draws them and writes them as RLE, the ONNX export carries them with a recipe that
the torch-free ONNX runner (visiontrain.use.onnx_runner) follows to the Python model's very masks, and `validate
--split test` gives mask AP. One tiny checkpoint, trained once, serves every test."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from detection_helpers import vt
from visiontrain.data.detection.masks import decode
from visiontrain.use.inference import Detections, Predictor


@pytest.fixture(scope="module")
def mask_run(tmp_path_factory) -> Path:
    """segment-mask-rcnn as shipped, two steps on 16 images, evaluated on 8: what is done with a
    checkpoint is the subject, not what it learnt."""
    run = tmp_path_factory.mktemp("mask") / "run"
    # task.box_score_thresh=0: a two-step model scores most boxes below the recipe's 0.05, and the
    # tests need detections (and masks) on landscape and portrait images alike
    proc = vt("fit", "segment-mask-rcnn", "trainer.max_steps=2", "data.limit_train=16", "data.limit_val=8",
              "task.box_score_thresh=0.0", "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def predictor(mask_run) -> Predictor:
    return Predictor.load(mask_run, device="cpu")


@pytest.fixture(scope="module")
def val_paths(predictor) -> list[str]:
    """The first six validation images (landscape and portrait among them), at their own sizes."""
    return [r.path for r in predictor.task.build_data().val.records[:6]]


def decoded(segmentation: dict) -> np.ndarray:
    """A COCO compressed RLE (``{"size", "counts": str}``) as a bool [H, W] mask, by pycocotools (through
    ``masks.decode``, which filters its NumPy 2 warning)."""
    return decode([segmentation["counts"]], *segmentation["size"])[0].astype(bool)


def test_predictor_masks_follow_the_boxes_and_are_those_of_evaluation(predictor, val_paths):
    """Bool masks [N, H, W] at each input's own size, in the boxes' order and under the same score
    threshold; equal to what ``predict_batch`` gives on the validation set's prepared item (the
    evaluation's path); ``to_dict`` writes each as the RLE that decodes to it."""
    from visiontrain.tasks.rcnn import collate_with_sizes

    val = predictor.task.build_data().val
    results = predictor(val_paths, threshold=0.0)
    assert sum(map(len, results)) > 0
    for i, result in enumerate(results):
        h, w = val.records[i].height, val.records[i].width
        assert isinstance(result, Detections) and result.image_size == (h, w)
        assert result.masks.dtype == torch.bool and tuple(result.masks.shape) == (len(result), h, w)
        images, mask, targets = collate_with_sizes([val[i]])
        with torch.no_grad():
            (want,) = predictor.task.predict_batch(predictor.model, images, mask, targets[0]["orig_size"][None])
        order = want["scores"].argsort(descending=True, stable=True)
        assert torch.equal(result.masks, want["masks"][order])
        as_dict = result.to_dict()["detections"]
        assert all(d["segmentation"]["size"] == [h, w] and isinstance(d["segmentation"]["counts"], str)
                   for d in as_dict)
        assert all(np.array_equal(decoded(d["segmentation"]), m.numpy()) for d, m in zip(as_dict, result.masks))
    most, full = max(enumerate(results), key=lambda r: len(r[1]))
    cut = float(full.scores[len(full) // 2])
    strict = predictor(val_paths[most], threshold=cut)
    assert 0 < len(strict) < len(full) and torch.equal(strict.masks, full.masks[:len(strict)])


def test_a_box_detector_gives_no_masks():
    from small_detectors import faster_rcnn

    torch.manual_seed(0)
    task, model, info = faster_rcnn()
    image = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (3, 96, 128), dtype=np.uint8))
    result = Predictor(task, model, info, device="cpu")(image, threshold=0.0)
    assert len(result) > 0 and result.masks is None
    assert all("segmentation" not in d for d in result.to_dict()["detections"])


def test_predict_draws_the_masks_and_writes_them_as_rle(predictor, val_paths, tmp_path):
    """detections.json: each result's ``segmentation`` is the Predictor's mask; the drawing: the
    boxes as before, and under them each mask half-way between the image and its class's colour."""
    from torchvision.utils import draw_bounding_boxes

    from visiontrain.evaluation.previews import PALETTE
    from visiontrain.use.predict import MASK_ALPHA, drawn_detections, predict_images

    out = tmp_path / "out"
    count = predict_images(predictor, val_paths, out, score_threshold=0.0)
    written = json.loads((out / "detections.json").read_text())
    results = predictor(val_paths, threshold=0.0)
    assert count == len(written) == sum(map(len, results)) > 0
    masks = [m for r in results for m in r.masks.numpy()]
    assert all(np.array_equal(decoded(d["segmentation"]), m) for d, m in zip(written, masks))

    image_id, result = max(enumerate(results), key=lambda r: int(r[1].masks.sum()))
    pixels = predictor.read(val_paths[image_id])
    drawn = torch.from_numpy(np.array(Image.open(out / written[sum(map(len, results[:image_id]))]["drawn"])))
    assert torch.equal(drawn.permute(2, 0, 1), drawn_detections(pixels, result))
    # the blend, on the best detection alone: a two-step model's masks fill their boxes, and at threshold 0
    # its boxes overlap everywhere, so no pixel of the whole drawing is one mask's alone
    best = Detections(result.boxes[:1], result.scores[:1], result.labels[:1], result.names[:1],
                      result.category_ids[:1], result.image_size, result.masks[:1])
    drawn = drawn_detections(pixels, best)
    boxes_only = draw_bounding_boxes(pixels, best.boxes, colors="red", width=2,
                                     labels=[f"{n} {float(s):.2f}" for n, s in zip(best.names, best.scores)])
    untouched = (boxes_only == pixels).all(0)  # no box, no caption
    mask = best.masks[0]
    assert torch.equal(drawn[:, untouched & ~mask], pixels[:, untouched & ~mask])
    alone = mask & untouched
    colour = torch.tensor(Image.new("RGB", (1, 1), PALETTE[int(best.labels[0]) % len(PALETTE)]).getpixel((0, 0)))
    blend = pixels[:, alone] * (1 - MASK_ALPHA) + colour[:, None] * MASK_ALPHA
    assert int(alone.sum()) > 0 and ((drawn[:, alone] - blend).abs() <= 1).all()


@pytest.fixture(scope="module")
def mask_onnx(mask_run, tmp_path_factory) -> dict:
    from visiontrain.use.export import export_checkpoint

    return export_checkpoint(mask_run, "onnx", tmp_path_factory.mktemp("onnx") / "masks.onnx")


def test_onnx_export_outputs_the_masks_and_says_how_to_paste_them(mask_onnx, predictor):
    from small_detectors import onnx_metadata

    t = predictor.task.cfg.task
    assert mask_onnx["outputs"] == ["boxes", "labels", "scores", "masks"]
    assert mask_onnx["dynamic_axes"]["image"] == {2: "height", 3: "width"}
    assert mask_onnx["dynamic_axes"]["masks"] == {0: "detections"}
    first, second = (shape["image"] for shape in mask_onnx["checked_inputs"])
    assert first[2] / first[3] != second[2] / second[3]  # two aspect ratios run in onnxruntime
    meta = onnx_metadata(mask_onnx["path"])
    assert meta["task"] == "mask_rcnn" and meta["mask_threshold"] == t.mask_threshold
    assert "grid_sample with align_corners=false" in meta["mask_paste"] and "masks [N, 1, M, M]" in meta["output"]


def same_detections(got: list[dict], want: Detections) -> list[int]:
    """For each of the Predictor's detections, the index of onnxruntime's that is the same one: the
    same class, the nearest box and score. With a threshold of 0 a two-step model gives scores a
    float rounding apart, which the two runtimes may rank either way (seen on an AVX2-only CPU)."""
    from scipy.optimize import linear_sum_assignment

    boxes = np.reshape([d["box"] for d in got], (-1, 4))
    cost = np.abs(boxes[None] - want.boxes.numpy()[:, None]).sum(-1)
    cost += 1e3 * np.abs(np.array([d["score"] for d in got])[None] - want.scores.numpy()[:, None])
    cost += 1e6 * (np.array([d["class_id"] for d in got])[None] != want.labels.numpy()[:, None])
    rows, cols = linear_sum_assignment(cost)
    return cols[np.argsort(rows)].tolist()


def test_the_onnx_runner_s_mask_paste_gives_the_predictor_masks(mask_onnx, predictor, val_paths,
                                                                             tmp_path):
    """The torch-free ONNX runner (numpy: the metadata's mask_paste) on a landscape and
    a portrait image that need no resize: the Predictor's boxes, scores and masks."""
    from small_detectors import run_onnx_runner_standalone

    val_size = predictor.task.cfg.task.val_size
    shapes = set()
    for n, path in enumerate(val_paths):
        image = Image.open(path).convert("RGB")
        scale = val_size / min(image.size)
        image = image.resize((round(image.width * scale), round(image.height * scale)), Image.BILINEAR)
        image.save(tmp_path / f"{n}.png")
        (line,) = run_onnx_runner_standalone(tmp_path, mask_onnx["path"], tmp_path / f"{n}.png", "--threshold", "0",
                                             "--masks", tmp_path / "masks")
        got, masks = line["detections"], np.load(line["masks_file"])
        assert line["masks_file"] == str(tmp_path / "masks" / f"{n}.npy")
        want = predictor(str(tmp_path / f"{n}.png"), threshold=0.0)
        assert len(got) == len(want)
        order = same_detections(got, want)  # ties in score may come in either order
        got, masks = [got[k] for k in order], masks[order]
        assert [d["class_id"] for d in got] == want.labels.tolist()
        # boxes in pixels, the script's rounded to 0.01: apart by at most 0.0062 px on AVX2 kernels and
        # 0.042 px on ATen's default (scalar) ones, against onnxruntime's own (tests/support/tolerance_log.py)
        np.testing.assert_allclose(np.reshape([d["box"] for d in got], (-1, 4)), want.boxes.numpy(), atol=0.1)
        # scores (probabilities near 0.01 of this two-step model): apart by 5.1e-6 on AVX2 kernels, 2.8e-5
        # on the default ones
        np.testing.assert_allclose([d["score"] for d in got], want.scores.numpy(), atol=1e-4)
        # The boxes and probabilities agree to float rounding, not exactly, and the paste samples each
        # mask at its box's exact corners; this two-step model's probabilities sit near the threshold
        # everywhere, so edge pixels flip, a few in a hundred (the paste itself, exactly:
        # test_the_runner_s_paste_is_paste_masks)
        want_masks = want.masks.numpy()
        differ, union = (masks != want_masks).sum((1, 2)), (masks | want_masks).sum((1, 2))
        assert masks.dtype == bool and masks.shape == want_masks.shape and differ.sum() <= 0.03 * union.sum()
        assert [d["mask_area"] for d in got] == masks.sum((1, 2)).tolist()
        if len(want) and want.masks.any():
            shapes.add(image.width > image.height)
    assert shapes == {True, False}, "a landscape and a portrait image with masks"


def test_the_runner_s_paste_is_paste_masks(tmp_path):
    """The ONNX runner's numpy paste (the metadata's mask_paste in code) gives paste_masks'
    masks pixel for pixel: boxes inside, across the edge and outside the image, a box under a pixel."""
    from visiontrain.models.rcnn import paste_masks
    from visiontrain.use.onnx_runner import paste_mask

    gen = torch.Generator().manual_seed(0)
    probabilities = torch.nn.functional.avg_pool2d(torch.rand(6, 1, 28, 28, generator=gen), 5, 1, 2)
    probabilities = (probabilities - 0.5) * 8 + 0.5  # spread around the threshold, so edges are everywhere
    boxes = torch.tensor([[3.3, 4.7, 40.2, 30.9], [-5.5, 10.1, 20.0, 59.6], [50.2, 40.4, 80.0, 70.0],
                          [10.0, 10.0, 10.6, 10.4], [0.0, 0.0, 64.0, 48.0], [70.0, 50.0, 90.0, 60.0]])
    want = paste_masks(probabilities, boxes, 48, 64, 0.4).numpy()
    got = [paste_mask(p[0].numpy(), b.numpy(), 48, 64, 0.4) for p, b in zip(probabilities, boxes)]
    assert want.any() and all(np.array_equal(g, w) for g, w in zip(got, want))


def test_validate_on_the_test_split_gives_mask_ap(mask_run, capsys):
    from visiontrain.app.cli import main

    assert main(["validate", str(mask_run), "--split", "test"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["split"] == "test" and result["data_split"] == "test"
    assert all(0 <= result[k] <= 1 for k in ("AP50", "mask_AP", "mask_AP50", "mask_AP75"))
