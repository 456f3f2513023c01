"""A task's per-class table on its way through the engine: one key (``metrics_file.PER_CLASS``) in the
eval row of metrics.jsonl, an aligned table in the log (a rich one on a terminal), a section of the
report, and out of everything that wants numbers (curves, compare, best checkpoints, final table)."""
from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace

import pytest

from visiontrain.app import cli
from visiontrain.rundir import metrics_file as M
from visiontrain.engine.records.run_log import LOWEST_ROWS, MAX_CLASS_ROWS, RunLogger

TABLE = {"cat": {"AP": 0.25, "AP50": 0.5, "n_gt": 3},
         "a class whose name is far too long for a console column": {"AP": math.nan, "AP50": math.nan, "n_gt": 0},
         "[bold]dog": {"AP": 0.125, "AP50": 1.0, "n_gt": 12}}


def _log_eval(run_dir, progress: str = "plain") -> None:
    log = RunLogger(run_dir, total_steps=4, progress=progress)
    log.log(M.EVAL, 4, 1, {"AP": 0.5, M.PER_CLASS: TABLE, M.ema_key("AP"): 0.25, M.ema_key(M.PER_CLASS): TABLE})
    log.table("final", {"AP": 0.5, M.PER_CLASS: TABLE, "wall_s": 3.0})
    log.close()


def test_the_table_is_logged_once_and_read_back_but_is_no_metric(tmp_path, capsys):
    _log_eval(tmp_path)
    lines = capsys.readouterr().out.splitlines()
    assert "AP 0.5000" in lines[0] and "ema/AP 0.2500" in lines[0] and "{" not in lines[0]
    first = lines.index(next(line for line in lines if line.endswith("[eval] per_class at step 4:")))
    table = [line[20:] for line in lines[first + 1:first + 5]]  # under the timestamp's width
    assert re.split(r"\s+", table[0].strip()) == ["class", "AP", "AP50", "n_gt"]
    assert table[1].split() == ["cat", "0.2500", "0.5000", "3"] and table[3].split()[-1] == "12"
    assert "a class whose name is far..." in table[2]  # cut to NAME_WIDTH in the log only
    assert table[2].split()[-3:] == ["\u2014", "\u2014", "0"] and "nan" not in table[2]  # NaN (null): a dash
    assert len({len(row) for row in table}) == 1  # aligned: numbers right, every row as wide
    assert any("[eval] ema/per_class at step 4:" in line for line in lines)
    assert "final:" in lines[-1] and "per_class" not in lines[-1] and "wall_s 3.00" in lines[-1]

    row = json.loads((tmp_path / M.METRICS_FILE).read_text())
    assert row[M.PER_CLASS]["a class whose name is far too long for a console column"]["AP"] is None  # NaN: null
    assert list(row[M.PER_CLASS]) == list(TABLE)
    evals = M.read_metrics(tmp_path).evals
    assert math.isnan(evals[0][M.PER_CLASS]["a class whose name is far too long for a console column"]["AP50"])
    assert M.read_metrics(tmp_path).eval_keys == ["AP", "ema/AP"] and M.numeric_keys(evals) == ["AP", "ema/AP"]
    assert M.is_per_class("ema/per_class") and not M.is_per_class("AP")
    assert list(M.per_class_tables(evals[0])) == ["per_class", "ema/per_class"]


def test_a_table_read_back_from_json_prints_a_dash_for_null(tmp_path, capsys):
    """What `validate` and the log print of a table whose undefined values are null (metrics.jsonl,
    summary.json), NaN (a fresh evaluation) or absent: one dash for all three, never nan or None."""
    from visiontrain.engine.records.run_log import class_table_text

    text = class_table_text("per_class", {"cat": {"AP": 0.25, "n_gt": 3}, "empty": {"AP": None, "n_gt": 0},
                                          "fresh": {"AP": math.nan, "n_gt": 0}, "short": {"n_gt": 1}})
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()[2:]}
    assert rows == {"cat": ["0.2500", "3"], "empty": ["\u2014", "0"], "fresh": ["\u2014", "0"], "short": ["\u2014", "1"]}
    _log_eval(tmp_path, progress="bar")  # the rich table on a terminal
    out = capsys.readouterr().out
    assert "\u2014" in out and "nan" not in out


def test_on_a_terminal_the_table_is_a_rich_table_of_plain_names(tmp_path, capsys):
    _log_eval(tmp_path, progress="bar")
    out = capsys.readouterr().out
    assert "[bold]dog" in out and "n_gt" in out and "0.1250" in out  # a name is text, never markup


def test_a_table_of_many_classes_prints_its_lowest_rows(tmp_path, capsys):
    many = {f"class {i:04d}": {"recall": (i * 7919 % 1000) / 1000, "support": 5} for i in range(MAX_CLASS_ROWS + 50)}
    log = RunLogger(tmp_path, total_steps=1, progress="plain")
    log.log(M.EVAL, 1, 0, {"top1": 50.0, M.PER_CLASS: many})
    log.close()
    lines = capsys.readouterr().out.splitlines()
    assert f"the {LOWEST_ROWS} lowest recall of {MAX_CLASS_ROWS + 50} classes" in lines[1]
    shown = [float(line.split()[-2]) for line in lines[3:]]
    assert len(shown) == LOWEST_ROWS and shown == sorted(v["recall"] for v in many.values())[:LOWEST_ROWS]


def test_the_report_shows_the_table_and_compare_and_best_checkpoints_pass_it_over(tmp_path, capsys):
    from visiontrain.report.compare import read_run, table_rows
    from visiontrain.engine.parts.checkpointer import Checkpointer
    from visiontrain.engine.state.checkpoint import BestTracker
    from visiontrain.report.page import build_report

    _log_eval(tmp_path)
    html = build_report(tmp_path)
    section = html[html.index("<h2>Per class</h2>"):]
    assert section.count('<table class="classes">') == 2  # the model's and the EMA's
    assert "<th>class</th><th>AP</th><th>AP50</th><th>n_gt</th>" in section
    assert '<tr><th>cat</th><td class="num">0.25</td><td class="num">0.5</td><td class="num">3</td></tr>' in section
    assert "<th>[bold]dog</th>" in section and "far too long for a console column</th>" in section  # whole names
    metrics = html[html.index("<h2>Metrics</h2>"):html.index("<h2>Per class</h2>")]
    assert "per_class" not in metrics and "<th>ema/AP</th>" in metrics

    columns, _ = table_rows([read_run(tmp_path)])
    assert "per_class" not in columns and "ema/per_class" not in columns and "AP" in columns
    assert cli.main(["compare", str(tmp_path), str(tmp_path), "--metrics", "per_class"]) == 2
    assert "a per-class table, not a curve" in capsys.readouterr().err

    keeper = Checkpointer.__new__(Checkpointer)  # only what keep_best reads
    keeper.built, keeper.metric, keeper.best = SimpleNamespace(sharded=None), M.PER_CLASS, BestTracker(tmp_path, "max")
    with pytest.raises(ValueError, match=r"eval.metric='per_class' is a per-class table, not a number: .*\['AP'\]"):
        keeper.keep_best({"AP": 0.5, M.PER_CLASS: TABLE})
