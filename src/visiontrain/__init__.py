"""visiontrain: one PyTorch training engine for classification, detection and self-supervised
vision models. ``visiontrain fit RECIPE`` trains; see the README.

Inference from Python (docs/inference.md): ``from visiontrain import Predictor`` (and ``predict_tiled``,
sliced prediction on large images). A task of your own
(docs/custom-task.md): ``from visiontrain import EvalData, Task, TaskConfig, TaskData, register_task``;
a hook of your own (``trainer.hooks``): ``from visiontrain import Cadence, Hook``; a training data
source: ``TrainSource``; training from Python (docs/custom-task.md): ``load_config``, ``build_task``,
``Trainer``. These names stay where they are when the engine's files move. They are imported on first
use, so ``import visiontrain`` stays cheap (no torch).
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {"Predictor": "visiontrain.use.inference", "Classification": "visiontrain.use.inference",
         "ClassScore": "visiontrain.use.inference", "Detections": "visiontrain.use.inference",
         "predict_tiled": "visiontrain.use.tiled",
         "Hook": "visiontrain.engine.protocols.hooks", "Cadence": "visiontrain.engine.protocols.cadence",
         "Task": "visiontrain.engine.protocols.task", "TaskConfig": "visiontrain.engine.protocols.task",
         "TaskData": "visiontrain.engine.protocols.task",
         "ExportSpec": "visiontrain.engine.protocols.task", "Prediction": "visiontrain.engine.protocols.task",
         "register_task": "visiontrain.engine.protocols.task", "EvalData": "visiontrain.engine.step.eval_loop",
         "TrainSource": "visiontrain.engine.step.source", "Trainer": "visiontrain.engine.loop.trainer",
         "load_config": "visiontrain.core.config", "build_task": "visiontrain.tasks"}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'visiontrain' has no attribute {name!r}")
