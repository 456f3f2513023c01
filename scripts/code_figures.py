"""The code's shape in figures: files and lines per room, the arrows between rooms (imports of one
room's modules by another's), the longest functions, the functions of 7 or more parameters and the
imports made inside functions. Run from anywhere: ``python scripts/code_figures.py [--longest N]``.

A room is a top-level package of ``src/visiontrain`` (``engine/`` counted by its own rooms); the
three files directly in ``src/visiontrain`` (``__init__``, ``__main__``, ``catalog``) are counted
together as ``(top level)``. Standard library only, so it runs without the project's environment.
"""
from __future__ import annotations

import argparse
import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "visiontrain"


def room(path: Path) -> str:
    parts = path.relative_to(SRC).parts
    if len(parts) == 1:
        return "(top level)"
    if parts[0] == "engine" and len(parts) > 2:
        return f"engine/{parts[1]}"
    return parts[0]


def room_of_module(module: str) -> str:
    """The room of a dotted module name of the package (``visiontrain.engine.step.pipeline``)."""
    parts = module.split(".")[1:]
    candidate = SRC.joinpath(*parts)
    path = candidate.with_suffix(".py") if candidate.with_suffix(".py").is_file() else candidate / "__init__.py"
    return room(path) if path.is_file() else "?"


def arrows(tree: ast.AST, here: str) -> set[str]:
    """The other rooms a module imports from, anywhere in it."""
    out = set()
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) and node.module else []
        for name in names:
            if name.startswith("visiontrain"):
                to = room_of_module(name)
                to = to if to != "?" else room_of_module(name.rsplit(".", 1)[0])
                if to not in ("?", here):
                    out.add(to)
    return out


def parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Its parameters, ``self`` and ``cls`` not counted."""
    a = fn.args
    named = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    return len([p for p in named if p.arg not in ("self", "cls")]) + bool(a.vararg) + bool(a.kwarg)


def functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def local_imports(tree: ast.AST) -> int:
    """Import statements inside a function body (not counting nested functions twice)."""
    count = 0
    for fn in functions(tree):
        inner = {id(n) for f in functions(fn) if f is not fn for n in ast.walk(f)}
        count += sum(isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in inner for n in ast.walk(fn))
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--longest", type=int, default=5, help="how many of the longest functions to list")
    args = parser.parse_args()
    files: dict[str, int] = defaultdict(int)
    lines: dict[str, int] = defaultdict(int)
    longest: list[tuple[int, str]] = []
    between: dict[tuple[str, str], int] = defaultdict(int)
    inside = many = 0
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        files[room(path)] += 1
        lines[room(path)] += len(text.splitlines())
        longest += [(f.end_lineno - f.lineno + 1, f"{path.relative_to(SRC)}:{f.lineno} {f.name}")
                    for f in functions(tree)]
        inside += local_imports(tree)
        many += sum(parameters(f) >= 7 for f in functions(tree))
        for to in arrows(tree, room(path)):
            between[(room(path), to)] += 1
    print(f"{'room':<20}{'files':>6}{'lines':>8}")
    for name in sorted(files):
        print(f"{name:<20}{files[name]:>6}{lines[name]:>8}")
    print(f"{'all':<20}{sum(files.values()):>6}{sum(lines.values()):>8}")
    print(f"\nthe {args.longest} longest functions (lines):")
    for n, where in sorted(longest, reverse=True)[:args.longest]:
        print(f"{n:>5}  {where}")
    print("\narrows between rooms (importing modules):")
    for (src, dst), n in sorted(between.items()):
        print(f"  {src:<18} -> {dst:<18}{n:>4}")
    print(f"\nfunctions with 7 or more parameters: {many}")
    print(f"imports inside functions: {inside}")


if __name__ == "__main__":
    main()
