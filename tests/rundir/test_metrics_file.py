"""metrics.jsonl: the rows RunLogger writes are what the one reader returns, damaged lines are named
or passed over as the caller asks, and a resume's rewind leaves each step once."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from visiontrain.rundir import metrics_file as M
from visiontrain.engine.records.run_log import RunLogger


def test_the_writer_and_the_reader_agree(tmp_path):
    log = RunLogger(tmp_path, total_steps=4, progress="plain")
    log.log(M.TRAIN, 2, 0, {"total": 0.5, "lr": 0.1})
    log.log(M.EVAL, 2, 0, {"top1": 50.0, M.ema_key("top1"): math.nan})
    log.log(M.TRAIN, 4, 1, {"total": 0.25, "lr": 0.1})
    log.close()
    first = json.loads((tmp_path / M.METRICS_FILE).read_text().splitlines()[0])
    assert tuple(first)[:4] == M.ROW_KEYS and first[M.ROW_KEYS[0]] == M.TRAIN
    train, evals = M.read_metrics(tmp_path)
    assert [r["step"] for r in train] == [2, 4] and [r["epoch"] for r in train] == [0, 1]
    assert math.isnan(evals[0]["ema/top1"])  # written as null, read back as a missing value
    metrics = M.read_metrics(tmp_path / M.METRICS_FILE)  # the file itself reads the same
    assert metrics.eval_keys == ["top1", "ema/top1"] and metrics.last_step == 4
    assert M.numeric_keys(train) == ["total", "lr"] and M.series(train, "total") == ([2, 4], [0.5, 0.25])


def test_ema_keys_are_spelled_once():
    assert M.ema_key("top1") == "ema/top1" and M.is_ema("ema/top1") and not M.is_ema("top1")
    assert M.model_key("ema/top1") == "top1" and M.model_key("top1") == "top1"


def test_a_damaged_line_is_named_when_strict_and_passed_over_otherwise(tmp_path):
    rows = [{"kind": "train", "step": 1, "total": 1.0}, {"kind": "other", "step": 1}, [1, 2]]
    path = tmp_path / M.METRICS_FILE
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n" + '{"kind": "tr')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 3: not a JSON object \(a list\)"):
        M.read_metrics(tmp_path)
    path.write_text(json.dumps(rows[0]) + "\n" + '{"kind": "tr')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2: not a JSON object"):
        M.read_metrics(tmp_path)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "tr')
    train, evals = M.read_metrics(tmp_path, strict=False)
    assert train == [rows[0]] and evals == []  # other kinds are no rows of the schema


def test_a_missing_file_names_the_run_dir_it_expected(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a visiontrain run dir") as err:
        M.read_metrics(tmp_path / "nowhere", strict=False)
    assert str(tmp_path / "nowhere" / M.METRICS_FILE) in str(err.value)


def test_rewind_keeps_what_was_logged_up_to_the_checkpoint(tmp_path):
    path = tmp_path / M.METRICS_FILE
    rows = [M.make_row(M.TRAIN, s, 0, {"total": 1.0 / s}, now=0.0) for s in (2, 4, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "train", "step": 3')
    M.rewind(path, 4)
    assert [r["step"] for r in M.read_metrics(path).train] == [2, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == [M.METRICS_FILE]  # no temporary file left


def test_report_and_compare_read_runs_without_torch():
    code = "import sys, visiontrain.report.page, visiontrain.report.compare; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_resumed_logger_appends_after_the_rewound_rows(tmp_path):
    log = RunLogger(tmp_path, total_steps=4, progress="plain")
    for step in (1, 2, 3):
        log.log(M.TRAIN, step, 0, {"total": 1.0})
    log.rewind(2)  # resumed from the checkpoint at step 2: step 3 is logged again
    log.log(M.TRAIN, 3, 0, {"total": 0.5})
    log.close()
    train, _ = M.read_metrics(tmp_path)
    assert [(r["step"], r["total"]) for r in train] == [(1, 1.0), (2, 1.0), (3, 0.5)]
