"""MLflow as a tracker (``logging.mlflow=true``): params, metrics, artifacts, tags and the status.

What goes where:
- params: the resolved config as dotted keys (``optim.lr``); a value longer than MLflow's limit
  (6000 characters) is truncated, ending in ``...`` (config.yaml, an artifact, holds it whole); a
  mapping keyed by regexes (``optim.lr_mult``) is one param holding it as JSON;
- metrics: every number of every log point and evaluation, as ``train/<key>`` and ``eval/<key>``
  at the optimizer step, the names TensorBoard shows; anything else (a per-class dict) is skipped,
  and so is a NaN or infinity, a missing value (null) in metrics.jsonl, a gap in MLflow's charts;
- tags: this launch's provenance as ``visiontrain.*`` (and MLflow's own git-commit tag);
- artifacts, when the run ends: config.yaml, provenance.json, summary.json, report.html and
  ``plots/*.png``, as they are then, and (``logging.mlflow_weights``) the model: the final weights
  (model.safetensors, model_ema.safetensors) and the best checkpoints (checkpoints/best.pt,
  best_ema.pt; an FSDP run's with the ``step-S.dcp`` directory each names), whichever exist; then
  the status: FINISHED, FAILED or KILLED.

The store is ``sqlite:///RUN_DIR/mlflow.db`` unless ``logging.mlflow_uri`` names another: this
MLflow refuses its file store (in maintenance mode) unless told otherwise. A new SQLite store costs
its table migrations (1.5 s on two idle cores, 7 s on busy ones), which is why every MLflow call runs
on one worker thread, in order: training goes on meanwhile, and a slow server never holds up a step.
Several processes may write one SQLite store at once (``tune --jobs K`` gives its trials the study's):
SQLite takes their writes one at a time, and nothing is lost (tests/tune/test_tune.py runs four). What
it does not survive is a new store created by several at once: each finds no tables and runs the
migrations, and all but one fail on the others' (three runs of four lost, measured). So a process
opens a local SQLite store under a lock of its directory (``store_lock``): the first creates it, the
others find it made. No ``mlflow server`` is needed for that, nor stores merged afterwards: the
server would sit on the same SQLite file, and merging would give the UI nothing until the study ends.
The run's id is kept in ``RUN_DIR/mlflow.json``, where ``--resume`` finds it and continues the same
MLflow run.

MLflow failing (a store that cannot be opened, a server gone) never stops training: the first
error is one warning, and the run goes on logging to its run dir only.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from visiontrain.core.config import ConfigError, flatten, register_section
from visiontrain.core.redact import redact_url, scrub
from visiontrain.core.typed_config import doc
from visiontrain.engine.records.tracking import register_tracker
from visiontrain.engine.state.checkpoint import write_run_file
from visiontrain.rundir.metrics_file import is_number
from visiontrain.rundir.run_files import (BEST_CHECKPOINT, BEST_EMA_CHECKPOINT, CHECKPOINTS_DIR, CONFIG_FILE,
                                          FINAL_WEIGHTS, MLFLOW_ARTIFACT_DIR, MLFLOW_DB_FILE, MLFLOW_RUN_FILE,
                                          PLOTS_DIR, PROVENANCE_FILE, REPORT_FILE, SUMMARY_FILE)


@dataclass
class LoggingConfig:
    """Where a run's metrics go besides its run dir (metrics.jsonl, TensorBoard, the console)."""

    mlflow: bool = doc("also record the run in MLflow: the config as params, every logged metric, the plots, "
                       "report and summary as artifacts, the launch as tags, the final status (rank 0; needs "
                       "pip install 'visiontrain[mlflow]')", False)
    mlflow_uri: str | None = doc("MLflow tracking URI (sqlite:///PATH.db, http://HOST:PORT, ...); default "
                                 "sqlite:///RUN_DIR/mlflow.db, a store of the run's own", None)
    mlflow_experiment: str | None = doc("MLflow experiment name (default: the recipe's name, else the run "
                                        "dir's)", None)
    mlflow_weights: bool = doc("with logging.mlflow: when the run ends, also send the final weights "
                               "(model.safetensors, model_ema.safetensors) and the best checkpoints "
                               "(checkpoints/best.pt, best_ema.pt) as artifacts; false keeps them off a remote "
                               "server", True)


