"""The layout of a run dir, spelled once: the name of each file and folder a run writes. The engine
writes them; ``compare``, ``report`` and the CLI find them through these names. Free of torch (as
``metrics_file`` is), so that those readers load no training stack.

    RUN_DIR/
      config.yaml           CONFIG_FILE: the resolved config of the run
      metrics.jsonl         METRICS_FILE: a row per log window and per evaluation (engine.records.metrics_file)
      summary.json          SUMMARY_FILE: the finished run's figures
      model_summary.json    MODEL_SUMMARY_FILE: parameters and FLOPs (engine.records.first_look)
      provenance.json       PROVENANCE_FILE: every launch of the run (engine.records.provenance)
      report.html           REPORT_FILE: ``visiontrain report``
      plots/                PLOTS_DIR: curves, previews and the task's figures
      tb/, profile/         TENSORBOARD_DIR, PROFILE_DIR
      model.safetensors, model_ema.safetensors   FINAL_WEIGHTS: the weights at the end
      .lock                 LOCK_FILE: held by the training that writes the run dir (engine.state.run_lock)
      checkpoints/          CHECKPOINTS_DIR: LAST_CHECKPOINT, BEST_CHECKPOINT, BEST_EMA_CHECKPOINT, best-stepS.pt
      mlflow.db, mlflow.json, mlflow-artifacts/   MLFLOW_FILES: a local MLflow store (engine.records.mlflow_tracker)
"""
from __future__ import annotations

CONFIG_FILE = "config.yaml"
LOCK_FILE = ".lock"
METRICS_FILE = "metrics.jsonl"
PROVENANCE_FILE = "provenance.json"
SUMMARY_FILE = "summary.json"
MODEL_SUMMARY_FILE = "model_summary.json"
REPORT_FILE = "report.html"
PLOTS_DIR = "plots"
TENSORBOARD_DIR = "tb"
PROFILE_DIR = "profile"
FINAL_WEIGHTS = ("model.safetensors", "model_ema.safetensors")
CHECKPOINTS_DIR = "checkpoints"
LAST_CHECKPOINT = "last.pt"
BEST_CHECKPOINT = "best.pt"
BEST_EMA_CHECKPOINT = "best_ema.pt"
MLFLOW_DB_FILE, MLFLOW_RUN_FILE, MLFLOW_ARTIFACT_DIR = "mlflow.db", "mlflow.json", "mlflow-artifacts"
MLFLOW_FILES = (MLFLOW_DB_FILE, MLFLOW_RUN_FILE, MLFLOW_ARTIFACT_DIR)

__all__ = ["BEST_CHECKPOINT", "BEST_EMA_CHECKPOINT", "CHECKPOINTS_DIR", "CONFIG_FILE", "FINAL_WEIGHTS",
           "LAST_CHECKPOINT", "LOCK_FILE", "METRICS_FILE", "MLFLOW_ARTIFACT_DIR", "MLFLOW_DB_FILE", "MLFLOW_FILES",
           "MLFLOW_RUN_FILE", "MODEL_SUMMARY_FILE", "PLOTS_DIR", "PROFILE_DIR", "PROVENANCE_FILE", "REPORT_FILE",
           "SUMMARY_FILE", "TENSORBOARD_DIR"]
