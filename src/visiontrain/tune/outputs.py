"""What a study leaves for its reader, in the study dir: ``study.json`` (the study, its best trial, every
trial), ``trials.csv`` (a row per trial), ``best.yaml`` (the best trial's config: a recipe to train
with ``visiontrain fit``), plots of the search (``plots/``) and ``report.html``, a page with all of it.
Written again after each trial ends and when the tuner stops, from the study's storage: a tuner on
another machine sees its own copy of the same study.
"""
from __future__ import annotations

import csv
import datetime as dt
import io
import json
import logging
import math
from html import escape
from pathlib import Path
from typing import Any

from visiontrain.core import config as C
from visiontrain.engine.records.run_log import dumps_json
from visiontrain.rundir.metrics_file import value_text
from visiontrain.rundir.run_files import METRICS_FILE, MLFLOW_RUN_FILE, REPORT_FILE
from visiontrain.engine.state.checkpoint import write_run_file
from visiontrain.core.redact import redact_url
from visiontrain.report.page import CSS, _duration, _figure, write_report
from visiontrain.tune.study import FAILURE_ATTR, RESUMES_ATTR, RUN_DIR_ATTR, Search, counted, trial_number
from visiontrain.tune.space import override
from visiontrain.tune.trial import Outcome

log = logging.getLogger("visiontrain")

STUDY_FILE, TRIALS_FILE, BEST_FILE, STUDY_PLOTS = "study.json", "trials.csv", "best.yaml", "plots"
#: In each trial's run dir: the study, the trial's number, parameters and how it ended.
TRIAL_FILE = "trial.json"
PLOTS = ("history", "importances", "parallel_coordinates")


def trial_rows(search: Search) -> list[dict[str, Any]]:
    """A row per counted trial (``tuning.counted``), in order: ``number`` is the trial's (its run
    dir's), ``optuna_trial`` the attempt's number in Optuna's study, ``resumed`` whether that attempt
    continued an interrupted one."""
    rows = []
    for t in counted(search.study.get_trials(deepcopy=False)):
        seconds = (t.datetime_complete - t.datetime_start).total_seconds() \
            if t.datetime_complete and t.datetime_start else None
        params = t.params or t.system_attrs.get("fixed_params", {})  # a waiting trial's are fixed, not drawn yet
        rows.append({"number": trial_number(t), "optuna_trial": t.number, "state": t.state.name.lower(),
                     "value": t.value,
                     "params": {p.key: p.value_of(params[p.key]) for p in search.space if p.key in params},
                     "run_dir": t.user_attrs.get(RUN_DIR_ATTR), "seconds": seconds,
                     "evaluations": t.last_step, "resumed": RESUMES_ATTR in t.user_attrs,
                     "failure": t.user_attrs.get(FAILURE_ATTR)})
    return rows


