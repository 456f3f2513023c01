"""`visiontrain export`: round trips through onnxruntime, torch.export and TorchScript for the
classification, DETR, Faster R-CNN and YOLOv3 networks, end to end through the CLI, and the clear
errors; the ONNX files' metadata, the detectors' free height and width, and the torch-free ONNX
runner (``visiontrain.use.onnx_runner``, run copied out of the package) against the Python API on the
same image."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from detection_helpers import vt
from small_detectors import detr, faster_rcnn, onnx_metadata, run_onnx_runner_standalone, yolo
from toy_task import ToyTask, toy_config
from visiontrain.core import config as C
from visiontrain.engine.protocols.task import ExportUnsupported
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.use.export import export_model
from visiontrain.tasks import build_task

TOL = 1e-4


def classifier():
    from visiontrain.data.eval_transform import EvalTransform

    task = build_task(C.load_config("classify-fashion"))
    info = {"num_classes": 10, "in_channels": 1, "image_size": 28,
            "preprocess": EvalTransform(28, (0.286,), (0.353,)).spec()}  # as a checkpoint records it
    return task, task.build_model(info), info


DETECTORS = {"rcnn": faster_rcnn, "yolo": yolo, "detr": detr}


@pytest.fixture(scope="module")
def onnx_export(tmp_path_factory):
    """``onnx_export(family)`` -> (task, model, info, export result): each detector exported once."""
    done = {}

    def get(family: str):
        if family not in done:
            torch.manual_seed(0)
            task, model, info = DETECTORS[family]()
            done[family] = (task, model, info,
                            export_model(task, model, info, "onnx", tmp_path_factory.mktemp(family) / "m.onnx"))
        return done[family]
    return get


@pytest.mark.parametrize("fmt", ["onnx", "exported-program", "torchscript"])
def test_classifier_round_trips(fmt, tmp_path):
    torch.manual_seed(0)
    task, model, info = classifier()
    result = export_model(task, model, info, fmt, tmp_path / f"model.{fmt}")
    assert Path(result["path"]).stat().st_size > 10_000
    assert result["format"] == fmt and result["max_abs_diff"] < TOL
    assert result["inputs"] == {"images": [2, 1, 28, 28]} and result["outputs"] == ["logits"]


def test_classifier_onnx_batch_is_free(tmp_path):
    import onnxruntime as ort

    torch.manual_seed(0)
    task, model, info = classifier()
    export_model(task, model, info, "onnx", tmp_path / "m.onnx")
    x = torch.randn(5, 1, 28, 28)
    (logits,) = ort.InferenceSession(str(tmp_path / "m.onnx")).run(None, {"images": x.numpy()})
    with torch.no_grad():
        torch.testing.assert_close(torch.from_numpy(logits), model.eval()(x), atol=TOL, rtol=0)


def test_detr_raw_outputs_round_trip(onnx_export, tmp_path):
    _, _, _, result = onnx_export("detr")
    assert result["max_abs_diff"] < TOL
    assert result["inputs"] == {"images": [2, 3, 64, 64], "mask": [2, 64, 64]}
    assert result["outputs"] == ["pred_logits", "pred_boxes"]
    torch.manual_seed(0)
    task, model, info = detr()
    assert export_model(task, model, info, "torchscript", tmp_path / "detr")["max_abs_diff"] < TOL


def test_faster_rcnn_exports_with_postprocessing_to_onnx(onnx_export):
    import onnxruntime as ort

    task, model, info, result = onnx_export("rcnn")
    assert result["max_abs_diff"] < TOL and result["outputs"] == ["boxes", "labels", "scores"]
    spec = task.export_spec(model, info)
    boxes, labels, scores = ort.InferenceSession(result["path"]).run(None, {"image": spec.example_inputs[0].numpy()})
    assert len(boxes) > 0, "nothing detected: the comparison would be vacuous"
    assert labels.min() >= 0 and labels.max() < info["num_classes"] and (boxes[:, 2:] <= 96 + 1e-3).all()


@pytest.mark.parametrize("family", list(DETECTORS))
def test_detector_onnx_takes_any_height_and_width(onnx_export, family):
    """The export itself checked a wider input (``checked_inputs``); here a taller one, run in
    onnxruntime against PyTorch: a size baked into the graph would give other shapes or values."""
    import onnxruntime as ort

    from visiontrain.use.export import max_abs_diff

    task, model, info, result = onnx_export(family)
    spec = task.export_spec(model, info)
    image = spec.input_names[0]
    assert result["dynamic_axes"][image][2] == "height" and result["dynamic_axes"][image][3] == "width"
    checked = [c[image] for c in result["checked_inputs"]]
    assert len(checked) == 2 and checked[1][3] > checked[1][2], checked  # the example and a wider image
    taller = tuple(x.transpose(-1, -2).contiguous() for x in spec.check_inputs[0])
    got = ort.InferenceSession(result["path"]).run(None, {n: x.numpy() for n, x in zip(spec.input_names, taller)})
    with torch.no_grad():
        want = spec.module(*taller)
    want = want if isinstance(want, tuple) else (want,)
    assert want[0].numel() > 0
    assert max_abs_diff(want, [torch.from_numpy(g) for g in got], spec.output_names) < TOL


@pytest.mark.parametrize("family", list(DETECTORS))
def test_detector_onnx_metadata_says_how_to_run_it(onnx_export, family):
    task, _, info, result = onnx_export(family)
    meta = onnx_metadata(result["path"])
    assert meta["task"] == task.name and meta["input_layout"] == "NCHW" and meta["color"] == "RGB"
    assert meta["class_names"] == ["0", "1", "2", "3"][:info["num_classes"]]
    assert meta["category_ids"] == list(range(info["num_classes"]))
    assert meta["scale"] == pytest.approx(1 / 255) and meta["mean"] == pytest.approx([0.485, 0.456, 0.406])
    assert meta["std"] == pytest.approx([0.229, 0.224, 0.225]) and meta["score_threshold"] == task.predict_threshold
    assert meta["outputs"] == result["outputs"]
    assert meta["dynamic_axes"] == json.loads(json.dumps(result["dynamic_axes"]))  # JSON: the axes as strings
    t = task.cfg.task
    assert meta["box_format"] == {"rcnn": "xyxy", "yolo": "xyxy", "detr": "cxcywh"}[family] and meta["box_frame"]
    if family == "yolo":
        assert meta["anchors"] == t.anchors and meta["strides"] == [8, 16, 32] and meta["anchors_per_scale"] == 3
        assert meta["resize"] == ({"mode": "longer_side", "longer_side": t.val_size} if t.letterbox else
                                  {"mode": "stretch", "height": t.val_size, "width": t.val_size})
        assert (meta["conf_threshold"], meta["nms_iou"]) == (t.conf_threshold, t.nms_iou)
    else:
        assert meta["resize"] == {"mode": "shorter_side", "shorter_side": t.val_size, "max_longer_side": t.max_size}
    if family == "detr":
        assert meta["class_activation"] == "sigmoid" and meta["top_k"] == 100  # the recipe's focal loss


def assert_the_onnx_runner_agrees(onnx_export, family: str, image: Path, same_as: Path | None = None) -> None:
    """``visiontrain.use.onnx_runner`` (copied out, no torch) on ``image`` and ``Predictor`` on ``same_as`` (default:
    ``image``), threshold 0: the same classes, boxes and scores, to float rounding."""
    from visiontrain.use.inference import Predictor

    task, model, info, result = onnx_export(family)
    (line,) = run_onnx_runner_standalone(image.parent, result["path"], image, "--threshold", "0")
    got = line["detections"]
    want = Predictor(task, model, info, device="cpu")(str(same_as or image), threshold=0.0).to_dict()["detections"]
    assert len(want) > 0 and len(got) == len(want)
    assert [d["class_id"] for d in got] == [d["class_id"] for d in want]
    np.testing.assert_allclose([d["box"] for d in got], [d["box"] for d in want], atol=0.011)
    np.testing.assert_allclose([d["score"] for d in got], [d["score"] for d in want], atol=1e-5)


# (96, 120) and (120, 96): sides that are no multiple of 32, which predict pads and Faster R-CNN's graph pads itself
@pytest.mark.parametrize("family,size", [("rcnn", (96, 128)), ("rcnn", (96, 120)), ("rcnn", (120, 96)),
                                         ("yolo", (96, 96)), ("detr", (64, 96))])
def test_the_onnx_runner_gives_what_the_python_api_gives(onnx_export, family, size, tmp_path):
    """The torch-free onnxruntime + numpy runner (resize, normalise, pad, decode, NMS from the
    metadata) on an image that needs no resize, against ``Predictor`` in PyTorch: the same boxes."""
    image = tmp_path / "image.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (*size, 3), dtype=np.uint8)).save(image)
    assert_the_onnx_runner_agrees(onnx_export, family, image)


@pytest.mark.parametrize("kind", ["16-bit", "exif"])
def test_the_onnx_runner_reads_an_image_file_as_predictor_does(onnx_export, kind, tmp_path):
    """A 16-bit grey PNG (scaled to 8 bits by its full range, not clipped at 255), and a photo stored
    turned with its EXIF orientation tag, whose boxes are those of its upright copy."""
    from dataset_trees import save_photo, upright_copy

    pixels = np.random.default_rng(1).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    if kind == "16-bit":
        image = tmp_path / "deep.png"
        grey = np.asarray(Image.fromarray(pixels).convert("L"), dtype=np.uint16) * 257  # the full 16-bit range
        Image.fromarray(grey).save(image)
        assert Image.open(image).mode.startswith("I;16")
    else:
        image = tmp_path / "photo.jpg"
        save_photo(Image.fromarray(pixels), image, 6)
    assert_the_onnx_runner_agrees(onnx_export, "rcnn", image, upright_copy(image) if kind == "exif" else None)


def test_faster_rcnn_torchscript_and_clear_exported_program_error(tmp_path):
    torch.manual_seed(0)
    task, model, info = faster_rcnn()
    assert export_model(task, model, info, "torchscript", tmp_path / "r.pt")["max_abs_diff"] < TOL
    with pytest.raises(ExportUnsupported, match="cannot export to exported-program: .*try --format onnx"):
        export_model(task, model, info, "exported-program", tmp_path / "r.pt2")


def test_a_task_without_export_says_so(tmp_path):
    cfg = toy_config()
    task = ToyTask(cfg)
    model = task.build_model({"dim": cfg.task.dim})
    with pytest.raises(ExportUnsupported, match="task 'toy' does not support export"):
        export_model(task, model, {}, "onnx", tmp_path / "toy.onnx")
    with pytest.raises(ExportUnsupported, match="unknown format 'tflite'"):
        export_model(task, model, {}, "tflite", tmp_path / "toy.tflite")


def test_cli_exports_a_checkpoint_and_prints_the_difference(classify_checkpoint, tmp_path):
    """A 2-step fit's checkpoint, its EMA weights, to ONNX next to the checkpoint (the default --out);
    its metadata is the checkpoint's classes and validation transform, and the torch-free ONNX
    runner on an 8 x 8 digit gives the Python API's probabilities."""
    from visiontrain.engine.state.checkpoint import load_checkpoint
    from visiontrain.use.inference import Predictor

    proc = vt("export", str(classify_checkpoint), "--format", "onnx", "--ema")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    out = classify_checkpoint.with_suffix(".onnx")
    assert result["path"] == str(out) and out.is_file() and result["format"] == "onnx"
    assert 0 <= result["max_abs_diff"] < TOL and result["inputs"] == {"images": [2, 1, 8, 8]}
    assert result["dynamic_axes"] == {"images": {"0": "batch"}, "logits": {"0": "batch"}}
    info = fmt.data_info_of(load_checkpoint(classify_checkpoint))
    meta = onnx_metadata(out)
    assert meta["task"] == "classification" and meta["class_names"] == info["class_names"] == [str(i) for i in range(10)]
    assert meta["category_ids"] == list(range(10)) and meta["input_size"] == {"height": 8, "width": 8}
    assert (meta["input_channels"], meta["color"], meta["input_layout"]) == (1, "L", "NCHW")
    assert meta["mean"] == info["preprocess"]["mean"] and meta["std"] == info["preprocess"]["std"]
    assert meta["scale"] == pytest.approx(1 / 255) and meta["mean"] != [0.0] and meta["std"] != [1.0]

    digit = tmp_path / "digit.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (8, 8), dtype=np.uint8)).save(digit)
    (line,) = run_onnx_runner_standalone(tmp_path, out, digit, "--top-k", "10")
    got = line["top"]
    want = Predictor.load(classify_checkpoint, ema=True, device="cpu")(str(digit), top_k=10).top
    assert [c["class_id"] for c in got] == [c.class_id for c in want]
    np.testing.assert_allclose([c["probability"] for c in got], [c.probability for c in want], atol=1e-5)


def test_cli_failure_is_one_clear_line(rcnn_checkpoint, tmp_path, capfd):
    """Exit 2 and one line on stderr (besides the torchvision set-up notice), never a traceback: the
    export torch cannot make through a real process (torch.export may print on its own while it fails);
    a checkpoint without EMA weights, refused before any export is tried, in this one."""
    proc = vt("export", str(rcnn_checkpoint), "--format", "exported-program", "--out", str(tmp_path / "x"))
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("torchvision ")]
    assert len(lines) == 1 and lines[0].startswith("visiontrain: error: ") and \
        "cannot export to exported-program" in lines[0], proc.stderr
    from visiontrain.app import cli

    capfd.readouterr()
    assert cli.main(["export", str(rcnn_checkpoint), "--format", "onnx", "--ema", "--out", str(tmp_path / "x")]) == 2
    out, err = capfd.readouterr()
    lines = [line for line in err.splitlines() if not line.startswith("torchvision ")]
    assert out == "" and len(lines) == 1 and lines[0].startswith("visiontrain: error: ") and \
        "no EMA weights" in lines[0], err
    assert not (tmp_path / "x").exists()
