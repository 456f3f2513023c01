"""Task registry: ``task.name`` -> Task class. Importing this registers every task's config."""
from __future__ import annotations

import difflib

from visiontrain.config import Config
from visiontrain.engine.task import Task, TaskData
from visiontrain.tasks.classification import ClassificationTask
from visiontrain.tasks.detr import DetrTask
from visiontrain.tasks.dino import DinoTask
from visiontrain.tasks.rcnn import RcnnTask
from visiontrain.tasks.yolo import YoloTask

TASKS: dict[str, type[Task]] = {"classification": ClassificationTask, "detr": DetrTask, "rcnn": RcnnTask,
                                "yolo": YoloTask, "dino": DinoTask}


def build_task(cfg: Config) -> Task:
    cls = TASKS.get(cfg.task.name)
    if cls is None:
        close = difflib.get_close_matches(cfg.task.name, list(TASKS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"task.name: unknown task {cfg.task.name!r}{hint}; expected one of {', '.join(TASKS)}")
    return cls(cfg)


__all__ = ["TASKS", "Task", "TaskData", "build_task"]
