"""`visiontrain predict MODEL.onnx`: an exported file gives the files and the numbers the checkpoint
gives (through ``visiontrain.use.onnx_runner``, onnxruntime and numpy), and what it cannot run is
one clear line. The runner's own agreement with the Python API, file by file and run without torch,
is in test_export.py, test_mask_use.py, test_semantic_use.py and test_panoptic_use.py."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from procs import cli_here
from visiontrain.use.export import export_checkpoint


@pytest.fixture(scope="module")
def classify_onnx(classify_checkpoint, tmp_path_factory) -> Path:
    return Path(export_checkpoint(classify_checkpoint, "onnx", tmp_path_factory.mktemp("onnx") / "digits.onnx")["path"])


def noise(path: Path, h: int, w: int, seed: int, channels: int = 3) -> Path:
    shape = (h, w, 3) if channels == 3 else (h, w)
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)).save(path)
    return path


def predict(model: Path, images: list[Path], out: Path, *extra: str) -> dict:
    proc = cli_here("predict", str(model), *map(str, images), "--out", str(out), *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_predict_on_a_classifier_s_onnx_file_writes_the_checkpoint_s_predictions(classify_checkpoint, classify_onnx,
                                                                                 tmp_path):
    images = [noise(tmp_path / "a.png", 8, 8, 1, channels=1), noise(tmp_path / "b.png", 8, 8, 2, channels=1)]
    summary = predict(classify_onnx, images, tmp_path / "onnx", "--top-k", "3", "--sheet")
    assert summary == {"out": str(tmp_path / "onnx"), "images": 2, "predictions": str(tmp_path / "onnx/predictions.json"),
                       "sheet": str(tmp_path / "onnx/sheet.png")}
    predict(classify_checkpoint, images, tmp_path / "ckpt", "--top-k", "3")
    got, want = (json.loads((tmp_path / d / "predictions.json").read_text()) for d in ("onnx", "ckpt"))
    assert [r["file_name"] for r in got] == [r["file_name"] for r in want] == [str(p) for p in images]
    for g, w in zip(got, want):
        assert [c["class_id"] for c in g["top"]] == [c["class_id"] for c in w["top"]]
        assert [c["name"] for c in g["top"]] == [c["name"] for c in w["top"]]
        np.testing.assert_allclose([c["probability"] for c in g["top"]], [c["probability"] for c in w["top"]],
                                   atol=1e-5)
    assert Image.open(tmp_path / "onnx/sheet.png").size[0] > 100


def test_predict_on_a_detector_s_onnx_file_writes_the_checkpoint_s_detections(rcnn_checkpoint, tmp_path):
    """Images the checkpoint's validation resize leaves as they are (96 on the shorter side, at most
    128), since PIL's resize and torchvision's differ by a grey level; threshold 0 keeps every box."""
    model = export_checkpoint(rcnn_checkpoint, "onnx", tmp_path / "rcnn.onnx")["path"]
    images = [noise(tmp_path / "wide.png", 96, 128, 3), noise(tmp_path / "tall.png", 120, 96, 4)]
    summary = predict(Path(model), images, tmp_path / "onnx", "--threshold", "0")
    predict(rcnn_checkpoint, images, tmp_path / "ckpt", "--threshold", "0")
    got, want = (json.loads((tmp_path / d / "detections.json").read_text()) for d in ("onnx", "ckpt"))
    assert summary["detections"] == len(got) == len(want) > 0
    for key in ("image_id", "category_id", "file_name", "drawn"):
        assert [d[key] for d in got] == [d[key] for d in want], key
    np.testing.assert_allclose([d["bbox"] for d in got], [d["bbox"] for d in want], atol=0.011)
    np.testing.assert_allclose([d["score"] for d in got], [d["score"] for d in want], atol=1e-5)
    assert {p.name for p in (tmp_path / "onnx").glob("*.png")} == {"wide.png", "tall.png"}


def with_task(source: Path, task: str, out: Path) -> Path:
    """A copy of an ONNX file whose metadata names another task."""
    import onnx

    model = onnx.load(str(source))
    next(p for p in model.metadata_props if p.key == "task").value = task
    onnx.save(model, str(out))
    return out


def test_what_predict_cannot_run_from_an_onnx_file_is_one_line(classify_onnx, tmp_path, capsys):
    from visiontrain.app.cli import main

    image = noise(tmp_path / "ok.png", 8, 8, 0)
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    cases = [([str(classify_onnx), "--ema"], f"--ema: {classify_onnx} is an ONNX file, which holds one set of weights"),
             ([str(tmp_path / "none.onnx")], f"{tmp_path / 'none.onnx'}: no such ONNX file"),
             ([str(tmp_path / "junk.onnx")], f"{tmp_path / 'junk.onnx'}: onnxruntime cannot load it"),
             ([str(with_task(classify_onnx, "dino", tmp_path / "dino.onnx"))], "task 'dino' makes no predictions"),
             ([str(with_task(classify_onnx, "toy", tmp_path / "toy.onnx"))], "its metadata names task 'toy'; this "
                                                                              "runner reads files visiontrain export "
                                                                              "wrote for classification, rcnn"),
             ([str(classify_onnx), "--device", "tpu"], "device 'tpu': expected cpu, cuda or cuda:N"),
             ([str(classify_onnx), "--threshold", "0.5"], f"{classify_onnx} is a classification model (a classifier: "
                                                          f"--top-k)")]
    for extra, message in cases:
        assert main(["predict", extra[0], str(image), "--out", str(tmp_path / "o"), *extra[1:]]) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("visiontrain: error: ") and message in err and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()


def test_the_runner_needs_numpy_onnxruntime_and_pil_alone():
    """What lets the one file be copied to a machine without torch: every import it makes (at the
    top or in a function) is the standard library's, numpy's, onnxruntime's or PIL's."""
    import ast
    import sys

    from visiontrain.use import onnx_runner

    tree = ast.parse(Path(onnx_runner.__file__).read_text())
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    roots = {name.split(".")[0] for name in names}
    assert "onnxruntime" in roots and roots - set(sys.stdlib_module_names) == {"numpy", "onnxruntime", "PIL"}
