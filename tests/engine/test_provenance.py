"""Where a run came from: provenance.json (a launch per start of the run, the git commit of the
current directory, the command line, the machine), its section in the report, and compare's table
of the config keys that differ between runs."""
from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from toy_task import toy_config
from visiontrain.app import cli
from visiontrain.core import config as C
from visiontrain.report.compare import config_diff
from visiontrain.engine.records.provenance import git_state


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(subprocess.run(["git", "--version"], capture_output=True).returncode != 0, reason="needs git")
def test_provenance_records_each_launch_with_its_commit_command_and_machine(tmp_path, monkeypatch, capsys):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "toy.yaml").write_text(C.dump_config(toy_config(trainer__plots=False)))
    git(repo, "init", "-q")
    git(repo, "add", "toy.yaml")
    git(repo, "commit", "-q", "-m", "recipe")
    monkeypatch.chdir(repo)
    args = ["fit", "toy.yaml", "optim.lr=0.01", "--run-dir", "runs/a"]
    assert cli.main(args) == 0
    (launch,) = json.loads(Path("runs/a/provenance.json").read_text())["launches"]
    # a run dir inside the checkout is not a change to it
    assert launch["git"] == {"commit": git(repo, "rev-parse", "HEAD"), "dirty": False}
    assert launch["command"] == "visiontrain " + " ".join(args)
    assert launch["recipe"] == "toy.yaml" and launch["overrides"] == ["optim.lr=0.01"]
    assert launch["step"] == 0 and launch["resumed_from"] is None and launch["cwd"] == str(repo)
    assert launch["versions"]["torch"] == torch.__version__ and launch["versions"]["numpy"]
    assert launch["host"] == socket.gethostname() and launch["cpu_count"] == os.cpu_count()
    assert launch["gpus"] == [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    assert "mlflow" not in launch["versions"]  # only when the run used it

    (repo / "toy.yaml").write_text((repo / "toy.yaml").read_text() + "# edited\n")  # a tracked file changed
    assert cli.main(["fit", "toy.yaml", "optim.lr=0.01", "trainer.epochs=3", "--run-dir", "runs/a",
                     "--resume", "auto"]) == 0
    first, second = json.loads(Path("runs/a/provenance.json").read_text())["launches"]
    assert first == launch  # appended, never rewritten
    assert second["step"] == 16 and second["resumed_from"].endswith("last.pt")
    assert second["git"]["dirty"] is True and second["overrides"] == ["optim.lr=0.01", "trainer.epochs=3"]
    # the report shows both launches and the last one's commit
    html = Path("runs/a/report.html").read_text()
    assert "Provenance" in html and "2 launches" in html and f"{second['git']['commit']} (dirty)" in html
    capsys.readouterr()


def test_no_git_or_no_checkout_is_no_commit_and_no_error(tmp_path, monkeypatch):
    assert git_state(tmp_path) is None  # not a checkout
    monkeypatch.setenv("PATH", str(tmp_path))  # no git at all
    assert git_state(Path.cwd()) is None


def write_run(run_dir: Path, **overrides) -> str:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "epoch": 0, "total": 1.0}\n'
                                           '{"kind": "eval", "step": 1, "epoch": 0, "mse": 0.5}\n')
    (run_dir / "config.yaml").write_text(C.dump_config(toy_config(**overrides)))
    return str(run_dir)


def test_compare_lists_exactly_the_config_keys_that_differ(tmp_path, capsys):
    a = write_run(tmp_path / "a")
    b = write_run(tmp_path / "b", optim__lr=0.01, ema__enabled=True, optim__lr_mult={"head": 10.0})
    c = write_run(tmp_path / "c", optim__lr=0.01)
    columns, rows = config_diff([a, b, c])
    assert columns == ["key", "a", "b", "c"]
    assert rows == [["ema.enabled", "false", "true", "false"], ["optim.lr", "0.05", "0.01", "0.01"],
                    ["optim.lr_mult.head", "-", "10.0", "-"]]
    assert cli.main(["compare", a, b, "--out", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    assert "config keys that differ" in out and "optim.lr_mult.head" in out and "seed" not in out
    # equal configs: no second table
    assert config_diff([a, write_run(tmp_path / "d")]) == (["key", "a", "d"], [])
    assert cli.main(["compare", a, str(tmp_path / "d"), "--out", str(tmp_path / "c.png")]) == 0
    assert "config keys that differ" not in capsys.readouterr().out