def best_row(search: Search, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    done = [r for r in rows if r["state"] == "complete" and r["value"] is not None]
    if not done:
        return None
    pick = max if search.objective.mode == "max" else min
    return pick(done, key=lambda r: r["value"])


def write_outputs(search: Search, *, plots: bool) -> dict[str, Any]:
    """study.json, trials.csv, best.yaml (once a trial completed), and with ``plots`` the figures and
    the report page. Returns study.json's content."""
    s, root = search.settings, search.settings.study_dir
    rows = trial_rows(search)
    best = best_row(search, rows)
    states = [r["state"] for r in rows]
    summary = {"study": s.name(), "storage": redact_url(s.storage_url()), "recipe": s.recipe,
               "overrides": s.overrides, "space": s.space, "metric": search.objective.metric,
               "direction": search.objective.direction, "trials_wanted": s.trials,
               "counts": {state: states.count(state) for state in sorted(set(states))},
               "best": best, "trials": rows}
    write_run_file(root, STUDY_FILE, dumps_json(summary, indent=2) + "\n")
    write_run_file(root, TRIALS_FILE, _table_csv(search, rows))
    if best is not None:
        write_best_recipe(search, best)
    if plots:
        figures = write_plots(search)
        write_run_file(root, REPORT_FILE, study_page(search, summary, figures))
    return summary


def _table_csv(search: Search, rows: list[dict[str, Any]]) -> str:
    keys = [p.key for p in search.space]
    text = io.StringIO()
    out = csv.writer(text)
    out.writerow(["trial", "state", search.objective.metric, *keys, "seconds", "evaluations", "run_dir",
                  "optuna_trial", "resumed", "failure"])
    for r in rows:
        out.writerow([r["number"], r["state"], r["value"], *(r["params"].get(k) for k in keys), r["seconds"],
                      r["evaluations"], r["run_dir"], r["optuna_trial"], r["resumed"], r["failure"]])
    return text.getvalue()


def write_best_recipe(search: Search, best: dict[str, Any]) -> Path:
    """The best trial's config as a recipe: the recipe, the study's overrides (not the tuner's own
    tracking ones) and the trial's parameters, resolved and checked as ``fit`` will read them."""
    s = search.settings
    searched = [override(k, v) for k, v in best["params"].items()]
    overrides = [*s.overrides, *([f"eval.metric={s.metric}"] if s.metric else []), *searched]
    cfg = C.load_config(s.recipe, overrides)
    header = [f"# The best trial of study {s.name()!r}: trial {best['number']}, {search.objective.metric} "
              f"{best['value']:.6g} ({best['run_dir']})",
              f"# recipe {s.recipe}, with: {' '.join([*s.overrides, *searched])}",
              f"# written {dt.datetime.now().astimezone().isoformat(timespec='seconds')} by visiontrain tune; "
              f"train it with: visiontrain fit {s.study_dir / BEST_FILE}"]
    write_run_file(s.study_dir, BEST_FILE, "\n".join(header) + "\n" + C.dump_config(cfg))
    return s.study_dir / BEST_FILE


def write_plots(search: Search) -> dict[str, str]:
    """The search's figures as PNGs (Optuna's matplotlib plots); a figure the study cannot make yet
    (importances need two finished trials that differ) is left out with the reason."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as ovm

    out_dir = search.settings.study_dir / STUDY_PLOTS
    out_dir.mkdir(exist_ok=True)
    makers = {"history": ovm.plot_optimization_history, "importances": ovm.plot_param_importances,
              "parallel_coordinates": ovm.plot_parallel_coordinate}
    why_not: dict[str, str] = {}
    if not any(t.state.name == "COMPLETE" for t in search.study.get_trials(deepcopy=False)):
        return {name: "no trial has completed yet" for name in makers}
    for name, make in makers.items():
        try:
            ax = make(search.study, target_name=search.objective.metric)
            fig = ax.figure if hasattr(ax, "figure") else ax.flat[0].figure
            fig.set_size_inches(8, 5)
            fig.tight_layout()
            fig.savefig(out_dir / f"{name}.png", dpi=100)
            plt.close(fig)
        except (ValueError, RuntimeError, ZeroDivisionError) as err:
            why_not[name] = f"{type(err).__name__}: {err}"
            (out_dir / f"{name}.png").unlink(missing_ok=True)
    return why_not


def study_page(search: Search, summary: dict[str, Any], why_not: dict[str, str]) -> str:
    """The study's report: the search, its best trial, every trial (linked to its own report) and the plots."""
    root, metric = search.settings.study_dir, search.objective.metric
    best = summary["best"]
    head = [("study", summary["study"]), ("storage", summary["storage"]), ("recipe", summary["recipe"]),
            ("overrides", " ".join(summary["overrides"]) or "none"), ("metric", f"{metric} ({summary['direction']})"),
            ("trials", ", ".join(f"{v} {k}" for k, v in summary["counts"].items()) + f" of {summary['trials_wanted']}")]
    parts = [f"<h1>Study {escape(summary['study'])}</h1>", _rows(head)]
    if best:
        parts += [f"<h2>Best: trial {best['number']}, {escape(metric)} {value_text(best['value'])}</h2>",
                  _rows([(k, value_text(v)) for k, v in best["params"].items()]),
                  f'<p class="muted">as a recipe: <a href="{BEST_FILE}">{BEST_FILE}</a></p>']
    parts += ["<h2>Trials</h2>", _trials_table(search, summary["trials"], root), "<h2>The search</h2>",
              '<div class="plots">']
    for name in PLOTS:
        png = root / STUDY_PLOTS / f"{name}.png"
        parts.append(_figure(png, root) if png.is_file() else
                     f'<p class="muted">{name}: not drawn ({escape(why_not.get(name, "no figure"))})</p>')
    parts.append("</div>")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>study {escape(summary['study'])}</title>"
            f"<style>{CSS}</style></head><body><main>{''.join(parts)}</main></body></html>")


