"""The catalogue: every module that registers something a config or a run looks up by name.

A recipe names its sections (``trainer:``), its data source (``data.name: coco``), its task
(``task.name: detr``), keys another module adds to a section (``eval.coco_backend``) and its
trackers; each is registered by the module that defines it (``config.register_section``,
``register_kind``, ``extend_section``, ``register_task``, ``register_tracker``, ``register_part``).
Which of them a process had imported used to decide what a config could hold: a script that
imported ``Trainer`` first could not load a built-in recipe. Now every config loader
(``load_config``, ``config_from_dict``, ``Config()``) calls :func:`load` first, which imports the
modules below, so a config means the same whichever public module was imported first.

A user's own module (a task, a part, a data source) is imported with :func:`import_user`, by the
CLI's ``--import MODULE`` (and by every rank of a ``--nproc`` launch), or by the user's script.
"""
from __future__ import annotations

import importlib
import os
import sys
import threading
from pathlib import Path

from visiontrain.core.typed_config import ConfigError

#: Every built-in registering module, lowest room first, with what it registers.
BUILT_IN: dict[str, str] = {
    "visiontrain.engine.protocols.task": "the task section, typed by task.name",
    "visiontrain.engine.parallel.distributed": "the distributed section",
    "visiontrain.engine.step.trainer_config": "the trainer section",
    "visiontrain.engine.optim.param_groups": "the optim section",
    "visiontrain.engine.optim.schedules": "the schedules section",
    "visiontrain.engine.step.ema": "the ema section",
    "visiontrain.engine.records.mlflow_tracker": "the logging section and the MLflow tracker",
    "visiontrain.engine.parts.evaluator": "the eval section",
    "visiontrain.engine.parts.checkpointer": "the checkpoint section",
    "visiontrain.engine.loop.assembly": "the parts every run has, in order",
    "visiontrain.data.section": "the data section, typed by data.name",
    "visiontrain.data.datasets.sources": "data kinds: the classification datasets and image folders",
    "visiontrain.data.detection.sources": "data kinds: the detection datasets (COCO, VOC, YOLO, fashion-mosaic)",
    "visiontrain.data.shards.source": "data kind: shards",
    "visiontrain.data.segmentation.sources": "data kinds: the semantic segmentation sources (a segmentation "
                                             "folder, VOC's SegmentationClass, ...) and COCO panoptic",
    "visiontrain.evaluation.coco": "eval.coco_backend, a key of the engine's eval section",
    "visiontrain.tasks.classification": "task: classification",
    "visiontrain.tasks.detr": "task: detr",
    "visiontrain.tasks.rcnn": "task: rcnn",
    "visiontrain.tasks.mask_rcnn": "task: mask_rcnn",
    "visiontrain.tasks.yolo": "task: yolo",
    "visiontrain.tasks.dino": "task: dino",
    "visiontrain.tasks.semantic": "task: semantic",
    "visiontrain.tasks.panoptic": "task: panoptic",
}

_lock = threading.RLock()
_loaded = False


def load() -> None:
    """Import every module of :data:`BUILT_IN`, once a process. A loader that runs while they are
    being imported (a module that builds a config as it is imported) finds the catalogue loading and
    goes on with what is registered so far."""
    global _loaded
    with _lock:
        if _loaded:
            return
        _loaded = True
        try:
            for name in BUILT_IN:
                importlib.import_module(name)
        except BaseException:
            _loaded = False
            raise


def import_user(spec: str) -> None:
    """A user's module (``--import``): by name, or a .py file by path. Either way it is imported under
    its own name from a directory put on sys.path, never as ``__main__``: DataLoader workers started
    from a forkserver find its classes by that name, and its main block does not run."""
    load()  # the built-in registrations first: a user's module may extend a section or replace a kind
    if spec.endswith(".py") or os.sep in spec:
        path = Path(spec)
        if not path.is_file():
            raise ConfigError(f"--import {spec}: no such file")
        directory, name = str(path.resolve().parent), path.stem
    else:
        directory, name = os.getcwd(), spec
    if directory not in sys.path:
        sys.path.insert(0, directory)
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name != name:
            raise  # the module itself imports something missing: its own traceback says what
        raise ConfigError(f"--import {spec}: no module named {name!r} in the current directory or on "
                          f"sys.path (give a .py file's path, or a module name)") from None
