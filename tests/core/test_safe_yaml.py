"""A YAML "billion laughs" (nine levels of ten aliases: 10^9 values from a few hundred bytes) in
each file a user may have been sent is one line naming the file, at once, instead of a hang
(visiontrain/core/safe_yaml.py)."""
from __future__ import annotations

import time

import pytest

from dataset_trees import build_yolo
from procs import cli_here
from visiontrain.core import safe_yaml

DEEP = "names: " + "[" * 3000 + "]" * 3000 + "\n"  # past PyYAML's recursion: a RecursionError traceback
BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]\n" for i in range(8))


def test_the_loader_counts_what_aliases_expand_to():
    assert safe_yaml.load("x: &x [1, 2]\ny: [*x, *x]\n") == {"x": [1, 2], "y": [[1, 2], [1, 2]]}
    with pytest.raises(safe_yaml.TooLarge, match="more than 100,000 values"):
        safe_yaml.load(BOMB)


@pytest.mark.parametrize("document, refusal", [(BOMB, "more than 100,000 values"),
                                               (DEEP, "nested deeper than 100 levels")], ids=["aliases", "depth"])
@pytest.mark.parametrize("where", ["recipe", "space", "override", "data.yaml"])
def test_a_billion_laughs_or_a_deep_nest_is_one_line_naming_the_file(where, document, refusal, tmp_path, capfd):
    bomb = tmp_path / "bomb.yaml"
    if where == "recipe":
        bomb.write_text(document)
        args = ["show-config", str(bomb)]
    elif where == "space":
        bomb.write_text(document)
        args = ["tune", "classify-fashion", "--space", str(bomb), "--trials", "1", "--study-dir", str(tmp_path / "s")]
    elif where == "override":  # an override's value is read as YAML; refused as YAML, it stays the text
        args = ["show-config", "classify-fashion", "task.name=" + document.replace("\n", "; ")]
    else:
        root = tmp_path / "yolo"
        build_yolo(root)
        (root / "data.yaml").write_text(document.replace("i: &i", "names: &i"))
        bomb = root / "data.yaml"
        args = ["fit", "detect-yolov3", "data.name=yolo", f"data.root={root}", "--run-dir", str(tmp_path / "run")]
    t0 = time.monotonic()
    done = cli_here(*args, capture=capfd)
    assert time.monotonic() - t0 < 30
    errors = [line for line in done.stderr.splitlines() if line.startswith("visiontrain: error:")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    if where != "override":
        assert str(bomb) in errors[0] and refusal in errors[0], errors
