"""Using a semantic segmentation checkpoint: segment-semantic as shipped trains and draws its figures,
``Predictor`` returns each image's label map at its own size (the evaluation's very classes),
`visiontrain predict` writes them as palette PNGs with overlays, `validate --split test` scores the
test split and the report shows the new figures. One tiny checkpoint, trained once, serves every test."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from detection_helpers import vt
from visiontrain.rundir.metrics_file import read_metrics
from visiontrain.rundir.run_files import PLOTS_DIR, REPORT_FILE
from visiontrain.use.inference import Predictor, Segmentation


@pytest.fixture(scope="module")
def semantic_run(tmp_path_factory) -> Path:
    """segment-semantic as shipped, two steps on 16 images, evaluated on 8."""
    run = tmp_path_factory.mktemp("semantic") / "run"
    proc = vt("fit", "segment-semantic", "trainer.max_steps=2", "data.limit_train=16", "data.limit_val=8",
              "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def predictor(semantic_run) -> Predictor:
    return Predictor.load(semantic_run, device="cpu")


def test_the_recipe_trains_and_draws_its_figures_and_the_report_shows_them(semantic_run):
    plots = {p.stem for p in (semantic_run / PLOTS_DIR).glob("*.png")}
    assert {"train_batch", "val_segmentation", "confusion_matrix"} <= plots
    evals = read_metrics(semantic_run / "metrics.jsonl")[1]
    assert all(0 <= evals[-1][k] <= 1 for k in ("mIoU", "mAcc", "aAcc"))
    assert set(evals[-1]["per_class"]["background"]) == {"IoU", "Acc", "pixels"}
    report = (semantic_run / REPORT_FILE).read_text()
    assert "val_segmentation" in report and "confusion_matrix" in report


def test_the_predictor_gives_the_label_map_evaluation_gives(predictor):
    """A ``Segmentation`` [H, W] at each input's own size, equal to the classes evaluation reads from
    the validation set's prepared item, alone in its batch, as the predictor takes it (a batch pads
    its images to one size, which the network's border pixels see), from the logits averaged with
    those of the mirrored image (the recipe's task.val_flip); ``to_dict`` counts each present
    class's pixels."""
    data = predictor.task.build_data()
    images = [data.val.load(i)[0].as_subclass(torch.Tensor) for i in range(3)]
    results = predictor(images)
    want = []
    assert predictor.task.cfg.task.val_flip  # segment-semantic's: the logits averaged with the mirror's
    for i in range(3):
        batch = data.eval_collate([data.val[i]])
        with torch.no_grad():
            mirrored = predictor.model(batch[0].flip(-1))["out"].flip(-1)
            want += predictor.task.label_maps((predictor.model(batch[0])["out"] + mirrored) / 2, batch[2])
    for image, result, expected in zip(images, results, want):
        assert isinstance(result, Segmentation) and result.image_size == tuple(image.shape[-2:])
        assert result.labels.dtype == torch.int64 and torch.equal(result.labels, expected)
        counts = result.to_dict()["pixels"]
        assert sum(counts.values()) == image.shape[-2] * image.shape[-1]
        assert set(counts) <= set(predictor.class_names)
    with pytest.raises(ValueError, match="semantic segmenter"):
        predictor(images[0], threshold=0.5)


def test_predict_writes_palette_label_maps_and_overlays(semantic_run, predictor, tmp_path):
    val = predictor.task.build_data().val
    paths = [val.objects.records[i].path for i in range(2)]
    out = tmp_path / "out"
    proc = vt("predict", str(semantic_run), *paths, "--out", str(out), "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((out / "segmentation.json").read_text())
    assert [r["file_name"] for r in rows] == paths
    for path, row in zip(paths, rows):
        written = Image.open(out / row["label_map"])
        assert written.mode == "P" and (out / row["overlay"]).is_file()
        assert np.array_equal(np.asarray(written), predictor(path).labels.numpy())
        assert row["image_size"] == [written.height, written.width]
    proc = vt("predict", str(semantic_run), paths[0], "--out", str(out), "--threshold", "0.5")
    assert proc.returncode != 0 and "semantic segmenter" in proc.stderr


def test_validate_on_the_test_split_gives_miou(semantic_run, capsys):
    from visiontrain.app.cli import main

    assert main(["validate", str(semantic_run), "--split", "test", "data.limit_val=8"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["split"] == "test" and result["data_split"] == "test"
    assert all(0 <= result[k] <= 1 for k in ("mIoU", "mAcc", "aAcc"))


def test_the_onnx_export_gives_the_predictors_label_map(semantic_run, predictor, tmp_path):
    """The exported network (height and width free), run by the torch-free runner as its metadata
    says (segment-semantic evaluates at the image's own size: no resize; padded to a multiple of 32),
    gives the predictor's label map, and `visiontrain predict MODEL.onnx` writes the checkpoint's PNGs."""
    from visiontrain.use.onnx_runner import OnnxModel

    onnx = tmp_path / "semantic.onnx"
    proc = vt("export", str(semantic_run), "--format", "onnx", "--out", str(onnx))
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = OnnxModel(onnx)
    assert model.kind == "segmentation" and model.meta["pad"] == {"multiple": 32, "value": 0}
    paths = [predictor.task.build_data().val.objects.records[i].path for i in range(2)]  # two sizes
    for path in paths:
        result = model.predict(path)
        want = predictor(path).labels.numpy()
        assert (result["labels"] == want).mean() > 0.999 and result["image_size"] == list(want.shape)
    proc = vt("predict", str(onnx), *paths, "--out", str(tmp_path / "from-onnx"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for row in json.loads((tmp_path / "from-onnx" / "segmentation.json").read_text()):
        written = np.asarray(Image.open(tmp_path / "from-onnx" / row["label_map"]))
        assert (written == predictor(row["file_name"]).labels.numpy()).mean() > 0.999


@pytest.mark.parametrize("size", [(13, 29), (5, 4), (20, 3)])
def test_the_runners_resize_of_the_logits_is_torchs_bilinear(size):
    from visiontrain.use.onnx_runner import resize_bilinear

    x = np.random.default_rng(0).normal(size=(3, 7, 11)).astype(np.float32)
    want = torch.nn.functional.interpolate(torch.from_numpy(x)[None], size=size, mode="bilinear", align_corners=False)
    assert np.allclose(resize_bilinear(x, size), want[0].numpy(), atol=1e-5)