register_section("logging", LoggingConfig, "experiment tracking section (MLflow)")

log = logging.getLogger("visiontrain")

INSTALL = "pip install 'visiontrain[mlflow]'"
ARTIFACTS = (CONFIG_FILE, PROVENANCE_FILE, SUMMARY_FILE, REPORT_FILE)
#: The model, sent with ``logging.mlflow_weights``: the final weights (run dir) and the best checkpoints.
BEST_CHECKPOINTS = (BEST_CHECKPOINT, BEST_EMA_CHECKPOINT)
#: MLflow's limits (mlflow.utils.validation).
MAX_PARAM, MAX_TAG, MAX_KEY, PER_BATCH, METRICS_PER_BATCH = 6000, 8000, 250, 100, 1000
NOT_IN_A_NAME = re.compile(r"[^\w.\- :/]")


def require_mlflow() -> Any:
    """The mlflow module, or a ConfigError that says how to install it."""
    try:
        import mlflow
    except ImportError as err:
        raise ConfigError(f"logging.mlflow=true needs MLflow, which cannot be imported ({err}): "
                          f"{INSTALL}") from None
    return mlflow


def tracking_uri(settings: LoggingConfig, run_dir: Path) -> str:
    """``logging.mlflow_uri``, else the run dir's own SQLite store; a path where a URI belongs, or
    the file store this MLflow refuses, is a ConfigError naming the key."""
    uri = settings.mlflow_uri
    if uri is None:
        return f"sqlite:///{(run_dir / MLFLOW_DB_FILE).absolute()}"
    if "://" not in uri and uri != "databricks":
        raise ConfigError(f"logging.mlflow_uri={uri!r} is not a tracking URI: a local database is "
                          f"sqlite:///PATH/mlflow.db, a server http://HOST:PORT")
    if uri.startswith("file:") and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("1", "true"):
        raise ConfigError(f"logging.mlflow_uri={uri!r}: MLflow's file store is in maintenance mode and refused "
                          f"by default; use sqlite:///PATH/mlflow.db (or set MLFLOW_ALLOW_FILE_STORE=true)")
    return uri


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """Held while a process opens the store at ``uri``: for a local SQLite file, an exclusive lock
    (``flock``) of the directory that holds it, so that one process at a time creates (migrates) it;
    nothing for any other store, whose server or database is made once, elsewhere. The directory, not
    a lock file: a run dir holds only the files run_files names, and nothing is left behind."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    folder = Path(uri.removeprefix("sqlite:///").split("?")[0]).absolute().parent
    folder.mkdir(parents=True, exist_ok=True)  # as MLflow would make it
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # and the lock with it


def name(key: str) -> str:
    """``key`` as a valid MLflow param, metric or tag name: characters MLflow refuses become ``_``,
    and so do empty, ``.`` and ``..`` path segments (a name must not resolve to another)."""
    parts = NOT_IN_A_NAME.sub("_", key).split("/")
    return "/".join(p if p not in ("", ".", "..") else "_" for p in parts)[:MAX_KEY]


def text(value: Any, limit: int) -> str:
    """A param or tag value: a string as is, anything else as JSON; past ``limit``, cut and ``...``."""
    out = value if isinstance(value, str) else json.dumps(value)
    return out if len(out) <= limit else out[:limit - 3] + "..."


def unnameable_keys(node: dict[str, Any]) -> bool:
    """Whether a mapping has a key MLflow cannot name (a regex: ``optim.lr_mult``'s ``^head\\.``)."""
    return any(name(str(k)) != str(k) for k in node)


def params_of(config: dict[str, Any]) -> dict[str, str]:
    """The config as MLflow params: dotted keys, truncated values; a mapping with keys MLflow cannot
    name is one param, as JSON."""
    return {name(k): text(v, MAX_PARAM) for k, v in flatten(config, whole=unnameable_keys).items()}


def tags_of(provenance: dict[str, Any]) -> dict[str, str]:
    """The last launch's provenance as ``visiontrain.*`` tags, the number of launches, and MLflow's
    own source tags (the UI shows them)."""
    launches = provenance.get("launches") or [{}]
    launch = launches[-1]
    tags = {name(f"visiontrain.{k}"): text(v, MAX_TAG) for k, v in flatten(launch).items() if v is not None}
    tags["visiontrain.launches"] = str(len(launches))
    tags["mlflow.source.name"] = text(launch.get("command") or "", MAX_TAG)
    if launch.get("git"):
        tags["mlflow.source.git.commit"] = launch["git"]["commit"]
    return tags


def weight_files(run_dir: Path) -> list[tuple[Path, str | None]]:
    """(file or directory, artifact folder) of the model as the run dir holds it now: the final weights,
    the best checkpoints, and for an FSDP run the directory of shards each best checkpoint names."""
    files: list[tuple[Path, str | None]] = [(run_dir / f, None) for f in FINAL_WEIGHTS if (run_dir / f).is_file()]
    ckpts = run_dir / CHECKPOINTS_DIR
    sharded = any(ckpts.glob("step-*.dcp"))  # only then is a .pt small and worth opening
    for path in (ckpts / f for f in BEST_CHECKPOINTS):
        if not path.is_file():
            continue
        files.append((path, CHECKPOINTS_DIR))
        if sharded:
            from visiontrain.engine.state.checkpoint import load_checkpoint
            from visiontrain.engine.state.sharded import dcp_path
            from visiontrain.rundir.checkpoint_format import sharded_record

            record = sharded_record(load_checkpoint(path, resolve_sharded=False))
            if record is not None and (ckpts / str(record["dir"]), CHECKPOINTS_DIR) not in files:
                files.append((dcp_path(ckpts, record), CHECKPOINTS_DIR))
    return files


def chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


class MlflowTracker:
    """An ``engine.records.tracking.Tracker`` that records the run in MLflow (this module's docstring)."""

    packages = ("mlflow",)

    def __init__(self, settings: LoggingConfig, run_dir: Path, experiment: str) -> None:
        """Checks now (a ConfigError before anything runs) that MLflow imports and the URI is one."""
        require_mlflow()
        self.run_dir, self.uri = run_dir, tracking_uri(settings, run_dir)
        self.experiment = settings.mlflow_experiment or experiment
        self.send_weights = settings.mlflow_weights
        if not self.experiment.strip():
            raise ConfigError("logging.mlflow_experiment='': an experiment needs a name")
        self.run_id: str | None = None
        self.client: Any = None
        self._worker: ThreadPoolExecutor | None = None
        self._failed = False

    # ------------------------------------------------------------------ the training thread's side
    def start(self, config: dict[str, Any], provenance: dict[str, Any], step: int) -> None:
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="visiontrain-mlflow")
        self._submit(self._open, config, provenance, step, int(time.time() * 1000))

    def log(self, kind: str, step: int, epoch: int, values: dict[str, Any]) -> None:
        metrics = [(name(f"{kind}/{k}"), float(v)) for k, v in values.items() if is_number(v) and math.isfinite(v)]
        if metrics:
            self._submit(self._log_metrics, metrics, int(time.time() * 1000), step)

    def end(self, status: str) -> None:
        """Sends the run's files and the status, and waits until MLflow has them."""
        if self._worker is None:
            return
        self._submit(self._close, status)
        worker, self._worker = self._worker, None
        worker.shutdown(wait=True)

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        if self._worker is not None and not self._failed:
            self._worker.submit(self._guarded, fn, *args)

    # ------------------------------------------------------------------ the worker thread's side
    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        if self._failed:
            return
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 - a tracker never stops training
            self._failed = True
            why = scrub(str(err).strip(), self.uri)[:500]
            log.warning(f"visiontrain: warning: MLflow ({redact_url(self.uri)}) failed: {type(err).__name__}: "
                        f"{why}; training goes on, and this run logs nothing more to "
                        f"MLflow (its run dir has everything)")

    def _open(self, config: dict[str, Any], provenance: dict[str, Any], step: int, started: int) -> None:
        from mlflow import MlflowClient

        for noisy in ("mlflow.store.db.utils", "alembic"):  # a new store's migrations, line by line
            logging.getLogger(noisy).setLevel(logging.WARNING)
        with store_lock(self.uri):
            self.client = client = MlflowClient(tracking_uri=self.uri)
            client.search_experiments(max_results=1)  # opens the store: a new one is created here, alone
        run = self._continued()
        if run is None:
            run = client.create_run(self._experiment_id(), start_time=started, run_name=self.run_dir.resolve().name)
            write_run_file(self.run_dir, MLFLOW_RUN_FILE, json.dumps(
                {"tracking_uri": self.uri, "experiment_id": run.info.experiment_id, "run_id": run.info.run_id}))
        else:
            client.update_run(run.info.run_id, status="RUNNING")
        self.run_id = run.info.run_id
        logged, params = run.data.params, params_of(config)
        changed = {name(f"changed_at_step_{step}.{k}"): v for k, v in params.items() if logged.get(k, v) != v}
        self._log_batch(params={k: v for k, v in params.items() if k not in logged},
                        tags={**tags_of(provenance), **changed})

    def _continued(self) -> Any:
        """The MLflow run an earlier launch of this run dir started, if it is in this store."""
        path = self.run_dir / MLFLOW_RUN_FILE
        if not path.is_file():
            return None
        from mlflow.exceptions import MlflowException

        saved = json.loads(path.read_text())
        why = f"is in {redact_url(str(saved.get('tracking_uri')))}, not in {redact_url(self.uri)}"
        if saved.get("tracking_uri") == self.uri:
            try:
                run = self.client.get_run(saved["run_id"])
            except MlflowException as err:
                run, why = None, f"cannot be read ({err.error_code})"
            if run is not None and run.info.lifecycle_stage == "active":
                return run
            if run is not None:
                why = "was deleted"
        log.info(f"visiontrain: MLflow run {saved.get('run_id')} of an earlier launch {why}: starting a new one")
        return None

    def _experiment_id(self) -> str:
        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(self.experiment, artifact_location=self._artifact_location())
        except Exception:  # noqa: BLE001 - made meanwhile by another run of the same store
            found = self.client.get_experiment_by_name(self.experiment)
            if found is None:
                raise
            return found.experiment_id

    def _artifact_location(self) -> str | None:
        """Beside the store for a local SQLite file (MLflow's default is ./mlruns, wherever the
        process runs); the server's choice otherwise."""
        if not self.uri.startswith("sqlite:///"):
            return None
        return (Path(self.uri.removeprefix("sqlite:///")).absolute().parent / MLFLOW_ARTIFACT_DIR).as_uri()

    def _log_batch(self, params: dict[str, str], tags: dict[str, str]) -> None:
        from mlflow.entities import Param, RunTag

        for batch in chunks([Param(k, v) for k, v in params.items()], PER_BATCH):
            self.client.log_batch(self.run_id, params=batch)
        for batch in chunks([RunTag(k, v) for k, v in tags.items()], PER_BATCH):
            self.client.log_batch(self.run_id, tags=batch)

    def _log_metrics(self, metrics: list[tuple[str, float]], timestamp: int, step: int) -> None:
        from mlflow.entities import Metric

        for batch in chunks([Metric(k, v, timestamp, step) for k, v in dict(metrics).items()], METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=batch)

    def _close(self, status: str) -> None:
        plots = self.run_dir / PLOTS_DIR
        files = [(self.run_dir / f, None) for f in ARTIFACTS if (self.run_dir / f).is_file()]
        files += [(p, str(p.parent.relative_to(self.run_dir))) for p in sorted(plots.rglob("*.png"))] \
            if plots.is_dir() else []
        files += weight_files(self.run_dir) if self.send_weights else []
        for path, folder in files:
            if path.is_dir():  # a directory of shards keeps its name
                self.client.log_artifacts(self.run_id, str(path), artifact_path=f"{folder}/{path.name}")
            else:
                self.client.log_artifact(self.run_id, str(path), artifact_path=folder)
        self.client.set_terminated(self.run_id, status)


@register_tracker
def mlflow_for_run(cfg: Any, run_dir: Path, experiment: str) -> MlflowTracker | None:
    """The tracker backend ``logging.mlflow`` asks for (registered when this module is imported)."""
    return MlflowTracker(cfg.logging, run_dir, experiment) if cfg.logging.mlflow else None
