"""The small detectors the export tests export (each family's structure at a few channels), and how
an exported ONNX file's metadata is read (onnx and onnxruntime must agree)."""
from __future__ import annotations

import json
from pathlib import Path

from visiontrain.core import config as C
from visiontrain.tasks import build_task


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


def yolo():
    task = build_task(C.load_config("detect-yolov3", [
        "task.backbone_width=0.25", "task.neck_channels=[32,16,8]", "task.val_size=96",
        "task.conf_threshold=0.0001"]))  # an untrained head scores about 0.005: keep its boxes
    info = {"num_classes": 3}
    return task, task.build_model(info), info


def onnx_metadata(path: str | Path) -> dict:
    """metadata_props read with onnx and with onnxruntime (they must agree), JSON decoded."""
    import onnx
    import onnxruntime as ort

    props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert props == ort.InferenceSession(str(path)).get_modelmeta().custom_metadata_map
    out = {}
    for key, value in props.items():
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


# Run as a user with only numpy, onnxruntime and PIL runs it: the file copied out of the package, and
# torch and visiontrain made unimportable, so an import of either fails the run.
_STANDALONE = ("import runpy, sys; sys.modules['torch'] = None; sys.modules['visiontrain'] = None; "
               "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def run_onnx_runner_standalone(folder: Path, *args) -> list[dict]:
    """``onnx_runner.py ARGS`` copied into ``folder`` and run without torch or visiontrain: its JSON
    lines, one an image (a failed run fails the test with its stderr)."""
    import shutil
    import sys

    import procs
    from visiontrain.use import onnx_runner

    script = Path(folder) / "onnx_runner.py"
    shutil.copyfile(onnx_runner.__file__, script)
    proc = procs.run([sys.executable, "-c", _STANDALONE, script, *map(str, args)], timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]
