"""The built-in tasks, each registered by its own module (``engine.protocols.task.register_task``) and
named in ``visiontrain.catalog``; ``build_task`` builds whichever task a config names, a user's included."""
from __future__ import annotations

from visiontrain.core.config import Config
from visiontrain.engine.protocols.task import Task, TaskData, check_needs, registered_task


def build_task(cfg: Config) -> Task:
    """The task ``cfg.task.name`` names, built from ``cfg`` (a ``Config`` has every built-in task
    registered: ``visiontrain.catalog``), once what it needs of the rest of the run is checked."""
    task_class = registered_task(cfg.task.name).task_class
    check_needs(task_class, cfg)
    return task_class(cfg)


__all__ = ["Task", "TaskData", "build_task"]
