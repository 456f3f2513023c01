"""The rule for imports inside functions (docs/architecture.md, "Imports inside functions"): such an
import must load a package that its module's own top-level imports do not already load (torch in
a torch-free module, torchvision, matplotlib, scipy, onnx...). One that loads nothing new belongs
at the top of the module, where a reader sees what the module depends on.

What a module loads is read from the source: its top-level imports, followed through the
visiontrain modules they name (and their packages' ``__init__``), down to the third-party packages
at the end of each chain. Checked outside ``engine/``."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "visiontrain"
STDLIB = set(sys.stdlib_module_names) | {"__future__"}
IMPLIED = {"torch": {"numpy"}}  # torch loads numpy when it is imported


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def loaded_modules(node: ast.Import | ast.ImportFrom, known: set[str]) -> list[str]:
    """The modules an import statement runs: each named module and its parent packages."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif node.level or not node.module:
        return []
    else:
        names = [node.module, *(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known)]
    return [".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 2)]


def top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports that run when the module loads (not in a function, not under TYPE_CHECKING)."""
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(body: list[ast.stmt]) -> None:
        for st in body:
            if isinstance(st, (ast.Import, ast.ImportFrom)):
                found.append(st)
            elif isinstance(st, ast.If) and not (isinstance(st.test, ast.Name) and st.test.id == "TYPE_CHECKING"):
                walk(st.body + st.orelse)
            elif isinstance(st, ast.Try):
                walk(st.body + st.orelse + st.finalbody + [s for h in st.handlers for s in h.body])
            elif isinstance(st, ast.ClassDef):
                walk(st.body)

    walk(tree.body)
    return found


class Packages:
    """The third-party packages importing a module loads, from the sources under ``SRC``."""

    def __init__(self, trees: dict[str, ast.Module]) -> None:
        self.trees, self.memo = trees, {}

    def of_module(self, module: str) -> set[str]:
        if module not in self.memo:
            self.memo[module] = set()  # a cycle adds nothing (and the layering test forbids one)
            self.memo[module] = {p for st in top_level_imports(self.trees[module])
                                 for m in loaded_modules(st, set(self.trees)) for p in self.of_name(m)}
        return self.memo[module]

    def of_name(self, name: str) -> set[str]:
        top = name.split(".")[0]
        if top in STDLIB:
            return set()
        if top == "visiontrain":
            return self.of_module(name) if name in self.trees else set()
        return {top, *IMPLIED.get(top, ())}

    def of_import(self, node: ast.Import | ast.ImportFrom) -> set[str]:
        return {p for m in loaded_modules(node, set(self.trees)) for p in self.of_name(m)}


def function_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    nodes = {n for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return sorted(nodes, key=lambda n: n.lineno)


def imports_that_load_nothing_new(trees: dict[str, ast.Module], paths: dict[str, str]) -> list[str]:
    packages = Packages(trees)
    return [f"{paths[m]}:{node.lineno}: {ast.unparse(node)}" for m in sorted(trees)
            if not m.startswith("visiontrain.engine")
            for node in function_imports(trees[m]) if not packages.of_import(node) - packages.of_module(m)]


def test_an_import_inside_a_function_loads_something_the_module_does_not():
    files = {module_name(p): p for p in SRC.rglob("*.py")}
    trees = {m: ast.parse(p.read_text()) for m, p in files.items()}
    paths = {m: str(p.relative_to(SRC)) for m, p in files.items()}
    bad = imports_that_load_nothing_new(trees, paths)
    assert not bad, "imports inside functions that load nothing the module has not loaded (move them to the top):\n" \
        + "\n".join(bad)


def test_the_check_finds_what_it_forbids():
    """A local import of a visiontrain module that loads only torch, in a module that imports torch
    at its top, is flagged; the same import in a torch-free module, and a local matplotlib import,
    are not; a package's ``__init__`` counts as loaded with its module."""
    trees = {name: ast.parse(text) for name, text in {
        "visiontrain": "",
        "visiontrain.heavy": "import torch\nimport visiontrain.plots_lib\n",
        "visiontrain.plots_lib": "def draw():\n    import matplotlib.pyplot as plt\n",
        "visiontrain.pkg": "import scipy\n",
        "visiontrain.pkg.leaf": "X = 1\n",
        "visiontrain.user": "import torch\n\ndef f():\n    from visiontrain.heavy import x\n    import numpy\n"
                            "    import json\n    from visiontrain.plots_lib import draw\n",
        "visiontrain.light": "def f():\n    from visiontrain.heavy import x\n    import matplotlib\n"
                             "    from visiontrain.pkg.leaf import X\n",
    }.items()}
    bad = imports_that_load_nothing_new(trees, {m: m for m in trees})
    assert bad == ["visiontrain.user:4: from visiontrain.heavy import x", "visiontrain.user:5: import numpy",
                   "visiontrain.user:6: import json", "visiontrain.user:7: from visiontrain.plots_lib import draw"]
