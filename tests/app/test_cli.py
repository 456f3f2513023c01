"""The CLI end to end, as a user runs it: python -m visiontrain ... in a subprocess. A command that
is refused before any training, or only prints (recipes, show-config), runs ``cli.main`` in this
process instead: its subject is what it prints and its exit code, not the process; a config error's
stderr from the real entry point is checked whole in tests/reliability/test_bad_input.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from procs import cli_here, in_process, run_cli
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.engine.state.checkpoint import load_checkpoint

QUICK = ["data.name=digits", "data.batch_size=64", "trainer.epochs=2", "trainer.log_every=5",
         "trainer.progress=plain", "schedules.lr.warmup=2", "schedules.lr.unit=steps", "ema.enabled=true"]


def vt(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return run_cli(*args, cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("cli") / "run"
    # in this process: no DataLoader workers to start (data.num_workers 0)
    proc = cli_here("fit", "classify-fashion", *QUICK, "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr
    return run


def test_fit_writes_a_complete_run_dir(fitted):
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "model.safetensors", "model_ema.safetensors",
                 "checkpoints/last.pt", "checkpoints/best.pt", "checkpoints/best_ema.pt", "report.html",
                 "plots/losses.png", "plots/eval.png", "plots/confusion_matrix.png"):
        assert (fitted / name).is_file(), name
    # what a newcomer opens: the report, written by fit itself, with every plot inside
    report = (fitted / "report.html").read_text()
    assert report.count("data:image/png;base64,") == len(list((fitted / "plots").glob("*.png")))
    assert any((fitted / "tb").iterdir())
    rows = [json.loads(l) for l in (fitted / "metrics.jsonl").read_text().splitlines()]
    assert all("step" in r and "epoch" in r for r in rows)
    evals = [r for r in rows if r["kind"] == "eval"]
    assert len(evals) == 2 and "top1" in evals[-1] and "ema/top1" in evals[-1]
    # per class: the model's and the EMA's table, a row per digit, in the report too
    for key in ("per_class", "ema/per_class"):
        table = evals[-1][key]
        assert list(table) == [str(d) for d in range(10)] and sum(r["support"] for r in table.values()) == 360
        assert all(set(r) == {"precision", "recall", "F1", "support"} for r in table.values())
    assert report.count('<table class="classes">') == 2 and "<th>F1</th>" in report
    summary = json.loads((fitted / "summary.json").read_text())
    assert summary["final"]["top1"] > 80.0  # digits, 2 epochs of a small CNN
    assert summary["steps"] == 2 * (1437 // 64)
    # the resolved config is what ran: the overrides are in it
    assert "batch_size: 64" in (fitted / "config.yaml").read_text()
    # model.safetensors holds the final weights, equal to last.pt's
    last = load_checkpoint(fitted / "checkpoints" / "last.pt")
    final = load_file(str(fitted / "model.safetensors"))
    assert all(torch.equal(final[k], fmt.model_weights(last)[k]) for k in final)
    modes = {(fitted / n).stat().st_mode & 0o777 for n in ("model.safetensors", "checkpoints/last.pt")}
    assert len(modes) == 1  # the weights file gets the same permissions as the checkpoints (not 0600)


def test_validate_run_dir_reproduces_best_metric(fitted, capfd):
    proc = cli_here("validate", str(fitted), capture=capfd)  # a digits run: no workers, nothing to start
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    summary = json.loads((fitted / "summary.json").read_text())
    assert out["checkpoint"].endswith("best.pt")
    assert out["top1"] == pytest.approx(summary["best"]["model"])
    assert "ema/top1" in out


def test_refuses_to_overwrite_and_resume_auto_continues(fitted, tmp_path, capfd):
    files = {p: p.read_bytes() for p in fitted.rglob("*") if p.is_file()}
    code, _, err = in_process(capfd, "fit", "classify-fashion", *QUICK, "--run-dir", str(fitted))  # refused at once
    assert code == 2 and "--resume auto" in err
    assert {p: p.read_bytes() for p in fitted.rglob("*") if p.is_file()} == files  # nothing written
    # resume a finished 2-epoch run to 3 epochs: it continues from step 44
    # classify-fashion loads in-process (data.num_workers: 0): these fits run in this process
    code, out, err = in_process(capfd, "fit", "classify-fashion", *QUICK, "trainer.epochs=3", "--run-dir", str(fitted),
                                "--resume", "auto")
    assert code == 0, err
    assert "resumed from" in out and "at step 44" in out
    assert json.loads((fitted / "summary.json").read_text())["steps"] == 66
    # and again, now that it is finished: nothing to train, nothing in the run dir rewritten
    before = {p: p.read_bytes() for p in (fitted / "summary.json", fitted / "metrics.jsonl", fitted / "report.html",
                                          *(fitted / "tb").iterdir())}
    code, out, err = in_process(capfd, "fit", "classify-fashion", *QUICK, "trainer.epochs=3", "--run-dir", str(fitted),
                                "--resume", "auto")
    assert code == 0, err
    assert "at step 66, this run's last: nothing to train" in out
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 66
    assert all(p.read_bytes() == data for p, data in before.items())
    assert set((fitted / "tb").iterdir()) <= set(before)  # no new, empty TensorBoard events file


def test_config_errors_name_the_key(tmp_path, capfd):
    code, _, err = in_process(capfd, "show-config", "classify-fashion", "optim.lrr=1")
    assert code == 2 and "optim.lrr" in err and "optim.lr" in err
    code, _, err = in_process(capfd, "fit", "classify-fashion", "data.batch_size=big", "--run-dir", str(tmp_path / "x"))
    assert code == 2 and "data.batch_size" in err and "int" in err
    assert not (tmp_path / "x").exists()  # nothing written for a config that never ran


def test_recipes_and_show_config(capfd):
    code, out, _ = in_process(capfd, "recipes")
    assert code == 0
    names = [line.split()[0] for line in out.splitlines()]
    assert {"classify-fashion", "classify-mobilevit-imagenet"} <= set(names)
    code, out, _ = in_process(capfd, "show-config", "classify-mobilevit-imagenet", "optim.lr=3e-4")
    assert code == 0 and "lr: 0.0003" in out and "model: mobilevit_xs" in out
    code, out, _ = in_process(capfd, "show-config", "classify-fashion", "--docs")
    assert code == 0 and "trainer.log_every" in out and "schedules.lr.warmup" in out


def test_missing_dataset_path_is_a_clear_error(tmp_path):
    """The recipe as shipped, 8 DataLoader workers and all, in a real process: the missing root is
    found before a worker (or the forkserver) starts, and the whole of stderr says so in one line."""
    proc = vt("fit", "classify-mobilevit-imagenet", f"data.root={tmp_path / 'nope'}", "--run-dir",
              str(tmp_path / "r"))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("visiontrain: error: ") and str(tmp_path / "nope") in lines[0], \
        proc.stderr[-3000:]
    assert not (tmp_path / "r").exists()


def test_import_names_what_it_could_not_find(tmp_path, capsys, monkeypatch):
    from visiontrain.app.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", sys.path[:])  # --import adds the directory it imports from
    assert main(["--import", "no_such_task", "recipes"]) == 2
    assert "--import no_such_task: no module named 'no_such_task'" in capsys.readouterr().err
    assert main(["--import", "missing/task.py", "recipes"]) == 2
    assert "--import missing/task.py: no such file" in capsys.readouterr().err
    # a module found from the current directory, imported under its own name: its main block does not run
    (tmp_path / "my_registry.py").write_text("LOADED = __name__\nif __name__ == '__main__':\n    raise SystemExit(9)\n")
    assert main(["--import", "my_registry", "recipes"]) == 0
    assert sys.modules.pop("my_registry").LOADED == "my_registry"


def test_the_json_line_on_stdout_keeps_class_names_as_written(tmp_path):
    """fit's and validate's result line hold the class names (the per-class table): `Müll` and `树`
    print as they are, not as \\u escapes; on a stdout that cannot encode them (an ASCII locale) the
    line is escaped JSON rather than a UnicodeEncodeError."""
    from PIL import Image

    root = tmp_path / "imgs"
    for split in ("train", "val"):
        for c, shade in (("Müll", 40), ("树", 200)):
            (root / split / c).mkdir(parents=True)
            for i in range(4):
                Image.new("L", (8, 8), color=shade + 5 * i).save(root / split / c / f"{i}.png")
    run = tmp_path / "run"
    proc = run_cli("fit", "classify-fashion", "data.name=image-folder", f"data.root={root}", "data.image_size=8",
                   "data.batch_size=4", "trainer.epochs=1", "trainer.progress=plain", "--run-dir", str(run),
                   env={"PYTHONIOENCODING": "utf-8"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert '"Müll"' in line and '"树"' in line and "\\u" not in line
    assert set(json.loads(line)["final"]["per_class"]) == {"Müll", "树"}
    proc = run_cli("validate", str(run), env={"PYTHONIOENCODING": "ascii"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert line.isascii() and set(json.loads(line)["per_class"]) == {"Müll", "树"}


def test_a_launch_ends_with_the_failed_rank_s_own_status(capsys):
    """`fit --nproc`: a rank that said what happened (a lost peer, exit 6) gives the launch its status
    and nothing is added; a rank that died without a word (SIGKILL to every rank, the OOM killer) is
    named in one line, and the launch ends as a process killed by that signal (128 + 9)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from visiontrain.app.launch import launch_failure

    killed = ProcessFailure(local_rank=1, pid=123, exitcode=-9, error_file="/nonexistent")
    said = ProcessFailure(local_rank=0, pid=124, exitcode=6, error_file="/nonexistent")
    assert launch_failure(ChildFailedError("visiontrain", {1: killed, 0: said})) == 6
    assert capsys.readouterr().err == ""
    assert launch_failure(ChildFailedError("visiontrain", {1: killed})) == 137
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("visiontrain: error: rank 1 (pid 123) was killed by SIGKILL") and "--resume auto" in line


