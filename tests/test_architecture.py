"""Invariants of the code's shape: the engine knows no task; every host sync is marked."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "visiontrain"


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_engine_imports_no_task():
    for path in (SRC / "engine").rglob("*.py"):
        bad = {m for m in imports_of(path) if m.startswith("visiontrain.tasks")}
        assert not bad, f"{path.name} imports {bad}: the engine must not know any task"


def test_tasks_and_data_do_not_import_the_cli():
    for path in list((SRC / "tasks").glob("*.py")) + list((SRC / "data").rglob("*.py")) + \
            list((SRC / "engine").rglob("*.py")):
        assert "visiontrain.app.cli" not in imports_of(path), path


READ_METHODS = {"item", "tolist", "cpu", "numpy"}
# The modules a training step runs through (set-up and checkpoint I/O read CPU values by nature).
HOT_PATH = ("step/pipeline.py", "loop/trainer.py", "step/metrics.py", "step/ema.py", "setup/placement.py",
            "setup/loaders.py", "step/accumulation.py", "protocols/hooks.py", "parallel/distributed.py",
            "protocols/part.py", "parts/log_point.py", "parts/evaluator.py", "parts/checkpointer.py",
            "parts/preemption.py", "optim/scalars.py", "step/prefetch.py", "setup/training.py", "step/eval_loop.py",
            "protocols/cadence.py", "step/source.py", "parts/early_stop.py", "loop/assembly.py")


def host_reads(path: Path) -> list[int]:
    """Line numbers of calls that read a tensor on the host: x.item(), x.tolist(), x.cpu(),
    x.numpy(), bool(x) (any bool() call: the engine has no other use for it)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in READ_METHODS and not node.args:
                lines.append(node.lineno)
            elif isinstance(f, ast.Name) and f.id == "bool":
                lines.append(node.lineno)
    return lines


def test_every_host_read_in_the_engine_is_marked():
    """Each line of the engine that reads a tensor on the host carries a '# host sync' comment."""
    unmarked = []
    for name in HOT_PATH:
        path = SRC / "engine" / name
        text = path.read_text().splitlines()
        for no in host_reads(path):
            if "host sync" not in text[no - 1]:
                unmarked.append(f"{name}:{no}: {text[no - 1].strip()}")
    assert not unmarked, "host reads without a '# host sync' comment:\n" + "\n".join(unmarked)


def test_the_marker_check_finds_reads():
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write("x = t.item()\ny = bool(t)  # host sync\nz = t.tolist()\n")
    assert host_reads(Path(f.name)) == [1, 2, 3]


# ---------------------------------------------------------------- rooms and arrows
# Each module's room, lowest first; a module may import its own room and the rooms below it, never
# one above. Every file of src/visiontrain/ is in a folder named after its room but three: the
# package's __init__ (core: it imports nothing), __main__ (app) and catalog.py (its own room).
# The engine is rooms by role, in the same order (docs/architecture.md, "The engine's rooms"): how a
# run spreads over processes and devices; what it keeps (checkpoints); the optimiser's configuration
# (parameter groups, schedules); what one step runs; the contracts a task, a hook or a part
# implements; the build phase; what a run writes for people; the periodic parts; the loop that runs
# them all.
ENGINE_ROOMS = ["parallel", "state", "optim", "step", "protocols", "setup", "records", "parts", "loop"]
ROOMS = ["core", "rundir", "data", "models", "evaluation", *(f"engine/{r}" for r in ENGINE_ROOMS), "tasks", "catalog",
         "use", "report", "tune", "app"]
#: The one arrow up: every config loader makes sure the catalogue (which names the registering modules of
#: every room) is loaded first (core.config: catalog.load()).
UP_ON_PURPOSE = {("visiontrain.core.config", "visiontrain.catalog")}
# data, models and evaluation sit side by side: none imports another (each is a leaf library).
SIDE_BY_SIDE = {"data", "models", "evaluation"}


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def room_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "core"
    if parts[1] == "__main__":
        return "app"
    if parts[1] == "engine":  # the package itself (empty) counts as the lowest engine room
        return f"engine/{parts[2] if len(parts) > 2 else ENGINE_ROOMS[0]}"
    return parts[1]


