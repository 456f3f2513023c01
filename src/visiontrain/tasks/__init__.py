"""The built-in tasks, each registered by its own module (``engine.protocols.task.register_task``) and
named in ``visiontrain.catalog``; ``build_task`` builds whichever task a config names, a user's included."""
from __future__ import annotations

from visiontrain.core.config import Config
from visiontrain.engine.protocols.task import Task, TaskData, registered_task


def build_task(cfg: Config) -> Task:
    """The task ``cfg.task.name`` names, built from ``cfg`` (a ``Config`` has every built-in task
    registered: ``visiontrain.catalog``)."""
    return registered_task(cfg.task.name).task_class(cfg)


__all__ = ["Task", "TaskData", "build_task"]
