"""visiontrain: one PyTorch training engine for classification, detection and self-supervised
vision models. ``visiontrain fit RECIPE`` trains; see the README.

Inference from Python (docs/inference.md): ``from visiontrain import Predictor``. A hook of your own
(``trainer.hooks``, docs/custom-task.md): ``from visiontrain import Cadence, Hook``. The names below
are imported on first use, so ``import visiontrain`` stays cheap (no torch).
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {"Predictor": "visiontrain.inference", "Classification": "visiontrain.inference",
         "ClassScore": "visiontrain.inference", "Detections": "visiontrain.inference",
         "Hook": "visiontrain.engine.protocols.hooks", "Cadence": "visiontrain.engine.protocols.cadence"}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'visiontrain' has no attribute {name!r}")