def resolved_imports(path: Path, modules: set[str]) -> set[str]:
    """The visiontrain modules ``path`` imports, anywhere in the file (a function-level import is an
    arrow too): ``from visiontrain.engine import build`` is visiontrain.engine.setup."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("visiontrain")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("visiontrain"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & modules
            out |= subs or {node.module}
    return out & modules


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in SRC.rglob("*.py")}
    return {m: resolved_imports(p, set(files)) - {m} for m, p in files.items()}


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in graph.items():
        a = room_of(src)
        for dst in targets - {d for s, d in UP_ON_PURPOSE if s == src}:
            b = room_of(dst)
            if ROOMS.index(b) > ROOMS.index(a) or (a != b and a in SIDE_BY_SIDE and b in SIDE_BY_SIDE):
                bad.append(f"{src} ({a}) -> {dst} ({b})")
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_points_up_a_room():
    """engine -> tasks, config -> engine, data/models/evaluation -> engine: each is a failure here,
    with no exceptions listed. Tasks implement the engine's protocol (engine.protocols.task); the engine never
    needs to know one."""
    assert not upward_arrows(import_graph()), "imports against the rooms' order:\n" + \
        "\n".join(upward_arrows(import_graph()))


def test_no_file_cycles():
    assert not cycles(import_graph()), cycles(import_graph())


def test_the_checks_find_what_they_forbid():
    graph = {"visiontrain.engine.loop.trainer": {"visiontrain.tasks.detr"}, "visiontrain.tasks.detr": set(),
             "visiontrain.core.config": {"visiontrain.engine.optim.schedules", "visiontrain.catalog"},
             "visiontrain.engine.optim.schedules": set(), "visiontrain.catalog": set(),
             "visiontrain.data.samplers": {"visiontrain.models.yolo"}, "visiontrain.models.yolo": set(),
             "visiontrain.app.cli": {"visiontrain.engine.loop.trainer"},
             "visiontrain.rundir.metrics_file": {"visiontrain.engine.state.checkpoint"},
             "visiontrain.engine.state.checkpoint": {"visiontrain.rundir.run_files"},
             "visiontrain.report.page": {"visiontrain.tune.study"}, "visiontrain.tune.study": set(),
             "visiontrain.rundir.run_files": set()}
    assert upward_arrows(graph) == [
        "visiontrain.core.config (core) -> visiontrain.engine.optim.schedules (engine/optim)",
        "visiontrain.data.samplers (data) -> visiontrain.models.yolo (models)",
        "visiontrain.engine.loop.trainer (engine/loop) -> visiontrain.tasks.detr (tasks)",
        "visiontrain.report.page (report) -> visiontrain.tune.study (tune)",
        "visiontrain.rundir.metrics_file (rundir) -> visiontrain.engine.state.checkpoint (engine/state)"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert room_of("visiontrain.report.page") == "report" and room_of("visiontrain.engine") == "engine/parallel"
    assert room_of("visiontrain.__main__") == "app" and room_of("visiontrain") == "core"
    assert all(room_of(module_name(p)) in ROOMS for p in SRC.rglob("*.py"))  # every file in a room


def test_only_the_package_s_entry_points_and_the_catalogue_sit_at_the_top():
    assert sorted(p.name for p in SRC.glob("*.py")) == ["__init__.py", "__main__.py", "catalog.py"]


def test_the_architecture_page_names_only_modules_that_exist():
    """docs/architecture.md is read first by a newcomer: every file it names must be there."""
    import re

    page = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:tests/)?[\w/]+\.py)`", page))
    assert len(named) > 20, named  # the page names the engine's parts; a regex that found none proves nothing
    missing = [n for n in sorted(named) if not ((SRC.parents[1] / n) if n.startswith("tests/") else SRC / n).is_file()]
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"
    classes = set(re.findall(r"`(Task|TaskData|ExportSpec|DictOutputs|EvalData|TrainStep|Progress|StopCheck|Part|"
                             r"Cadence|TrainSource|LoaderSource|States|WeightsState)`", page))
    from visiontrain.engine.parts import preemption
    from visiontrain.engine.protocols import cadence
    from visiontrain.engine.protocols import part as parts
    from visiontrain.engine.protocols import task
    from visiontrain.engine.state import checkpoint
    from visiontrain.rundir import checkpoint_format
    from visiontrain.engine.step import eval_loop
    from visiontrain.engine.step import pipeline as step
    from visiontrain.engine.step import source

    where = {**vars(task), **vars(eval_loop), **vars(parts), **vars(preemption), **vars(step), **vars(cadence),
             **vars(source), **vars(checkpoint_format), **vars(checkpoint)}
    assert classes and all(c in where for c in classes), classes - set(where)


MAX_FUNCTION_LINES = 60


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``name (N lines)`` for each function or method of ``path`` longer than ``limit`` lines, its
    signature, docstring and nested functions included."""
    return [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > limit]


