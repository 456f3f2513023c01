"""Refuse at start-up what a forkserver or spawned DataLoader worker could not receive.

Such a worker is a fresh process: it gets the dataset (with its transforms), the collate function
and the worker init function pickled, and imports every class and function they name by module.
A lambda or a local function anywhere inside them, or a class defined in a notebook, otherwise
fails as a traceback from inside multiprocessing at the first batch, or at the first evaluation
minutes into a run. Here the same objects are pickled once before training, into nothing and
without their tensors' bytes, and a failure names the object's path (e.g.
``training dataset.transform.transforms[2].labels_getter``) and the way out, in one line.
"""
from __future__ import annotations

import ast
import io
import pickle
import sys
import types
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from visiontrain.core.config import ConfigError

_MAX_DEPTH = 40  # how deep the search for the culprit descends (object graphs of datasets are shallow)


class _NotImportable(pickle.PicklingError):
    """A class or function a worker would have to import from a main module it cannot import."""


def main_importable(start: str) -> bool:
    """Whether a ``start`` worker can import the training process's ``__main__``: a spawned one runs
    a main *file* again (not its main block); the forkserver preloads it unless it was started with
    ``python -m`` (which it does not re-run); nobody can import a notebook's or a REPL's."""
    main = sys.modules.get("__main__")
    has_file = getattr(main, "__file__", None) is not None
    return has_file and (start == "spawn" or getattr(main, "__spec__", None) is None)


def _is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":`` (either side of the ``==``)."""
    if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
            and isinstance(node.test.ops[0], ast.Eq)):
        return False
    sides = [node.test.left, *node.test.comparators]
    return any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides) and \
        any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)


def unguarded_main_line() -> str | None:
    """``FILE:LINE`` of the main script's top-level statement that is running now, when it does not
    sit under ``if __name__ == "__main__":``. A forkserver or spawned DataLoader worker runs the main
    script again (the forkserver preloads it; a spawned worker, or a forkserver's under ``python -m
    pkg.mod``, imports it), and that statement with it: a second training inside the worker, which
    dies. None where no worker runs the main module (``python -c``, a notebook, a package's
    ``__main__``) or the statement is guarded."""
    main = sys.modules.get("__main__")
    path, spec = getattr(main, "__file__", None), getattr(main, "__spec__", None)
    if path is None or (spec is not None and spec.name.endswith("__main__")):
        return None
    frame = sys._getframe()
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None:  # called from elsewhere (a thread, a callback): no top-level statement runs it
        return None
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    line = frame.f_lineno
    for node in tree.body:
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            return None if _is_main_guard(node) else f"{path}:{line}"
    return None


def refuse_unguarded_main(start: str, workers: int) -> None:
    """A one-line ConfigError, before any worker or forkserver starts, when workers would run the
    main script's training again (``unguarded_main_line``)."""
    where = unguarded_main_line() if start != "fork" else None
    if where is not None:
        raise ConfigError(f"{where}: this script trains from its top level, outside `if __name__ == \"__main__\":`, "
                          f"and each {start} DataLoader worker (data.num_workers={workers}) runs the script again, "
                          f"its training with it: put the script's code under `if __name__ == \"__main__\":` (or "
                          f"set data.num_workers=0)")


class _Probe(ForkingPickler):
    """Pickles as multiprocessing does, but tensors and arrays by shape only (their bytes are not
    what can fail), and raises on a class or function a worker could not import."""

    def __init__(self, start: str) -> None:
        super().__init__(_Sink(), pickle.HIGHEST_PROTOCOL)
        self.start, self.main_ok = start, main_importable(start)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return torch.empty, (0,)
        if isinstance(obj, np.ndarray):
            return np.empty, (0,)
        if isinstance(obj, (type, types.FunctionType)) and obj.__module__ == "__main__" and not self.main_ok:
            main = getattr(sys.modules.get("__main__"), "__file__", None) or "an interactive session"
            raise _NotImportable(f"{obj.__qualname__} is defined in the main module ({main}),"
                                 f" which a {self.start} worker cannot import")
        return NotImplemented


class _Sink(io.RawIOBase):
    def write(self, data: Any) -> int:
        return len(data)


def _pickle_error(obj: Any, start: str) -> Exception | None:
    try:
        _Probe(start).dump(obj)
    except Exception as err:  # noqa: BLE001  (AttributeError, TypeError, PicklingError, RecursionError...)
        return err
    return None


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    """(path suffix, child) for what pickling ``obj`` would pickle: items, elements, attributes."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield f"[{key!r}]", value
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for i, value in enumerate(obj):
            yield f"[{i}]", value
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, types.FunctionType, types.ModuleType)):
        for name, value in vars(obj).items():
            if name in ("_modules", "_parameters", "_buffers") and isinstance(value, dict):
                for sub, module in value.items():  # nn.Module children read as attributes
                    yield f".{sub}", module
            else:
                yield f".{name}", value


def _culprit(obj: Any, err: Exception, path: str, start: str, depth: int = 0) -> tuple[str, Any, Exception]:
    """The deepest object on a failing path (``obj`` fails with ``err``): its children all pickle,
    or it has none we can see."""
    if depth < _MAX_DEPTH:
        for suffix, child in _children(obj):
            if (child_err := _pickle_error(child, start)) is not None:
                return _culprit(child, child_err, path + suffix, start, depth + 1)
    return path, obj, err


def _describe(obj: Any) -> str:
    if isinstance(obj, types.FunctionType):
        kind = "a lambda" if obj.__name__ == "<lambda>" else "a local function" if "<locals>" in obj.__qualname__ \
            else "a function"
        return f"{kind} ({obj.__module__}.{obj.__qualname__})"
    return f"a {type(obj).__module__}.{type(obj).__qualname__}"


def check_sendable_to_workers(start: str, objects: dict[str, Any]) -> None:
    """Raise a one-line ConfigError naming the first of ``objects`` (label -> object) that a ``start``
    worker could not receive. A fork copies the process instead of pickling: nothing to check."""
    if start == "fork":
        return
    for label, obj in objects.items():
        if obj is None or (err := _pickle_error(obj, start)) is None:
            continue
        path, culprit, err = _culprit(obj, err, label, start)
        what = f"{path}: {err}" if isinstance(err, _NotImportable) else \
            f"{path} is {_describe(culprit)}, which cannot be pickled ({type(err).__name__}: {err})"
        raise ConfigError(f"data.worker_start={start}: the {label} cannot be sent to a {start} DataLoader worker: "
                          f"{what}; make it a module-level function or class, or set data.worker_start=fork "
                          f"(or data.num_workers=0)")
