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
    for path in (SRC / "engine").glob("*.py"):
        bad = {m for m in imports_of(path) if m.startswith("visiontrain.tasks") and m != "visiontrain.tasks.base"}
        assert not bad, f"{path.name} imports {bad}: the engine must not know any task"


def test_tasks_and_data_do_not_import_the_cli():
    for path in list((SRC / "tasks").glob("*.py")) + list((SRC / "data").rglob("*.py")) + \
            list((SRC / "engine").glob("*.py")):
        assert "visiontrain.cli" not in imports_of(path), path


READ_METHODS = {"item", "tolist", "cpu", "numpy"}
# The modules a training step runs through (set-up and checkpoint I/O read CPU values by nature).
HOT_PATH = ("step.py", "trainer.py", "metrics.py", "ema.py", "build.py", "hooks.py", "distributed.py")


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
                unmarked.append(f"{path.name}:{no}: {text[no - 1].strip()}")
    assert not unmarked, "host reads without a '# host sync' comment:\n" + "\n".join(unmarked)


def test_the_marker_check_finds_reads():
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write("x = t.item()\ny = bool(t)  # host sync\nz = t.tolist()\n")
    assert host_reads(Path(f.name)) == [1, 2, 3]


def test_source_files_stay_small():
    too_long = [f"{p.relative_to(SRC)} ({n} lines)" for p in SRC.rglob("*.py")
                if (n := len(p.read_text().splitlines())) > 400]
    assert not too_long, too_long