def test_rank_0_of_a_restartable_torchrun_run_names_the_store_setting_an_elastic_join_needs():
    """torch 2.13's agents share one store across rendezvous rounds by default, and a machine joining
    after a loss then waits until the rendezvous times out: rank 0 of the first round says so in one
    line where torchrun may start the ranks again and the setting is missing, and nowhere else."""
    from visiontrain.app.launch import elastic_store_hint

    elastic = {"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_MAX_RESTARTS": "3", "RANK": "0",
               "TORCHELASTIC_RESTART_COUNT": "0"}
    line = elastic_store_hint(elastic)
    assert line is not None and "(--max-restarts 3)" in line and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in line
    for other in ({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, {"RANK": "1"}, {"TORCHELASTIC_RESTART_COUNT": "1"},
                  {"TORCHELASTIC_MAX_RESTARTS": "0"}):
        assert elastic_store_hint({**elastic, **other}) is None, other
    assert elastic_store_hint({"RANK": "0"}) is None  # not under torchrun


def test_the_ranks_import_a_user_s_script_not_the_console_script(monkeypatch, tmp_path):
    """`fit --nproc` makes each rank import the script that ran the CLI, so that its task registers.
    Started as the `visiontrain` console script (a file that imports cli.main and calls it), the
    ranks were told to import that file too (`--import .venv/bin/visiontrain`)."""
    import types

    from visiontrain.app import cli
    from visiontrain.app.launch import users_main_file

    def main_module(file: str, **names) -> types.ModuleType:
        module = types.ModuleType("__main__")
        module.__file__ = file
        module.__dict__.update(names)
        return module

    script = tmp_path / "my_task.py"
    for module, want in ((main_module(str(tmp_path / "visiontrain"), main=cli.main), None),
                         (main_module(str(script), main=lambda: 0), str(script)),
                         (main_module(str(script)), str(script)),
                         (main_module(str(Path(cli.__file__).parents[1] / "__main__.py")), None)):
        monkeypatch.setitem(sys.modules, "__main__", module)
        assert users_main_file() == want, module.__file__
