"""What a run writes for people: the text log, console and TensorBoard (``run_log``), trackers
(``tracking``; MLflow in ``mlflow_tracker``), provenance.json, curves (``plots``), the profiler's traces
and the first look at the data and model. metrics.jsonl's schema and its one reader are
``visiontrain.rundir.metrics_file``'s."""
