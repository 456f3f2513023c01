"""Using a trained run: the model rebuilt from a checkpoint (``trained``, the one path of validate,
predict and export), the Python API (``inference.Predictor``), ``predict`` and ``export``."""
