"""MLflow for real (a local SQLite store, read back through MlflowClient), the missing-package error,
and a run's end status: FINISHED, FAILED on an error, KILLED when stopped, the same MLflow run on
resume. The fits run the toy task in this process (``cli.main``): a new SQLite store costs 1.5 to 7 s
of MLflow's migrations, so one store is made and the other runs point ``logging.mlflow_uri`` at it.
"""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
from pathlib import Path

import pytest
import yaml

from mlflow_histories import histories
from toy_task import ToyTask, toy_config
from visiontrain.app import cli
from visiontrain.core import config as C
from visiontrain.engine.loop.trainer import Trainer
from visiontrain.engine.protocols.hooks import Hook
from visiontrain.core.stop_signals import Preempted

from visiontrain.engine.records.mlflow_tracker import MAX_PARAM, LoggingConfig, MlflowTracker, name, params_of

try:  # the extra (scripts/setup.sh test installs it): without it only the tests that need no MLflow run,
    import mlflow  # unless VISIONTRAIN_REQUIRE_MLFLOW=1 (CI) makes that a failure
    from mlflow import MlflowClient
except ImportError:
    if os.environ.get("VISIONTRAIN_REQUIRE_MLFLOW") == "1":
        pytest.fail("VISIONTRAIN_REQUIRE_MLFLOW=1 but mlflow cannot be imported (bash scripts/setup.sh test "
                    "installs the extra)", pytrace=False)
    mlflow = None
needs_mlflow = pytest.mark.skipif(mlflow is None, reason="needs the MLflow extra: pip install 'visiontrain[mlflow]'")


def recipe(tmp_path: Path, **overrides) -> str:
    path = tmp_path / "toy-recipe.yaml"
    path.write_text(C.dump_config(toy_config(**overrides)))
    return str(path)


def run_id(run_dir: Path) -> str:
    return json.loads((run_dir / "mlflow.json").read_text())["run_id"]


@pytest.fixture(scope="module")
def tracked(tmp_path_factory) -> dict:
    """One run tracked in its run dir's own store, then resumed for another epoch."""
    root = tmp_path_factory.mktemp("tracked")
    run_dir, path = root / "run", recipe(root, optim__lr=0.01, trainer__plots=True)  # converges: every value finite;
    # its plots are artifacts to check
    assert cli.main(["fit", path, "logging.mlflow=true", "--run-dir", str(run_dir)]) == 0
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    first = {"run": client.get_run(run_id(run_dir)), "metrics": histories(run_dir),
             "artifacts": {a.path: a.file_size for folder in (None, "plots", "checkpoints")
                           for a in client.list_artifacts(run_id(run_dir), folder)}}
    first["sizes"] = {f: (run_dir / f).stat().st_size for f in ("model.safetensors", "checkpoints/best.pt")}
    assert cli.main(["fit", path, "logging.mlflow=true", "trainer.epochs=3", "--run-dir", str(run_dir),
                     "--resume", "auto"]) == 0
    return {"root": root, "dir": run_dir, "client": client, "first": first, "uri": client.tracking_uri}


@needs_mlflow
def test_a_run_is_recorded_in_mlflow_as_in_its_run_dir(tracked):
    run_dir, first = tracked["dir"], tracked["first"]
    run = first["run"]
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    experiment = tracked["client"].get_experiment(run.info.experiment_id)
    assert experiment.name == "toy-recipe"  # the recipe's name
    # params: the resolved config as dotted keys (as it was at the first launch: 2 epochs)
    config = C.flatten(yaml.safe_load((run_dir / "config-16.yaml").read_text()))
    assert set(run.data.params) == set(config)
    assert run.data.params["optim.lr"] == "0.01" and run.data.params["logging.mlflow"] == "true"
    assert run.data.params["trainer.epochs"] == "2" and run.data.params["task.name"] == "toy"
    # metrics: every number of every log point and evaluation, at its step, equal to metrics.jsonl's
    client, rid = tracked["client"], run.info.run_id
    assert first["metrics"]["eval/mse"][-1][0] == 16 and len(first["metrics"]) > 8
    for key, points in first["metrics"].items():
        logged = sorted((m.step, m.value) for m in client.get_metric_history(rid, key) if m.step <= 16)
        assert logged == points, key
    # artifacts: the run's files and every plot
    plots = {f"plots/{p.name}" for p in (run_dir / "plots").glob("*.png")}
    assert len(plots) >= 4 and plots <= first["artifacts"].keys()
    assert {"report.html", "summary.json", "config.yaml", "provenance.json"} <= first["artifacts"].keys()
    # the model: the final weights and the best checkpoint, as the run dir held them when the run ended
    assert first["artifacts"]["model.safetensors"] == first["sizes"]["model.safetensors"] > 0
    assert first["artifacts"]["checkpoints/best.pt"] == first["sizes"]["checkpoints/best.pt"] > 0
    assert "checkpoints/last.pt" not in first["artifacts"] and "model_ema.safetensors" not in first["artifacts"]
    assert run.data.tags["visiontrain.launches"] == "1"
    assert run.data.tags["visiontrain.command"].startswith("visiontrain fit ")
    assert run.data.tags["visiontrain.versions.mlflow"] == mlflow.__version__


