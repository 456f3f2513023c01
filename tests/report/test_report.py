"""visiontrain report: one self-contained HTML page for a real run, rendered by headless Chromium.

The page is checked twice: as text (the metrics, the config, the embedded PNGs, nothing fetched from
elsewhere) and as pixels (Chromium draws it, and the screenshot is not a blank page and shows the
embedded plot), because an HTML file can hold every string and still render as nothing.
Without Chromium the rendering test is skipped, unless VISIONTRAIN_REQUIRE_CHROMIUM=1 (CI) makes
that a failure.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from toy_task import toy_config, train
from visiontrain.app import cli
from visiontrain.report import page as report

RED = (1.0, 0.0, 0.0)  # the test plot's bars: found again in the screenshot, so the PNG was drawn


def _plot(path: Path, color: tuple[float, float, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(range(4), [3, 5, 2, 4], color=color, width=0.9)
    ax.set(title=path.stem)
    fig.savefig(path, dpi=100)
    plt.close(fig)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A real finished run (a few seconds) with EMA, and two PNGs under plots/."""
    run_dir = tmp_path_factory.mktemp("runs") / "toy-run"
    train(toy_config(ema__enabled=True), run_dir)
    (run_dir / "plots").mkdir(exist_ok=True)
    _plot(run_dir / "plots" / "z_last.png", (0.2, 0.4, 0.8))
    _plot(run_dir / "plots" / "a_first.png", RED)
    return run_dir


