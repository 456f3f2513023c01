"""What a run writes for people, and the readers of it: the text log, console and TensorBoard
(``run_log``), metrics.jsonl's schema and its one reader (``metrics_file``), trackers (``tracking``;
MLflow in ``mlflow_tracker``), provenance.json, curves (``plots``), the profiler's traces and the first
look at the data and model. ``report`` and ``compare`` read runs through this room."""
