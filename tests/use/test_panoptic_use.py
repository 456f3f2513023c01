"""Using a panoptic checkpoint: segment-panoptic as shipped trains and draws its figures, ``Predictor``
returns each image's segments as evaluation fuses them, `visiontrain predict` writes COCO panoptic
PNGs and JSON that panopticapi's own evaluation scores as `validate` does, `validate --split test`
scores the test split, and the ONNX export holds the network, which the torch-free runner fuses
(``visiontrain.use.onnx_runner``, also behind `visiontrain predict MODEL.onnx`) into the checkpoint's
segments. One tiny checkpoint, trained once, serves every test."""
from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from detection_helpers import vt
from visiontrain.core.panoptic_format import rgb2id
from visiontrain.rundir.metrics_file import read_metrics
from visiontrain.rundir.run_files import PLOTS_DIR, REPORT_FILE
from visiontrain.use.inference import PanopticSegmentation, Predictor

VAL_IMAGES = 6


@pytest.fixture(scope="module")
def panoptic_run(tmp_path_factory) -> Path:
    """segment-panoptic as shipped, two steps on 16 images, evaluated on six."""
    run = tmp_path_factory.mktemp("panoptic") / "run"
    proc = vt("fit", "segment-panoptic", "trainer.max_steps=2", "data.limit_train=16",
              f"data.limit_val={VAL_IMAGES}", "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def predictor(panoptic_run) -> Predictor:
    # a threshold the two-step model's scores reach, so that instances are fused too (the recipe's is 0.5)
    return Predictor.load(panoptic_run, device="cpu", overrides=["task.instance_score_thresh=0.05"])


@pytest.fixture(scope="module")
def recipe_predictor(panoptic_run) -> Predictor:
    """The recipe's fusion thresholds: those the exported file's metadata holds."""
    return Predictor.load(panoptic_run, device="cpu")


@pytest.fixture(scope="module")
def panoptic_onnx(panoptic_run, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("onnx") / "panoptic.onnx"
    proc = vt("export", str(panoptic_run), "--format", "onnx", "--out", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path


@pytest.fixture(scope="module")
def two_sizes(recipe_predictor) -> list[str]:
    """Two validation images of different sizes (each resized by the model's rule, PIL's resize in the
    runner and torchvision's in the Predictor)."""
    records = recipe_predictor.task.build_data().val.records
    second = next(r for r in records[1:] if (r.height, r.width) != (records[0].height, records[0].width))
    return [records[0].image, second.image]


def test_the_recipe_trains_and_draws_its_figures_and_the_report_shows_them(panoptic_run):
    plots = {p.stem for p in (panoptic_run / PLOTS_DIR).glob("*.png")}
    assert {"train_batch", "val_panoptic"} <= plots
    evals = read_metrics(panoptic_run / "metrics.jsonl")[1]
    for key in ("PQ", "SQ", "RQ", "PQ_th", "PQ_st"):
        assert math.isnan(evals[-1][key]) or 0 <= evals[-1][key] <= 1
    assert set(evals[-1]["per_class"]) == {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                                           "Sneaker", "Bag", "Ankle boot", "wall", "floor"}
    assert "val_panoptic" in (panoptic_run / REPORT_FILE).read_text()


def test_the_predictor_gives_the_segments_evaluation_fuses(predictor):
    data = predictor.task.build_data()
    images = [data.val.load(i)[0].as_subclass(torch.Tensor) for i in range(3)]
    results = predictor(images)
    for i, (image, result) in enumerate(zip(images, results)):
        batch = data.eval_collate([data.val[i]])
        orig = torch.stack([t["orig_size"] for t in batch[2]])
        with torch.no_grad():
            want = predictor.task.segment_batch(predictor.model, batch[0], batch[1], orig)[0]
        assert isinstance(result, PanopticSegmentation) and result.image_size == tuple(image.shape[-2:])
        assert torch.equal(result.ids, want["ids"]) and result.segments == want["segments"]
        assert {s["id"] for s in result.segments} == set(result.ids.unique().tolist()) - {0}
        assert {s["category"] for s in result.to_dict()["segments_info"]} <= set(predictor.task.info["class_names"]) | {
            "wall", "floor"}
    assert any(s["isthing"] for r in results for s in r.segments)  # instances were fused, not stuff alone
    with pytest.raises(ValueError, match="panoptic segmenter"):
        predictor(images[0], threshold=0.5)


def test_predict_writes_coco_panoptic_that_panopticapi_scores_as_validate_does(panoptic_run, tmp_path):
    """`predict` on the validation images, its PNGs and JSON handed to panopticapi's pq_compute with
    the images' ground truth: the PQ, SQ and RQ `validate` gives for the same images."""
    from panopticapi import evaluation as panopticapi_eval

    predictor = Predictor.load(panoptic_run, device="cpu")  # the recipe's fusion, as predict and validate run it
    val = predictor.task.build_data().val
    records = val.records[:VAL_IMAGES]
    out = tmp_path / "out"
    proc = vt("predict", str(panoptic_run), *[r.image for r in records], "--out", str(out), "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads((out / "panoptic.json").read_text())
    pairs, categories = [], {c["id"]: c for c in written["categories"]}
    for record, ann in zip(records, written["annotations"]):
        ids = rgb2id(np.asarray(Image.open(out / ann["panoptic_png"])))
        assert np.array_equal(ids, predictor(record.image).ids.numpy()) and (out / ann["overlay"]).is_file()
        gt = {"image_id": record.image_id, "file_name": Path(record.png).name,
              "segments_info": [{"id": s.id, "category_id": s.category_id, "iscrowd": int(s.iscrowd),
                                 "area": s.area} for s in record.segments]}
        pairs.append((gt, {"image_id": record.image_id, "file_name": ann["panoptic_png"],
                           "segments_info": ann["segments_info"]}))
    with contextlib.redirect_stdout(io.StringIO()):
        stat = panopticapi_eval.pq_compute_single_core(0, pairs, str(Path(records[0].png).parent), str(out),
                                                       categories)
    reference, _ = stat.pq_average(categories, isthing=None)
    # one image a batch, as predict takes them: a batch pads its images to one size, which the network's
    # border pixels see
    proc = vt("validate", str(panoptic_run), f"data.limit_val={VAL_IMAGES}", "data.eval_batch_size=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [result["PQ"], result["SQ"], result["RQ"]] == pytest.approx(
        [reference["pq"], reference["sq"], reference["rq"]], abs=1e-12)


def test_validate_on_the_test_split_gives_pq(panoptic_run, capsys):
    from visiontrain.app.cli import main

    assert main(["validate", str(panoptic_run), "--split", "test", "data.limit_val=4"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["split"] == "test" and all(math.isnan(result[k]) or 0 <= result[k] <= 1 for k in ("PQ", "SQ", "RQ"))


def test_the_onnx_export_holds_the_network_and_says_how_to_fuse(panoptic_onnx, recipe_predictor):
    """The export checks the file against PyTorch at two aspect ratios itself (height and width free);
    its metadata carries the fusion's rule and thresholds, and the categories the runner names."""
    import onnx

    from visiontrain.use.onnx_runner import OnnxModel

    model = onnx.load(str(panoptic_onnx))
    meta = {p.key: p.value for p in model.metadata_props}
    assert [o.name for o in model.graph.output] == ["boxes", "labels", "scores", "masks", "semantic"]
    fusion = json.loads(meta["fusion"])
    assert fusion["stuff_area"] == 128 and "overlap_thresh" in fusion["rule"]
    runner = OnnxModel(panoptic_onnx)
    assert runner.kind == "panoptic"
    assert [(c["id"], c["name"], c["isthing"]) for c in runner.categories()] == [
        (c["id"], c["name"], c["isthing"]) for c in recipe_predictor.info["categories"]]


def same_segmentation(ids: np.ndarray, segments: list[dict], want: PanopticSegmentation) -> None:
    """The Predictor's segmentation to PIL's resize: the same segments (category, thing or stuff, in
    order) and the same segment id on all but 0.1 % of the pixels."""
    assert ids.dtype == np.int32 and ids.shape == tuple(want.image_size)
    assert [(s["category_id"], s["isthing"]) for s in segments] == [
        (s["category_id"], s["isthing"]) for s in want.segments]
    assert (ids == want.ids.numpy()).mean() > 0.999


def test_the_onnx_runner_fuses_the_predictors_segments(panoptic_onnx, recipe_predictor, predictor, two_sizes,
                                                       tmp_path):
    """The torch-free runner, in this process and copied out with torch and visiontrain unimportable,
    gives the Predictor's segmentation of two images of different sizes (the fusion's thresholds the
    metadata's, the recipe's, under which this two-step model's segments are stuff); its JSON lines
    carry the segments, the ids go to --masks. With the metadata's instance threshold lowered to the
    ``predictor`` fixture's, it fuses that Predictor's things too."""
    from small_detectors import run_onnx_runner_standalone
    from visiontrain.use.onnx_runner import OnnxModel, read_image

    model = OnnxModel(panoptic_onnx)
    wants = [recipe_predictor(path) for path in two_sizes]
    for path, want in zip(two_sizes, wants):
        result = model.predict(path)
        assert result["image_size"] == list(want.image_size)
        same_segmentation(result["ids"], result["segments_info"], want)
        assert [s["category"] for s in result["segments_info"]] == [
            s["category"] for s in want.to_dict()["segments_info"]]
    lines = run_onnx_runner_standalone(tmp_path, panoptic_onnx, *two_sizes, "--masks", tmp_path / "ids")
    for path, line, want in zip(two_sizes, lines, wants):
        assert line["file_name"] == path and "ids" not in line and line["image_size"] == list(want.image_size)
        same_segmentation(np.load(line["masks_file"]), line["segments_info"], want)
    model.meta["fusion"] = {**model.meta["fusion"], "instance_score_thresh": 0.05}  # the predictor fixture's
    things = 0
    for path in two_sizes:
        ids, segments = model.panoptic(read_image(path))
        same_segmentation(ids, segments, predictor(path))
        things += sum(s["isthing"] for s in segments)
        assert [s["id"] for s in segments] == list(range(1, len(segments) + 1))
        assert [s["area"] for s in segments] == [int((ids == s["id"]).sum()) for s in segments]
        assert set(np.unique(ids).tolist()) - {0} == {s["id"] for s in segments}
    assert things > 0


def test_predict_on_the_onnx_file_writes_the_checkpoints_segments(panoptic_onnx, recipe_predictor, two_sizes,
                                                                  tmp_path):
    """`visiontrain predict MODEL.onnx` writes what it writes for the checkpoint: the id PNGs, the
    overlays, panoptic.json's annotations and its categories (rebuilt from the metadata)."""
    out = tmp_path / "out"
    proc = vt("predict", str(panoptic_onnx), *two_sizes, "--out", str(out), "--device", "cpu")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "out": str(out), "images": 2, "panoptic": str(out / "panoptic.json"), "segmentations": 2}
    written = json.loads((out / "panoptic.json").read_text())
    assert [(c["id"], c["name"], c["isthing"]) for c in written["categories"]] == [
        (c["id"], c["name"], c["isthing"]) for c in recipe_predictor.info["categories"]]
    assert [a["file_name"] for a in written["annotations"]] == two_sizes
    for ann in written["annotations"]:
        want = recipe_predictor(ann["file_name"])
        ids = rgb2id(np.asarray(Image.open(out / ann["panoptic_png"]))).astype(np.int32)
        same_segmentation(ids, ann["segments_info"], want)
        assert ann["image_size"] == list(want.image_size) and (out / ann["overlay"]).is_file()


def test_the_runners_fusion_is_fuse_panoptic():
    """The runner's numpy fusion (the metadata's fusion.rule in code) gives fuse_panoptic's ids and
    segments exactly, under two settings, on overlapping instances (one of them empty) and stuff blocks.
    The scores are distinct: torch.argsort promises no order for a tie."""
    from visiontrain.models.panoptic import FusionSettings, fuse_panoptic
    from visiontrain.use.onnx_runner import Found, fuse

    rng = np.random.default_rng(0)
    h, w, n = 40, 50, 16
    masks = np.zeros((n, h, w), dtype=bool)
    for i in range(n - 1):  # the last one empty
        y0, x0 = rng.integers(0, h - 5), rng.integers(0, w - 5)
        masks[i, y0:y0 + rng.integers(3, 20), x0:x0 + rng.integers(3, 20)] = True
    scores = rng.permutation(np.linspace(0.05, 0.95, n)).astype(np.float32)
    labels = rng.integers(0, 3, n)
    semantic = rng.integers(0, 4, (4, 5)).repeat(10, 0).repeat(10, 1)  # 10 x 10 blocks of classes 0 (things) to 3
    thing_ids, stuff_ids = [1, 2, 5], [7, 9, 8]
    for settings in (FusionSettings(0.5, 60, 0.5), FusionSettings(0.2, 150, 0.3)):
        want_ids, want = fuse_panoptic(torch.from_numpy(scores), torch.from_numpy(labels), torch.from_numpy(masks),
                                       torch.from_numpy(semantic), thing_ids, stuff_ids, settings)
        fusion = {"overlap_thresh": settings.overlap_thresh, "stuff_area": settings.stuff_area,
                  "instance_score_thresh": settings.score_thresh}
        ids, got = fuse(Found(np.zeros((n, 4), np.float32), scores, labels, masks, (h, w)), semantic, thing_ids,
                        stuff_ids, fusion)
        assert ids.dtype == np.int32 and np.array_equal(ids, want_ids.numpy()) and got == want
        assert {s["isthing"] for s in got} == {0, 1}
