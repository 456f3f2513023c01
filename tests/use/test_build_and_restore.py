"""Build separate from run: ``validate`` builds the evaluation side only, and validate, predict and
export rebuild a model from a checkpoint through one path (``visiontrain.use.trained``)."""
from __future__ import annotations

import json

import pytest
import torch

from toy_task import toy_config, train
from visiontrain.app import cli
from visiontrain.engine.setup import loaders as loaders_module
from visiontrain.engine.setup import training as run_module
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.engine.state.checkpoint import CheckpointError, load_checkpoint
from visiontrain.use.trained import load_trained


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("toy") / "run"
    cfg = toy_config(trainer__epochs=2, ema__enabled=True, ema__decay=0.9)
    trainer = train(cfg, run_dir)
    return run_dir, trainer


def test_validate_builds_no_optimizer_and_no_training_loader(toy_run, monkeypatch, capsys):
    run_dir, _ = toy_run

    def refused(*args, **kwargs):
        raise AssertionError("validate built a piece only training needs")

    monkeypatch.setattr(run_module, "build_optimizer", refused)
    monkeypatch.setattr(run_module, "loaders", refused)
    monkeypatch.setattr(loaders_module, "train_loader", refused)
    assert cli.main(["validate", str(run_dir / "checkpoints" / "last.pt")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    final = json.loads((run_dir / "summary.json").read_text())["final"]
    # the checkpoint's model and EMA measured again give the run's last evaluation
    assert out["mse"] == pytest.approx(final["mse"], rel=1e-6)
    assert out["ema/mse"] == pytest.approx(final["ema/mse"], rel=1e-6)


def test_one_restore_path_for_model_and_ema(toy_run):
    run_dir, trainer = toy_run
    trained = load_trained(run_dir / "checkpoints" / "last.pt")
    model, ema = trained.model(), trained.model(ema=True)
    assert not model.training and not ema.training
    for name, value in model.state_dict().items():
        assert torch.equal(value, trainer.raw_model.state_dict()[name])
    for name, value in ema.state_dict().items():
        assert torch.equal(value, trainer.ema.module.state_dict()[name])


def test_ema_asked_of_a_checkpoint_without_one_is_the_same_error_everywhere(tmp_path):
    run_dir = tmp_path / "plain"
    train(toy_config(trainer__epochs=1), run_dir)
    assert not fmt.has_ema(load_checkpoint(run_dir / "checkpoints" / "last.pt"))
    with pytest.raises(CheckpointError, match="no EMA weights"):
        load_trained(run_dir).model(ema=True)
    with pytest.raises(CheckpointError, match="no EMA weights"):  # export goes through the same path
        from visiontrain.use.export import export_checkpoint

        export_checkpoint(run_dir, "onnx", tmp_path / "x.onnx", use_ema=True)
