"""The build phase: a run's objects made once from (config, task) before its first step
(``training.build_training``; ``build_evaluation`` for ``validate``), from the device and seeds
(``placement``), the training source and evaluation loader (``loaders``), and the check that a
dataset can reach its workers (``worker_check``)."""
