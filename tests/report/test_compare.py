"""visiontrain compare: two real runs side by side, as a table and as curves on shared axes."""
from __future__ import annotations

import json

import pytest

from toy_task import toy_config, train
from visiontrain.app import cli


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    for name, lr, ema in (("slow", 0.01, False), ("fast", 0.05, True)):
        train(toy_config(optim__lr=lr, ema__enabled=ema), root / name)
    return root


def test_compare_prints_both_runs_and_draws_the_shared_curves(runs, tmp_path, capsys):
    out = tmp_path / "cmp.png"
    assert cli.main(["compare", str(runs / "slow"), str(runs / "fast"), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    summary = json.loads((runs / "fast" / "summary.json").read_text())
    for needle in ("slow", "fast", "mse", f"{summary['final']['mse']:.4g}", "ema/mse", "curves on shared axes"):
        assert needle in text, needle
    import matplotlib.image

    pixels = matplotlib.image.imread(out)
    assert pixels.shape[0] > 200 and pixels.std() > 0.05  # a drawn figure, not a blank canvas


def test_an_unfinished_run_is_read_from_its_metrics_alone(runs, tmp_path, capsys):
    import shutil

    partial = tmp_path / "partial"
    shutil.copytree(runs / "slow", partial)
    (partial / "summary.json").unlink()
    last_step = json.loads((partial / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert cli.main(["compare", str(partial), str(runs / "fast"), "--out", str(tmp_path / "c.png"),
                     "--metrics", "mse"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "partial" in line)
    assert f" {last_step} " in row


def test_bad_run_dirs_and_metrics_are_named(runs, tmp_path, capsys):
    assert cli.main(["compare", str(tmp_path), "--out", str(tmp_path / "c.png")]) == 2
    assert f"{tmp_path / 'metrics.jsonl'} does not exist" in capsys.readouterr().err

    assert cli.main(["compare", str(runs / "slow"), "--metrics", "AP", "--out", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err
    assert "--metrics AP: not logged by slow" in err and "'mse'" in err

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "total": 1.0}\n{"kind": "tr')
    assert cli.main(["compare", str(bad), "--out", str(tmp_path / "c.png")]) == 2
    assert f"{bad / 'metrics.jsonl'}, line 2: not a JSON object" in capsys.readouterr().err


def test_same_named_runs_are_told_apart(runs, tmp_path, capsys):
    import shutil

    other = tmp_path / "elsewhere" / "slow"
    shutil.copytree(runs / "slow", other)
    assert cli.main(["compare", str(runs / "slow"), str(other), "--out", str(tmp_path / "c.png")]) == 0
    text = capsys.readouterr().out
    assert "elsewhere/slow" in text


def test_an_undefined_metric_is_the_dash_the_log_and_the_report_show(runs, tmp_path, capsys):
    """A metric with no value (COCO's APl where no large object exists: NaN, written as null) was
    printed as ``nan`` by compare, and as a dash by the log and the report."""
    import shutil

    from visiontrain.rundir.metrics_file import UNDEFINED

    run = tmp_path / "undefined"
    shutil.copytree(runs / "slow", run)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last_eval = max(i for i, r in enumerate(rows) if r.get("kind") == "eval")
    rows[last_eval]["mse"] = None
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli.main(["compare", str(run), str(runs / "fast"), "--out", str(tmp_path / "c.png"),
                     "--metrics", "mse"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if " undefined " in line)
    assert UNDEFINED in line and "nan" not in line, line