@needs_mlflow
def test_a_resumed_run_continues_the_same_mlflow_run(tracked):
    run_dir, client = tracked["dir"], tracked["client"]
    runs = client.search_runs([client.get_experiment_by_name("toy-recipe").experiment_id])
    assert [r.info.run_id for r in runs] == [tracked["first"]["run"].info.run_id]  # one run in the experiment
    run = client.get_run(run_id(run_dir))
    assert run.info.status == "FINISHED"
    for key, points in histories(run_dir).items():  # now 24 steps: the first 16, then the resumed 8
        assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)) == points, key
    assert [s for s, _ in histories(run_dir)["eval/mse"]] == [8, 16, 24]
    assert "null" not in (run_dir / "metrics.jsonl").read_text()  # every value was compared
    assert run.data.params["trainer.epochs"] == "2"  # params stay; a change is a tag of the launch
    assert run.data.tags["changed_at_step_16.trainer.epochs"] == "3"
    assert run.data.tags["visiontrain.launches"] == "2" and run.data.tags["visiontrain.step"] == "16"
    launches = json.loads((run_dir / "provenance.json").read_text())["launches"]
    assert [la["step"] for la in launches] == [0, 16]
    assert launches[1]["resumed_from"].endswith("last.pt")


@needs_mlflow
def test_a_failing_run_ends_failed(tracked, tmp_path, capsys):
    path = recipe(tmp_path, task__poison_step=2)  # trainer.nonfinite=raise (the default) at step 4
    code = cli.main(["fit", path, "logging.mlflow=true", f"logging.mlflow_uri={tracked['uri']}",
                     "logging.mlflow_experiment=failures", "--run-dir", str(tmp_path / "run")])
    assert code == cli.EXIT_NONFINITE, capsys.readouterr().err
    client = tracked["client"]
    runs = client.search_runs([client.get_experiment_by_name("failures").experiment_id])
    assert [r.info.status for r in runs] == ["FAILED"]
    assert runs[0].info.run_id == run_id(tmp_path / "run")
    assert {"config.yaml", "provenance.json"} <= {a.path for a in client.list_artifacts(runs[0].info.run_id)}


@needs_mlflow
def test_the_weights_stay_out_when_asked_and_an_ema_run_sends_both(tracked, tmp_path):
    client = tracked["client"]
    for weights, ema in ((False, False), (True, True)):
        run_dir = tmp_path / f"run-{weights}"
        assert cli.main(["fit", recipe(tmp_path, ema__enabled=ema), "logging.mlflow=true",
                         f"logging.mlflow_uri={tracked['uri']}", f"logging.mlflow_weights={str(weights).lower()}",
                         "--run-dir", str(run_dir)]) == 0
        sent = {a.path for folder in (None, "checkpoints") for a in client.list_artifacts(run_id(run_dir), folder)}
        model = {"model.safetensors", "model_ema.safetensors", "checkpoints/best.pt", "checkpoints/best_ema.pt"}
        assert sent & model == (model if weights else set()) and "summary.json" in sent


def test_a_sharded_best_checkpoint_goes_with_the_directory_it_names(tmp_path):
    """Under FSDP best.pt holds the name of its step-S.dcp directory of shards, and is nothing without it."""
    import torch

    from visiontrain.engine.records.mlflow_tracker import weight_files
    from visiontrain.rundir import checkpoint_format as fmt

    ckpts = tmp_path / "checkpoints"
    for name in ("step-8.dcp", "step-16.dcp"):  # step-16: last.pt's, not the best's
        (ckpts / name).mkdir(parents=True)
        (ckpts / name / ".metadata").write_bytes(b"x")
    for name in ("best.pt", "best_ema.pt"):  # what an FSDP run's .pt file holds of its weights: their directory
        torch.save({fmt.FORMAT: fmt.FORMAT_VERSION, fmt.WEIGHTS: {fmt.SHARDED: {"dir": "step-8.dcp"}}}, ckpts / name)
    (tmp_path / "model.safetensors").write_bytes(b"w")
    assert weight_files(tmp_path) == [(tmp_path / "model.safetensors", None), (ckpts / "best.pt", "checkpoints"),
                                      (ckpts / "step-8.dcp", "checkpoints"), (ckpts / "best_ema.pt", "checkpoints")]


