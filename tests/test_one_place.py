"""Facts the commands share are spelled in one module each, and the modules that read them import
the names: the exit codes (``exit_codes``), the run dir's file names (``engine.state.run_files``), the
keys of a metrics row (``engine.records.metrics_file``); and no module outside ``tasks/`` names a task
family (a task says what it predicts: ``Task.predicts``)."""
from __future__ import annotations

import ast
from pathlib import Path

from visiontrain.rundir import metrics_file
from visiontrain.rundir import run_files

SRC = Path(__file__).resolve().parents[1] / "src" / "visiontrain"
APP = sorted(p for p in SRC.glob("*.py"))  # cli, commands, compare, report, predict, inference, export...


def docstrings(tree: ast.Module) -> set[int]:
    """ids of the docstring constants (prose may name a file)."""
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def test_exit_codes_are_assigned_in_one_module():
    assigned = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            assigned += [f"{path.relative_to(SRC)}: {n}" for n in names if n.startswith("EXIT_")]
    assert assigned and all(a.startswith("core/exit_codes.py: ") for a in assigned), assigned


def test_the_cli_returns_named_exit_codes():
    """``return 2`` in app/cli.py or app/commands.py would be a second spelling of EXIT_USAGE."""
    literal = [f"{p.name}:{n.lineno}" for p in (SRC / "app/cli.py", SRC / "app/commands.py")
               for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Return)
               and isinstance(n.value, ast.Constant) and isinstance(n.value.value, int) and n.value.value != 0]
    assert not literal, literal


RUN_FILE_NAMES = {v for k, v in vars(run_files).items() if k.endswith("_FILE") or k.endswith("_CHECKPOINT")}
RUN_DIR_NAMES = {v for k, v in vars(run_files).items() if k.endswith("_DIR")}


def spelled_run_dir_names(path: Path) -> list[str]:
    """String literals in ``path`` that are a run-dir file name, or a run-dir folder name joined
    into a path (``run_dir / "plots"``); docstrings left out."""
    tree = ast.parse(path.read_text())
    skip = docstrings(tree)
    found = [f"{path.name}:{n.lineno}: {n.value!r}" for n in ast.walk(tree)
             if isinstance(n, ast.Constant) and id(n) not in skip and n.value in RUN_FILE_NAMES]
    found += [f"{path.name}:{n.lineno}: {side.value!r}" for n in ast.walk(tree)
              if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div) for side in (n.left, n.right)
              if isinstance(side, ast.Constant) and side.value in RUN_DIR_NAMES]
    return found


def test_the_app_and_the_engine_name_run_dir_files_through_run_files():
    assert {"config.yaml", "summary.json", "report.html", "last.pt", "best_ema.pt"} <= RUN_FILE_NAMES
    assert {"plots", "checkpoints", "tb"} <= RUN_DIR_NAMES
    engine = sorted(p for p in (SRC / "engine").rglob("*.py") if p.name != "run_files.py")
    spelled = [s for path in [*APP, *engine] for s in spelled_run_dir_names(path)]
    assert not spelled, spelled


ROW_NAMES = {*metrics_file.ROW_KEYS, metrics_file.SAMPLES_PER_S, metrics_file.DATA_S, metrics_file.COMPUTE_S}


#: The records of other files, whose keys may coincide with a row's: summary.json's (``summary``),
#: provenance.json's launches (``launch``), model_summary.json's modules (``module``).
OTHER_RECORDS = ("summary", "launch", "module")


def other_record(node: ast.expr) -> bool:
    return ast.unparse(node).split(".")[-1] in OTHER_RECORDS


def spelled_row_keys(path: Path) -> list[str]:
    """String literals in ``path`` equal to a metrics row's key, except as a key of another file's
    record (``summary["steps"]``, ``launch.get("step")``), a keyword argument's value (an axis
    label) or text of an f-string; docstrings left out."""
    tree = ast.parse(path.read_text())
    allowed = docstrings(tree)
    for n in ast.walk(tree):
        if isinstance(n, ast.Subscript) and other_record(n.value):
            allowed.add(id(n.slice))
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" \
                and other_record(n.func.value) and n.args:
            allowed.add(id(n.args[0]))
        elif isinstance(n, ast.keyword):
            allowed.add(id(n.value))
        elif isinstance(n, ast.JoinedStr):
            allowed |= {id(v) for v in n.values if isinstance(v, ast.Constant)}
    return [f"{path.name}:{n.lineno}: {n.value!r}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value in ROW_NAMES and id(n) not in allowed]


def test_compare_and_report_read_rows_by_the_schema_names():
    spelled = [s for name in ("report/compare.py", "report/page.py") for s in spelled_row_keys(SRC / name)]
    assert not spelled, spelled


def test_the_checks_find_what_they_forbid(tmp_path):
    source = tmp_path / "sample.py"
    source.write_text('"""Reads summary.json."""\nfrom pathlib import Path\n\n\ndef f(run_dir, row, summary):\n'
                      '    a = Path(run_dir) / "summary.json"\n    b = run_dir / "plots" / "x.png"\n'
                      '    c = {"plots": 1}\n    d = row["step"], summary.get("samples_per_s"), f"step {row}"\n'
                      '    e = dict(xlabel="step"), row.get("data_s")\n')
    assert spelled_run_dir_names(source) == ["sample.py:6: 'summary.json'", "sample.py:7: 'plots'"]
    assert spelled_row_keys(source) == ["sample.py:9: 'step'", "sample.py:10: 'data_s'"]


def test_no_module_outside_tasks_names_a_task_family():
    """inference, predict, export, report and the CLI read a task through ``Task`` and what it
    declares (``predicts``): a new family must not need a switch on its class there."""
    named = []
    for path in SRC.rglob("*.py"):
        if path.parent.name == "tasks":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            named += [f"{path.relative_to(SRC)}:{node.lineno}: {m}" for m in modules
                      if m.startswith("visiontrain.tasks.")]
    assert not named, named