def _rows(rows: list[tuple[str, str]]) -> str:
    return "<table>" + "".join(f"<tr><th>{escape(k)}</th><td>{escape(str(v))}</td></tr>" for k, v in rows) + "</table>"


def _trials_table(search: Search, rows: list[dict[str, Any]], root: Path) -> str:
    keys = [p.key for p in search.space]
    head = "".join(f"<th>{escape(h)}</th>" for h in ["trial", "state", search.objective.metric, *keys, "time", "run"])
    body = []
    for r in rows:
        report = root / (r["run_dir"] or "") / REPORT_FILE
        link = f'<a href="{escape(r["run_dir"])}/{REPORT_FILE}">report</a>' if r["run_dir"] and report.is_file() \
            else escape(r["run_dir"] or "")
        note = r["failure"] or ("resumed after an interruption" if r["resumed"] else "")
        cells = [str(r["number"]), r["state"] + (f" ({note})" if note else ""), value_text(r["value"]),
                 *(value_text(r["params"].get(k)) for k in keys), _duration(r["seconds"]) if r["seconds"] else ""]
        body.append("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + f"<td>{link}</td></tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def summary_text(search: Search, summary: dict[str, Any]) -> str:
    """The study as the console shows it when the tuner ends: a line per trial, then the best."""
    keys = [p.key for p in search.space]
    lines = [f"study {summary['study']}: " + ", ".join(f"{v} {k}" for k, v in summary["counts"].items())]
    for r in summary["trials"]:
        value = "" if r["value"] is None or (isinstance(r["value"], float) and math.isnan(r["value"])) \
            else f"{r['value']:.6g}"
        params = " ".join(f"{k}={value_text(r['params'].get(k))}" for k in keys)
        lines.append(f"  trial {r['number']:>4}  {r['state']:<9} {value:>10}  {params}")
    best = summary["best"]
    if best:
        lines.append(f"best: trial {best['number']}, {search.objective.metric} {best['value']:.6g}: "
                     f"{search.settings.study_dir / BEST_FILE}")
    return "\n".join(lines)


def after_trial(search: Search, trial: Any, outcome: Outcome, run_dir: Path) -> None:
    """After each trial: ``trial.json`` in its run dir (what the tuner made of it: a pruned trial
    says so there), its report if the fit did not finish, its MLflow run's tags, the study's files."""
    record = {"study": search.settings.name(), "trial": trial_number(trial), "optuna_trial": trial.number,
              "state": outcome.state,
              "value": outcome.value, "reason": outcome.reason or None, "pruned_at_step": outcome.pruned_at,
              "exit_code": outcome.exit_code, "params": {p.key: p.value_of(trial.params[p.key])
                                                          for p in search.space if p.key in trial.params}}
    if run_dir.is_dir():
        write_run_file(run_dir, TRIAL_FILE, dumps_json(record, indent=2) + "\n")
    if (run_dir / METRICS_FILE).is_file() and not (run_dir / REPORT_FILE).is_file():
        write_report(run_dir, as_trained=True)  # a fit writes its report when it finishes; a pruned one stopped first
    try:
        tag_mlflow_run(search, run_dir, outcome.state, outcome.value)
    except Exception as err:  # noqa: BLE001 - a tracker never stops the search
        log.warning(f"visiontrain: warning: MLflow tags of {run_dir} not written: {type(err).__name__}: {err}")
    write_outputs(search, plots=False)


def tag_mlflow_run(search: Search, run_dir: Path, state: str, value: float | None) -> None:
    """Name the study and the trial's outcome on the trial's MLflow run (``logging.mlflow``), so that the
    UI can sort and filter the trials of a study."""
    path = run_dir / MLFLOW_RUN_FILE
    if not path.is_file():
        return
    saved = json.loads(path.read_text())
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=saved["tracking_uri"])
    tags = {"visiontrain.tune.study": search.settings.name(), "visiontrain.tune.trial": run_dir.name,
            "visiontrain.tune.state": state}
    if value is not None:
        tags["visiontrain.tune.value"] = f"{value:.6g}"
    for key, text in tags.items():
        client.set_tag(saved["run_id"], key, text)
