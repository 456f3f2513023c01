"""The Python API (``visiontrain.Predictor``) and `visiontrain predict` on the shared tiny checkpoints
(tests/conftest.py): the API sees a validation image as evaluation does, every input kind gives the
same result, the CLI's JSON is the API's, and bad input is one clear line."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from procs import cli_here
from visiontrain.core import config as C
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.use.inference import Classification, Detections, Predictor


@pytest.fixture(scope="module")
def classifier(classify_checkpoint) -> Predictor:
    return Predictor.load(classify_checkpoint, device="cpu")


@pytest.fixture(scope="module")
def detector(rcnn_checkpoint) -> Predictor:
    return Predictor.load(rcnn_checkpoint, device="cpu")


def noise_png(path: Path, h: int, w: int, seed: int = 0) -> Path:
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    return path


def same(a: Classification | Detections, b: Classification | Detections, atol: float = 0.0) -> None:
    if isinstance(a, Classification):
        assert [c.class_id for c in a.top] == [c.class_id for c in b.top]
        torch.testing.assert_close(a.probabilities, b.probabilities, atol=atol, rtol=0)
    else:
        assert a.labels.tolist() == b.labels.tolist() and a.image_size == b.image_size
        torch.testing.assert_close(a.boxes, b.boxes, atol=atol, rtol=0)
        torch.testing.assert_close(a.scores, b.scores, atol=atol, rtol=0)


def test_classifier_sees_a_validation_image_as_evaluation_does(classifier):
    """The checkpoint records the validation transform; the API on a val item's own pixels (in
    [0, 1]) gives the model's probabilities on the dataset's prepared item, as evaluate computes them."""
    data = classifier.task.build_data()  # the checkpoint's own config: digits
    assert classifier.info["preprocess"] == data.info["preprocess"] == data.val.eval_transform.spec()
    assert classifier.info["preprocess"]["mean"] != [0.0]  # the train split's statistics, not a default
    val = data.val
    results = classifier([val.images[i].float() / val.max_value for i in range(6)], top_k=10)
    with torch.no_grad():
        probabilities = classifier.model(torch.stack([val[i][0] for i in range(6)])).softmax(-1)
    for result, p in zip(results, probabilities):
        assert result.class_id == int(p.argmax()) and [c.class_id for c in result.top] == p.argsort(descending=True).tolist()
        torch.testing.assert_close(result.probabilities, p, atol=1e-6, rtol=0)


def test_the_recorded_transform_is_the_one_the_datasets_use(tmp_path):
    """In-memory (digits, resized and not) and image-folder validation items are the recorded
    transform of their own pixels, bit for bit: one rule, not a copy of it."""
    from dataset_trees import build_image_folder
    from visiontrain.data.datasets import ClassificationReader, build_classification_data
    from visiontrain.data.eval_transform import EvalTransform
    from visiontrain.data.images import image_tensor

    build_image_folder(tmp_path / "folder")
    for name, root, size, augment in (("digits", None, None, "none"), ("digits", None, 12, "imagenet"),
                                      ("image-folder", str(tmp_path / "folder"), 24, "none")):
        reader = ClassificationReader(root=root, image_size=size, augment=augment, limit_val=3)
        data = build_classification_data(name, reader)
        transform = EvalTransform.from_spec(data.eval_transform.spec())
        for i in range(3):
            raw = image_tensor(data.val.samples[i][0], 3) if name == "image-folder" else data.val.images[i]
            max_value = 255.0 if name == "image-folder" else data.val.max_value
            assert torch.equal(transform(raw, max_value), data.val[i][0]), (name, size, augment, i)


def test_a_checkpoint_without_the_recorded_transform(classifier, classify_checkpoint, tmp_path):
    """Written before data_info held 'preprocess': rebuilt from the config (digits is always
    there), or, where the dataset cannot be read, an error naming it."""
    from visiontrain.engine.state.checkpoint import load_checkpoint

    state = load_checkpoint(classify_checkpoint)
    del fmt.data_info_of(state)["preprocess"]
    torch.save(state, tmp_path / "old.pt")
    image = noise_png(tmp_path / "x.png", 9, 11)
    same(Predictor.load(tmp_path / "old.pt", device="cpu")(image), classifier(image))
    moved = Predictor.load(tmp_path / "old.pt", device="cpu", overrides=["data.name=fashion-mnist",
                                                                         f"data.root={tmp_path / 'nowhere'}"])
    with pytest.raises(ValueError, match="data_info has no 'preprocess' .* data.name=fashion-mnist could not be read"):
        moved(image)


def test_every_input_kind_gives_the_same_classes(classifier, tmp_path):
    path = noise_png(tmp_path / "x.png", 20, 30)
    array = np.array(Image.open(path))
    tensor = torch.from_numpy(array).permute(2, 0, 1)
    first = classifier(str(path))
    assert isinstance(first, Classification) and len(first.top) == 5 and first.name == first.top[0].name
    for kind in (path, Image.open(path), array, tensor):
        assert classifier(kind).to_dict() == first.to_dict()
    for result in classifier(tensor[None].expand(3, -1, -1, -1)) + classifier([str(path), array]):
        same(result, first, atol=1e-6)
    same(classifier(tensor.float() / 255), first, atol=1e-5)  # floats skip the rounding to 8 bits
    grey = classifier(np.array(Image.open(path).convert("L")))  # what a one-channel model is given
    same(grey, first)


def test_cli_classification_json_and_sheet_match_the_api(classifier, classify_checkpoint, tmp_path):
    images = [noise_png(tmp_path / "a.png", 20, 30, 1), noise_png(tmp_path / "b.png", 12, 12, 2)]
    out = tmp_path / "out"
    proc = cli_here("predict", str(classify_checkpoint), *map(str, images), "--out", str(out), "--top-k", "3",
                    "--sheet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary == {"out": str(out), "images": 2, "predictions": str(out / "predictions.json"),
                       "sheet": str(out / "sheet.png")}
    rows = json.loads((out / "predictions.json").read_text())
    for row, path, result in zip(rows, images, classifier([str(p) for p in images], top_k=3), strict=True):
        assert row["file_name"] == str(path) and len(row["top"]) == 3
        assert [c["class_id"] for c in row["top"]] == [c.class_id for c in result.top]
        assert [c["name"] for c in row["top"]] == [c.name for c in result.top]
        np.testing.assert_allclose([c["probability"] for c in row["top"]], [c.probability for c in result.top],
                                   atol=1e-6)
    assert Image.open(out / "sheet.png").size[0] > 100


def test_detector_gives_the_cli_boxes_and_the_evaluation_paths(detector, rcnn_checkpoint, tmp_path):
    """The API on the validation files gives `visiontrain predict`'s detections.json, and what
    ``predict_batch`` gives on the validation set's own prepared items (the evaluation's path)."""
    from visiontrain.evaluation.coco import to_coco_results
    from visiontrain.tasks.rcnn import collate_with_sizes

    val = detector.task.build_data().val  # the checkpoint's own config: its COCO copy of fashion-mosaic
    paths = [r.path for r in val.records]
    results = detector(paths, threshold=0.0)
    assert all(isinstance(r, Detections) for r in results) and sum(map(len, results)) > 0
    for i, (path, result) in enumerate(zip(paths, results)):
        assert result.image_size == (val.records[i].height, val.records[i].width)
        images, mask, targets = collate_with_sizes([val[i]])
        with torch.no_grad():
            (want,) = detector.task.predict_batch(detector.model, images, mask, targets[0]["orig_size"][None])
        order = want["scores"].argsort(descending=True, stable=True)
        assert result.labels.tolist() == want["labels"][order].tolist()
        torch.testing.assert_close(result.boxes, want["boxes"][order], atol=1e-4, rtol=0)
        assert result.names == [detector.class_names[i] for i in result.labels.tolist()]

    out = tmp_path / "out"
    proc = cli_here("predict", str(rcnn_checkpoint), *paths, "--out", str(out), "--threshold", "0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    cli = json.loads((out / "detections.json").read_text())
    api = [r for n, d in enumerate(results, 1)
           for r in to_coco_results(d.boxes, d.scores, d.labels, n, detector.info["category_ids"])]
    assert len(cli) == len(api)
    for c, a in zip(cli, api):
        assert (c["image_id"], c["category_id"]) == (a["image_id"], a["category_id"])
        np.testing.assert_allclose(c["bbox"], a["bbox"], atol=1e-4)
        assert c["score"] == pytest.approx(a["score"], abs=1e-6)


def test_every_input_kind_gives_the_same_boxes(detector):
    path = detector.task.build_data().val.records[0].path
    array = np.array(Image.open(path).convert("RGB"))
    tensor = torch.from_numpy(array).permute(2, 0, 1)
    first = detector(path, threshold=0.0)
    assert len(first) > 0 and first.image_size == array.shape[:2]
    for kind in (Path(path), Image.open(path), array, tensor):
        same(detector(kind, threshold=0.0), first)
    for result in detector(torch.stack([tensor, tensor]), threshold=0.0) + detector([path, array], threshold=0.0):
        same(result, first)
    strict = detector(path)  # the task's default threshold
    assert (strict.scores >= detector.task.predict_threshold).all() and len(strict) <= len(first)


def test_bad_input_is_a_clear_error(classifier, detector):
    from visiontrain.engine.protocols.task import PredictUnsupported
    from visiontrain.use.inference import check_predicts
    from visiontrain.tasks import build_task

    cases = [(lambda: classifier("missing.png"), "image file missing.png does not exist"),
             (lambda: classifier(np.zeros((4, 4, 3))), "image: a numpy image must be uint8 .* got float64 \\(4, 4, 3\\)"),
             (lambda: classifier([np.zeros((4, 4), np.uint8), torch.full((3, 4, 4), 2.0)]),
              "image 1: float pixels must lie in \\[0, 1\\], got values in \\[2, 2\\]"),
             (lambda: classifier(torch.zeros(2, 4, 4, dtype=torch.uint8)), "expected a tensor \\[3, H, W\\]"),
             (lambda: classifier(42), "expected a file path, a PIL image, a numpy uint8 array or a torch tensor"),
             (lambda: classifier(np.zeros((4, 4), np.uint8), top_k=0), "top_k: must be >= 1, got 0"),
             (lambda: classifier(np.zeros((4, 4), np.uint8), threshold=0.5), "threshold applies to detection"),
             (lambda: detector(np.zeros((4, 4), np.uint8), top_k=3), "top_k applies to classification")]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()
    with pytest.raises(PredictUnsupported, match="task 'dino' makes no predictions on images"):
        check_predicts(build_task(C.load_config("ssl-dino")), "x.pt")


def test_cli_predict_errors_are_one_line(classify_checkpoint, tmp_path, capsys):
    from visiontrain.app.cli import main

    (tmp_path / "bad.png").write_bytes(b"not an image")
    noise_png(tmp_path / "ok.png", 8, 8)
    cases = [([str(tmp_path / "bad.png")], f"image file {tmp_path / 'bad.png'} cannot be decoded"),
             ([str(tmp_path / "ok.png"), "--threshold", "0.5"], "--threshold applies to detection checkpoints"),
             ([str(tmp_path / "ok.png"), "--top-k", "0"], "--top-k: must be an integer >= 1 (classes written per "
                                                           "image), got 0")]
    for extra, message in cases:
        assert main(["predict", str(classify_checkpoint), "--out", str(tmp_path / "o"), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("visiontrain: error: ") and message in err and "Traceback" not in err, err


def png_header_only(path: Path, width: int, height: int) -> Path:
    """A PNG whose header declares ``width`` x ``height`` (8-bit grey) and holds no pixel data: PIL
    reads the size at open, before any decoding, which is where its decompression-bomb check is."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b""))
    return path


def test_predict_refuses_a_decompression_bomb_in_one_line(classify_checkpoint, tmp_path):
    bomb = png_header_only(tmp_path / "bomb.png", 40_000, 40_000)  # 1.6 billion pixels from 57 bytes
    proc = cli_here("predict", str(classify_checkpoint), str(bomb), "--out", str(tmp_path / "out"))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("visiontrain: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"image file {bomb} is refused: Image size (1600000000 pixels) exceeds limit" in errors[0], errors
