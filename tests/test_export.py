"""`visiontrain export`: round trips through onnxruntime, torch.export and TorchScript for the
classification, DETR and Faster R-CNN networks, end to end through the CLI, and the clear errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from detection_helpers import mosaic_coco, vt
from toy_task import ToyTask, toy_config
from visiontrain import config as C
from visiontrain.export import export_model
from visiontrain.tasks import build_task
from visiontrain.engine.task import ExportUnsupported

TOL = 1e-4


def classifier():
    task = build_task(C.load_config("classify-fashion"))
    info = {"num_classes": 10, "in_channels": 1, "image_size": 28}
    return task, task.build_model(info), info


def detr():
    task = build_task(C.load_config("detect-detr", [
        "task.hidden_dim=32", "task.nheads=2", "task.enc_layers=1", "task.dec_layers=2", "task.dim_feedforward=64",
        "task.num_queries=5", "task.val_size=64", "task.max_size=96"]))
    info = {"num_classes": 4}
    return task, task.build_model(info), info


def faster_rcnn():
    task = build_task(C.load_config("detect-faster-rcnn", [
        "task.fpn_channels=32", "task.representation_size=64", "task.train_scales=[96]", "task.val_size=96",
        "task.max_size=128", "task.rpn_pre_nms_top_n=[200,100]", "task.rpn_post_nms_top_n=[100,50]"]))
    info = {"num_classes": 3}
    return task, task.build_model(info), info


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


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_detr_raw_outputs_round_trip(fmt, tmp_path):
    torch.manual_seed(0)
    task, model, info = detr()
    result = export_model(task, model, info, fmt, tmp_path / "detr")
    assert result["max_abs_diff"] < TOL
    assert result["inputs"] == {"images": [2, 3, 64, 64], "mask": [2, 64, 64]}
    assert result["outputs"] == ["pred_logits", "pred_boxes"]


def test_faster_rcnn_exports_with_postprocessing_to_onnx(tmp_path):
    import onnxruntime as ort

    torch.manual_seed(0)
    task, model, info = faster_rcnn()
    result = export_model(task, model, info, "onnx", tmp_path / "rcnn.onnx")
    assert result["max_abs_diff"] < TOL and result["outputs"] == ["boxes", "labels", "scores"]
    spec = task.export_spec(model, info)
    boxes, labels, scores = ort.InferenceSession(result["path"]).run(None, {"image": spec.example_inputs[0].numpy()})
    assert len(boxes) > 0, "nothing detected: the comparison would be vacuous"
    assert labels.min() >= 0 and labels.max() < info["num_classes"] and (boxes[:, 2:] <= 96 + 1e-3).all()


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


@pytest.fixture(scope="module")
def classify_checkpoint(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("cls") / "run"
    proc = vt("fit", "classify-fashion", "data.name=digits", "trainer.max_steps=2", "schedules.lr.warmup=0",
              "ema.enabled=true", "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run / "checkpoints" / "last.pt"


def test_cli_exports_a_checkpoint_and_prints_the_difference(classify_checkpoint):
    """A 2-step fit's checkpoint, its EMA weights, to ONNX next to the checkpoint (the default --out)."""
    proc = vt("export", str(classify_checkpoint), "--format", "onnx", "--ema")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    out = classify_checkpoint.with_suffix(".onnx")
    assert result["path"] == str(out) and out.is_file() and result["format"] == "onnx"
    assert 0 <= result["max_abs_diff"] < TOL and result["inputs"] == {"images": [2, 1, 8, 8]}


@pytest.fixture(scope="module")
def rcnn_checkpoint(tmp_path_factory) -> Path:
    """A 2-step Faster R-CNN fit on a 4/2-image fashion-mosaic laid out as COCO; a smaller network,
    loaded in-process and a one-step burn-in, because the subject is the export of its checkpoint."""
    root = mosaic_coco(tmp_path_factory, 4, 2)
    run = tmp_path_factory.mktemp("rcnn") / "run"
    proc = vt("fit", "detect-faster-rcnn", "data.name=coco", f"data.root={root}", "data.batch_size=2",
              "data.num_workers=0", "task.fpn_channels=32", "task.representation_size=64", "task.train_scales=[96]",
              "task.val_size=96", "task.max_size=128", "trainer.max_steps=2", "schedules.lr.warmup=1",
              "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run / "checkpoints" / "last.pt"


def test_cli_failure_is_one_clear_line(rcnn_checkpoint, tmp_path):
    """Exit 2 and one line on stderr (besides the torchvision set-up notice), never a traceback."""
    for args, why in ((["--format", "exported-program"], "cannot export to exported-program"),
                      (["--format", "onnx", "--ema"], "no EMA weights")):
        proc = vt("export", str(rcnn_checkpoint), *args, "--out", str(tmp_path / "x"))
        assert proc.returncode == 2 and proc.stdout == "", proc.stdout
        lines = [line for line in proc.stderr.splitlines() if not line.startswith("torchvision ")]
        assert len(lines) == 1 and lines[0].startswith("visiontrain: error: ") and why in lines[0], proc.stderr
