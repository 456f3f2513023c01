"""What visiontrain's registries hold, taken and put back around each test (tests/conftest.py), so a
test that registers a task, a data kind, a section, a part or a tracker of its own cleans up nothing by
hand. The built-in registrations are made first (``visiontrain.catalog``): a snapshot taken before them
would take them out again while the catalogue counts itself loaded."""
from __future__ import annotations

import dataclasses
from typing import Any

from visiontrain import catalog
from visiontrain.core import config as C
from visiontrain.engine.loop import assembly
from visiontrain.engine.protocols import task
from visiontrain.engine.records import tracking


def snapshot() -> dict[str, Any]:
    catalog.load()
    return {"sections": {name: dataclasses.replace(s, kinds=dict(s.kinds)) for name, s in C.SECTIONS.items()},
            "extra_keys": dict(C.EXTRA_KEYS), "tasks": dict(task.TASK_REGISTRY), "parts": list(assembly.PARTS),
            "trackers": list(tracking.TRACKERS)}


def restore(before: dict[str, Any]) -> None:
    """Put back what ``snapshot`` took, into the same objects (modules hold them by reference)."""
    for live, kept in ((C.SECTIONS, before["sections"]), (C.EXTRA_KEYS, before["extra_keys"]),
                       (task.TASK_REGISTRY, before["tasks"])):
        live.clear()
        live.update(kept)
    assembly.PARTS[:] = before["parts"]
    tracking.TRACKERS[:] = before["trackers"]