def test_lines_and_functions_stay_readable():
    """No source line over 120 characters and no function over 60 lines, anywhere in src: a file
    grows by functions a reader takes in whole, and the rooms and arrows above keep the files apart
    (a cap on a file's lines made code cut its docs to fit, not split by responsibility)."""
    wide = [f"{p.relative_to(SRC)}:{i}" for p in SRC.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > 120]
    assert not wide, wide
    too_long = [f"{p.relative_to(SRC)}:{f}" for p in sorted(SRC.rglob("*.py")) for f in long_functions(p)]
    assert not too_long, too_long


def test_the_function_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    (tmp_path / "m.py").write_text(f"def fits():\n{body}\n\n\ndef over():\n{body}\n    return 0\n")
    assert long_functions(tmp_path / "m.py") == ["over (61 lines)"]


def test_the_public_names_resolve_without_loading_torch_up_front():
    """``from visiontrain import Task, Hook, Trainer...`` is the stable way in: each name resolves to
    the engine's own object, and ``import visiontrain`` alone loads no torch."""
    import subprocess
    import sys

    import visiontrain

    for name in visiontrain.__all__:
        value = getattr(visiontrain, name)
        assert name == "__version__" or value.__name__ == name, name
    code = "import sys, visiontrain; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() \
        == "False"


TESTS = Path(__file__).resolve().parent


def test_the_tests_import_helpers_from_support_and_never_another_test_module():
    """A helper two test files share lives in tests/support/; a test module imported by another ran
    that module's imports and fixtures in a place nobody looks, and the three that did so formed a cycle."""
    loose = sorted(p.name for p in TESTS.glob("*.py") if not p.name.startswith("test_") and p.name != "conftest.py")
    assert not loose, f"helpers outside tests/support/: {loose}"
    importing = sorted(f"{p.relative_to(TESTS)} imports {m}" for p in TESTS.rglob("*.py") for m in imports_of(p)
                       if m.split(".")[-1].startswith("test_"))
    assert not importing, importing


#: Tests about the project as a whole sit at the top of tests/; every other test sits in the folder of
#: the source room it tests (tests/engine/ for src/visiontrain/engine/...), or in reliability/ (faults
#: injected into whole runs: kills, full disks, lost peers).
PROJECT_WIDE = ["test_architecture.py", "test_catalog.py", "test_docs.py", "test_local_imports.py", "test_one_place.py"]
NOT_ROOMS = {"support", "fixtures", "reliability", "__pycache__"}


def test_the_tests_mirror_the_source_rooms():
    assert sorted(p.name for p in TESTS.glob("test_*.py")) == PROJECT_WIDE
    folders = {p.name for p in TESTS.iterdir() if p.is_dir()} - NOT_ROOMS
    source_rooms = {p.name for p in SRC.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders and folders <= source_rooms, f"test folders that are no room of src/visiontrain: " \
        f"{sorted(folders - source_rooms)}"
    assert all(p.name.startswith("test_") for room in folders for p in (TESTS / room).glob("*.py")), \
        "a helper in a room's test folder belongs in tests/support/"
