"""The first look at a run: the first batch drawn as the model receives it, the labels, the model's
size; and `visiontrain preview`, which draws the same without training."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from procs import run_cli
from toy_task import toy_config, train
from visiontrain.core import config as C
from visiontrain.engine.setup.training import build_training
from visiontrain.engine.records.first_look import parameter_table
from visiontrain.tasks import build_task


def assert_drawn(path) -> None:
    """A PNG that holds a picture: not empty, not one flat colour."""
    assert path.is_file() and path.stat().st_size > 0, path
    pixels = np.asarray(Image.open(path).convert("L"), dtype=np.float64)
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100 and pixels.std() > 5.0, path


def test_the_summary_counts_parameters_and_flops_and_changes_nothing(tmp_path):
    # dropout and noisy inputs draw from the RNGs: a count that moved a stream would show in the weights
    settings = dict(task__dropout=0.2, task__noise=True, optim__freeze=["^3\\."])
    counted = train(toy_config(**settings), tmp_path / "counted")
    plain = train(toy_config(trainer__summary=False, **settings), tmp_path / "plain")
    for a, b in zip(counted.raw_model.state_dict().values(), plain.raw_model.state_dict().values()):
        assert torch.equal(a, b)
    assert not (tmp_path / "plain" / "model_summary.json").exists()
    summary = json.loads((tmp_path / "counted" / "model_summary.json").read_text())
    # Linear(16, 32) + Linear(32, 1): 544 + 33 parameters; the second frozen by optim.freeze=^3\.
    assert [(m["name"], m["total"], m["trainable"], m["frozen"]) for m in summary["modules"]] == \
        [("0", 544, 544, 0), ("3", 33, 0, 33)]
    assert summary["total"]["total"] == 577
    assert summary["flops_per_sample"] == 2 * (16 * 32 + 32 * 1)  # a multiply-add is two


def test_parameter_table_names_frozen_parameters_and_counts_shared_ones_once():
    shared = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared, torch.nn.Linear(4, 2))
    model[3].weight.requires_grad_(False)
    rows = {r.name: (r.total, r.trainable, r.frozen) for r in parameter_table(model)}
    assert rows == {"0": (20, 20, 0), "3": (10, 2, 8)}


@pytest.mark.parametrize("recipe,size", [("classify-fashion", ["data.limit_train=1024"]),
                                         ("detect-yolov3", ["data.limit_train=48"]),
                                         ("ssl-dino", ["data.limit_train=128", "task.knn_bank=128"])])
def test_the_drawn_batch_is_the_first_batch_the_model_receives(recipe, size):
    """The source's first_items loads in the main process what the recipe's own DataLoader workers (their start
    method, transforms, seeds) hand the first step."""
    cfg = C.load_config(recipe, size)
    run = build_training(cfg, build_task(cfg), None, resume=None, init=None)
    try:
        drawn = run.source.collate(run.source.first_items())
        loaded = next(run.source.batches(0))
    finally:
        run.source.close()
    flat_drawn, flat_loaded = tensors(drawn), tensors(loaded)
    assert len(flat_drawn) == len(flat_loaded) > 1
    for a, b in zip(flat_drawn, flat_loaded):
        assert torch.equal(a, b)


def tensors(batch) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in tensors(v)]
    return []


def test_preview_draws_a_detectors_first_batch_and_labels_without_training(tmp_path):
    out = tmp_path / "preview"
    proc = run_cli("preview", "detect-yolov3", "data.limit_train=48", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(result["plots"]) == sorted(str(out / f"{n}.png") for n in ("labels", "train_batch"))
    for name in ("train_batch", "labels"):
        assert_drawn(out / f"{name}.png")
    assert not (tmp_path / "runs").exists()  # nothing trained, no run dir
    proc = run_cli("preview", "detect-yolov3", "data.batch_size=0", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 2 and "data.batch_size" in proc.stderr