def _report(args: list[str], capsys) -> dict:
    assert cli.main(["report", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _chromium() -> str | None:
    return shutil.which("chromium") or next((p for p in ("/usr/bin/chromium", "/usr/bin/chromium-browser")
                                             if os.access(p, os.X_OK)), None)


def test_report_holds_metrics_config_and_plots_and_nothing_external(run, tmp_path, capsys):
    out = tmp_path / "report.html"
    result = _report([str(run), "--out", str(out)], capsys)
    pngs = sorted(p.name for p in (run / "plots").glob("*.png"))  # ours, and any the trainer wrote
    assert result["report"] == str(out) and result["plots"] == len(pngs) >= 2
    html = out.read_text(encoding="utf-8")
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    best_model = min(evals, key=lambda r: r["mse"])
    assert summary["best"]["model"] == best_model["mse"]
    for needle in ("toy-run", "finished", "task <b>toy</b>",  # run name, status, task
                   "ema/mse", f"{summary['final']['mse']:.4g}", f"{summary['final']['ema/mse']:.4g}",  # final
                   f"{best_model['mse']:.4g} at step {best_model['step']}",  # best, with its step
                   f"<th>steps</th><td class=\"num\">{summary['steps']}</td>", "mean samples/s", "data-wait share",
                   "wall time", "config.yaml", "poison_step: -1", "batch_size: 32"):  # the config, verbatim
        assert needle in html, needle
    assert html.count('src="data:image/png;base64,') == len(pngs)
    # the reading order: the data, the training curves, the evaluation's figures; then the rest by name
    shown = sorted(pngs, key=lambda name: html.index(f"<figcaption>{name}</figcaption>"))
    known = [n for n in shown if n[:-4] in report.PLOT_ORDER]
    assert known == sorted(known, key=lambda n: report.PLOT_ORDER.index(n[:-4])) and "eval.png" in known
    assert shown == known + sorted(n for n in pngs if n not in known)
    assert not re.search(r"""(src|href|url)\s*[=(]\s*["']?\s*(https?:)?//""", html, re.I), "an external resource"
    assert "<script" not in html.lower() and "<link" not in html.lower()


def test_report_renders_in_headless_chromium(run, tmp_path, capsys):
    chromium = _chromium()
    if chromium is None:
        if os.environ.get("VISIONTRAIN_REQUIRE_CHROMIUM") == "1":
            pytest.fail("VISIONTRAIN_REQUIRE_CHROMIUM=1 but no chromium on PATH or in /usr/bin "
                        "(bash scripts/setup.sh installs Debian's chromium when run as root)")
        pytest.skip("chromium is not installed (apt-get install chromium); the HTML is still checked as text")
    html = tmp_path / "report.html"
    _report([str(run), "--out", str(html)], capsys)
    shot = tmp_path / "screenshot.png"
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", f"--screenshot={shot}",
           "--window-size=1200,4000", html.as_uri()]  # the whole page of a toy run
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and shot.is_file(), \
        f"chromium failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}"

    import numpy as np
    from PIL import Image

    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    assert pixels.shape[:2] == (4000, 1200)
    ink = (pixels.min(axis=2) < 200).mean()  # text, rules and plots; the page itself is (near) white
    colours = len(np.unique(pixels.reshape(-1, 3), axis=0))
    red = ((pixels[..., 0] > 200) & (pixels[..., 1] < 60) & (pixels[..., 2] < 60)).sum()
    assert ink > 0.005 and colours > 50, f"a blank page: {ink:.2%} non-white pixels, {colours} colours"
    assert red > 5000, f"the embedded red plot is not on the page ({red} red pixels)"


def test_an_unfinished_run_without_plots_gets_a_report_with_its_curves(run, tmp_path, capsys):
    partial = tmp_path / "partial"
    shutil.copytree(run, partial, ignore=shutil.ignore_patterns("plots", "report.html"))
    (partial / "summary.json").unlink()
    last_step = max(json.loads(line)["step"] for line in (partial / "metrics.jsonl").read_text().splitlines())
    result = _report([str(partial)], capsys)  # default: RUN_DIR/report.html
    # the curves are drawn from metrics.jsonl for a run that has none (trainer.plots=false)
    assert result["report"] == str(partial / "report.html") and result["plots"] == 4
    html = (partial / "report.html").read_text(encoding="utf-8")
    for needle in ("unfinished: no summary.json", "losses.png", f"<td class=\"num\">{last_step}</td>",
                   "best mse (min, the checkpoint metric)", "data-wait share", "between first and last row"):
        assert needle in html, needle


def test_a_fit_with_plots_off_draws_none_and_its_page_says_so_until_report_draws_them(tmp_path, capsys):
    """trainer.plots=false: the fit's own report.html draws no curves (before, it drew them all at the
    end, about 2 s of CPU on the 2-core machine, the setting notwithstanding); `visiontrain report` does."""
    run_dir = tmp_path / "run"
    code = cli.main(["fit", "classify-fashion", "data.name=digits", "trainer.max_steps=2", "trainer.plots=false",
                     "--run-dir", str(run_dir)])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert not list(run_dir.rglob("*.png"))
    html = Path(result["report"]).read_text(encoding="utf-8")
    assert "<h2>Plots (0)</h2>" in html and "trained with trainer.plots=false" in html
    assert _report([str(run_dir)], capsys)["plots"] == 4  # losses, schedules, throughput, eval
    assert sorted(p.name for p in (run_dir / "plots").glob("*.png")) == ["eval.png", "losses.png", "schedules.png",
                                                                         "throughput.png"]


def test_text_is_escaped(run, tmp_path, capsys):
    odd = tmp_path / "<b>odd&run</b>"
    shutil.copytree(run, odd, ignore=shutil.ignore_patterns("report.html"))
    _report([str(odd)], capsys)
    html = (odd / "report.html").read_text(encoding="utf-8")
    assert "&lt;b&gt;odd&amp;run&lt;/b&gt;" in html and "<b>odd&run</b>" not in html


def test_missing_or_corrupt_files_are_one_line_errors_naming_the_file(run, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["report", str(empty)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{empty / 'metrics.jsonl'} does not exist" in err and len(err.splitlines()) == 1
    assert not (empty / "report.html").exists()

    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    (bad / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "total": 1.0}\n{"kind": "tr')
    assert cli.main(["report", str(bad), "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{bad / 'metrics.jsonl'}, line 2: not a JSON object" in err and len(err.splitlines()) == 1

    (bad / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text())
    (bad / "summary.json").write_text('{"steps": 16, "fin')  # a write cut short
    assert cli.main(["report", str(bad), "--out", str(tmp_path / "r.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{bad / 'summary.json'}: not valid JSON" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "r.html").exists()


def test_an_undefined_per_class_value_shows_a_dash_as_the_log_prints_it(run, tmp_path, capsys):
    """A class without ground truth has AP null in metrics.jsonl: the report's per-class table shows
    "—" there, as the log's table does, not "nan"."""
    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("report.html"))
    rows = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    last = max((r for r in rows if r["kind"] == "eval"), key=lambda r: r["step"])
    last["per_class"] = {"shirt": {"AP": 0.5, "n_gt": 3}, "unseen": {"AP": None, "n_gt": 0}}
    with open(copy / "metrics.jsonl", "a") as f:
        f.write(json.dumps(last) + "\n")
    _report([str(copy)], capsys)
    html = (copy / "report.html").read_text(encoding="utf-8")
    table = html[html.index("<h2>Per class</h2>"):]
    assert '<th>unseen</th><td class="num">—</td>' in table and ">nan<" not in table