class StopAfter(Hook):
    """A stop signal arriving during step ``n``: the run writes last.pt and stops (Preempted)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def after_step(self) -> None:
        if self.trainer.step == self.n:
            self.trainer.stop.flag.requested, self.trainer.stop.flag.signum = True, signal.SIGTERM


@needs_mlflow
def test_a_stopped_run_ends_killed_and_its_resume_finishes_it(tracked, tmp_path):
    """Through the Trainer (no CLI): it makes its trackers from the config and ends them itself."""
    cfg = toy_config(logging__mlflow=True, logging__mlflow_uri=tracked["uri"], logging__mlflow_experiment="stops")
    run_dir = tmp_path / "run"
    with pytest.raises(Preempted):
        Trainer(cfg, ToyTask(cfg), run_dir, hooks=[StopAfter(5)]).fit()
    client = tracked["client"]
    assert client.get_run(run_id(run_dir)).info.status == "KILLED"
    Trainer(cfg, ToyTask(cfg), run_dir, resume=str(run_dir / "checkpoints" / "last.pt")).fit()
    runs = client.search_runs([client.get_experiment_by_name("stops").experiment_id])
    assert [(r.info.run_id, r.info.status) for r in runs] == [(run_id(run_dir), "FINISHED")]
    assert sorted(m.step for m in client.get_metric_history(run_id(run_dir), "train/total")) == [4, 8, 12, 16]


@needs_mlflow
def test_mlflow_failing_mid_run_is_one_warning_and_training_goes_on(tracked, tmp_path, monkeypatch, caplog):
    def refuse_metrics(self, run_id, metrics=(), **kwargs):
        if metrics:
            raise mlflow.exceptions.MlflowException("the store went away")
        return real(self, run_id, metrics=metrics, **kwargs)

    real = MlflowClient.log_batch
    monkeypatch.setattr(MlflowClient, "log_batch", refuse_metrics)
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="visiontrain"):
        assert cli.main(["fit", recipe(tmp_path), "logging.mlflow=true", f"logging.mlflow_uri={tracked['uri']}",
                         "logging.mlflow_experiment=flaky", "--run-dir", str(run_dir)]) == 0
    warnings = [r.getMessage() for r in caplog.records if "MLflow" in r.getMessage()]
    assert len(warnings) == 1 and "the store went away" in warnings[0] and "training goes on" in warnings[0]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 16  # the run itself is complete
    assert [s for s, _ in histories(run_dir)["eval/mse"]] == [8, 16]


def test_missing_mlflow_or_a_bad_uri_is_an_error_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # `import mlflow` fails as where it is not installed
    run_dir = tmp_path / "run"
    assert cli.main(["fit", recipe(tmp_path), "logging.mlflow=true", "--run-dir", str(run_dir)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "logging.mlflow=true needs MLflow" in err and "pip install 'visiontrain[mlflow]'" in err
    assert not run_dir.exists()  # nothing written
    monkeypatch.undo()
    if mlflow is None:
        return
    assert cli.main(["fit", recipe(tmp_path), "logging.mlflow=true", "logging.mlflow_uri=runs/x.db",
                     "--run-dir", str(run_dir)]) == cli.EXIT_USAGE
    assert "logging.mlflow_uri='runs/x.db' is not a tracking URI" in capsys.readouterr().err
    assert not run_dir.exists()


def test_params_are_truncated_and_named_as_mlflow_allows():
    params = params_of({"optim": {"lr": 0.1, "lr_mult": {r"^backbone\.": 0.1}}, "data": {"root": "x" * 7000},
                        "schedules": {}})
    assert params["optim.lr"] == "0.1"
    assert json.loads(params["optim.lr_mult"]) == {r"^backbone\.": 0.1}  # keyed by regexes: one param, as JSON
    assert len(params["data.root"]) == MAX_PARAM and params["data.root"].endswith("...")
    assert set(params) == {"optim.lr", "optim.lr_mult", "data.root"}
    assert name("lr/a*b") == "lr/a_b" and name("eval//x/../y") == "eval/_/x/_/y"


def test_show_config_lists_the_logging_keys(capsys):
    assert cli.main(["show-config", "classify-fashion", "--docs"]) == 0
    out = capsys.readouterr().out
    assert all(f"logging.{k}" in out for k in ("mlflow ", "mlflow_uri", "mlflow_experiment"))


@needs_mlflow
def test_only_numbers_are_sent(tracked):
    """An evaluation may carry a per-class dict (or a flag); MLflow gets its numbers only."""
    tracker = MlflowTracker(LoggingConfig(mlflow=True, mlflow_uri=tracked["uri"], mlflow_experiment="numbers"),
                            tracked["root"] / "numbers", "unused")
    (tracked["root"] / "numbers").mkdir()
    tracker.start({"seed": 0}, {"launches": [{"command": "visiontrain fit x"}]}, 0)
    tracker.log("eval", 3, 0, {"mAP": 0.5, "per_class": {"cat": 0.4}, "flag": True, "note": "x", "APs": math.nan})
    tracker.end("FINISHED")
    run = tracked["client"].get_run(tracker.run_id)
    assert run.data.metrics == {"eval/mAP": 0.5} and run.info.status == "FINISHED"
