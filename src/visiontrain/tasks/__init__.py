"""The built-in tasks. Importing this package registers each (``engine.protocols.task.register_task``, called
in the task's own module); ``build_task`` builds whichever task a config names, a user's included."""
from __future__ import annotations

from visiontrain.config import Config
from visiontrain.engine.loop import trainer  # noqa: F401  (the parts and data sources register their sections)
from visiontrain.engine.protocols.task import Task, TaskData, registered_task
from visiontrain.tasks import classification, detr, dino, mask_rcnn, rcnn, yolo  # noqa: F401  (each registers itself)


def build_task(cfg: Config) -> Task:
    """The task ``cfg.task.name`` names, built from ``cfg``."""
    return registered_task(cfg.task.name).task_class(cfg)


__all__ = ["Task", "TaskData", "build_task"]
