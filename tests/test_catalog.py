"""visiontrain.catalog: a config means the same whichever public module a process imported first.

Each case is a fresh interpreter (what was imported before is the subject), all started at once: it
imports one public module, then loads a saved detection run's config.yaml (it lists
``eval.coco_backend``, a key the detection evaluator adds to the engine's section) and every
built-in recipe, and prints each config's described keys and dump."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from visiontrain import catalog
from visiontrain.core import config as C

SRC = Path(catalog.__file__).parent
FIRST_IMPORTS = {
    "the package": "import visiontrain",
    "the config": "import visiontrain.core.config",
    "Trainer": "from visiontrain import Trainer; Trainer",
    "a task's module": "import visiontrain.tasks.detr",
    "the CLI": "import visiontrain.app.cli",
    "Predictor": "from visiontrain import Predictor; Predictor",
}
LOADS = """
import json, sys
from visiontrain.core.config import config_from_dict, describe_keys, dump_config, list_recipes, load_config
import yaml

saved = config_from_dict(yaml.safe_load(open(sys.argv[1]).read()), source=sys.argv[1])
configs = {"saved detection config.yaml": saved, **{r: load_config(r) for r in list_recipes()}}
print(json.dumps({name: [describe_keys(cfg), dump_config(cfg)] for name, cfg in configs.items()}))
"""


def test_every_recipe_and_a_saved_detection_config_load_the_same_whatever_was_imported_first(tmp_path):
    saved = tmp_path / "config.yaml"  # what a detect-detr run writes into its run dir
    saved.write_text(C.dump_config(C.load_config("detect-detr", ["eval.coco_backend=pycocotools"])))
    procs = {case: subprocess.Popen([sys.executable, "-c", f"{first}\n{LOADS}", str(saved)], cwd=tmp_path,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for case, first in FIRST_IMPORTS.items()}
    seen = {}
    for case, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{case} first: {err[-3000:]}"
        seen[case] = json.loads(out)
    expected = seen["the CLI"]
    assert set(expected) == {"saved detection config.yaml", *C.list_recipes()}
    assert "coco_backend: pycocotools" in expected["saved detection config.yaml"][1]
    for case, loaded in seen.items():
        for name in expected:
            assert loaded[name] == expected[name], f"{name} differs with {case} imported first"


REGISTERING_CALLS = {"register_section", "register_kind", "register_task", "register_tracker", "extend_section",
                     "register_part"}


def registers_at_import(path: Path) -> bool:
    """Whether the module calls a registering function at its top level (a decorator included)."""
    tree = ast.parse(path.read_text())
    calls = [n for stmt in tree.body if not isinstance(stmt, (ast.FunctionDef, ast.ClassDef))
             for n in ast.walk(stmt) if isinstance(n, ast.Call)]
    decorators = [d for stmt in tree.body if isinstance(stmt, (ast.FunctionDef, ast.ClassDef))
                  for d in stmt.decorator_list]
    names = {getattr(c.func, "id", getattr(c.func, "attr", None)) for c in calls}
    names |= {getattr(d, "id", getattr(d, "attr", None)) for d in decorators}
    return bool(names & REGISTERING_CALLS)


def test_the_catalogue_names_every_module_that_registers_and_only_those():
    registering = {".".join(p.relative_to(SRC.parent).with_suffix("").parts) for p in SRC.rglob("*.py")
                   if registers_at_import(p)}
    assert len(registering) > 15, registering  # a scan that found nothing would prove nothing
    # the parts' list registers nothing at import; it is named because every run's parts are there
    assert registering == set(catalog.BUILT_IN) - {"visiontrain.engine.loop.assembly"}


def test_a_users_module_comes_after_the_built_in_ones(tmp_path, monkeypatch):
    """--import: the built-in registrations are made first, so a module of the user's that registers a
    name again (its own classification task) replaces the built-in one, whatever was imported before."""
    (tmp_path / "my_classification.py").write_text(
        "from visiontrain import register_task\n"
        "from visiontrain.tasks.classification import ClassificationConfig, ClassificationTask\n"
        "class Mine(ClassificationTask):\n    pass\n"
        "register_task('classification', Mine, ClassificationConfig)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    catalog.import_user(str(tmp_path / "my_classification.py"))
    from visiontrain.tasks import build_task

    cfg = C.load_config("classify-fashion", ["data.name=digits"])
    assert type(build_task(cfg)).__name__ == "Mine"
