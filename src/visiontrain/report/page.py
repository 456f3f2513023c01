"""``visiontrain report RUN_DIR``: one self-contained HTML page for a run dir.

The page is meant to be mailed, attached to a ticket or archived next to the checkpoints, so it
holds everything itself: inline CSS, no scripts, and every figure of ``RUN_DIR/plots/`` embedded as
a base64 ``data:`` URI. Nothing is fetched when it is opened, so it renders the same offline and
years later. The run is read by ``compare.read_run`` (``summary.json``, and ``metrics.jsonl``
through ``engine.records.metrics_file``, the one reader of that file), so a run still training or stopped
early (no ``summary.json``) gets a report from its logged rows alone, and a missing or corrupt
``metrics.jsonl`` is the same one-line error as in ``visiontrain compare``. A task's per-class
table (``metrics_file.PER_CLASS``) of the last evaluation is its own section, an HTML table.
"""
from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import math
import tempfile
from html import escape
from pathlib import Path
from typing import Any

import yaml

from visiontrain import catalog

from visiontrain.core import safe_yaml
from visiontrain.report.compare import RunRecord, read_run
from visiontrain.rundir.metrics_file import (COMPUTE_S, DATA_S, EPOCH, ROW_KEYS, SAMPLES_PER_S, STEP, TIME, ema_key,
                                             is_number, is_per_class, per_class_tables, value_text)
from visiontrain.engine.records.plots import write_curves
from visiontrain.engine.records.provenance import read_provenance
from visiontrain.engine.records.run_log import INPUT_BOUND, input_bound_hint
from visiontrain.rundir.run_files import (CONFIG_FILE, MODEL_SUMMARY_FILE, PLOTS_DIR, PROVENANCE_FILE, REPORT_FILE,
                                          SUMMARY_FILE)
from visiontrain.rundir.write_failure import WriteError, why_not_written

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1f2328;
       background: #f6f8fa; margin: 0; }
main { max-width: 1100px; margin: 0 auto; padding: 24px 32px 48px; background: #fff;
       box-shadow: 0 0 0 1px #d0d7de; min-height: 100vh; }
h1 { font-size: 24px; margin: 0 0 4px; } h2 { font-size: 18px; margin: 28px 0 8px;
     border-bottom: 1px solid #d0d7de; padding-bottom: 4px; }
.sub { color: #57606a; margin: 0 0 12px; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px; color: #fff; }
.done { background: #1a7f37; } .open { background: #bf8700; }
table { border-collapse: collapse; margin: 4px 0 8px; }
th, td { text-align: left; padding: 4px 14px 4px 0; border-bottom: 1px solid #eaeef2; }
th { color: #57606a; font-weight: 600; } td.num { font-variant-numeric: tabular-nums; text-align: right; }
h3 { font-size: 15px; margin: 12px 0 4px; } table.classes thead th { text-align: right; }
table.classes thead th:first-child { text-align: left; } table.classes tbody th { font-weight: 400; color: #1f2328; }
.grid { display: flex; flex-wrap: wrap; gap: 8px 40px; }
.plots { display: flex; flex-wrap: wrap; gap: 0 24px; align-items: flex-start; }
figure { margin: 12px 0 16px; max-width: 100%; } figcaption { color: #57606a; font-size: 12px; }
figure img { max-width: 100%; border: 1px solid #d0d7de; }
pre { background: #f6f8fa; border: 1px solid #d0d7de; padding: 12px; overflow-x: auto; font-size: 12px; }
summary { cursor: pointer; color: #0969da; }
.muted { color: #57606a; }
"""


def build_report(run_dir: str | Path, *, as_trained: bool = False) -> str:
    """The HTML text of the report; raises FileNotFoundError / ValueError naming the bad file.
    ``as_trained``: the report a run writes of itself as it ends, which draws no curves the run's
    config said not to draw (``trainer.plots: false``); ``visiontrain report`` draws them."""
    run_dir = Path(run_dir)
    run = read_run(run_dir)
    config_text, config = _read_config(run_dir)
    metric, mode = _checkpoint_metric(run, config)
    plots_off = (config.get("trainer") or {}).get("plots") is False
    plots, figures = _plots_html(run, run_dir, draw=not (as_trained and plots_off))
    task = config.get("task") or {}
    facts = [("task", task.get("name")), ("model", task.get("model")),
             ("data", (config.get("data") or {}).get("name")), ("optimizer", (config.get("optim") or {}).get("name"))]
    finished = bool(run.summary)
    badge = ('<span class="badge done">finished</span>' if finished else
             f'<span class="badge open">unfinished: no {SUMMARY_FILE}</span>')
    sub = " · ".join(f"{k} <b>{escape(str(v))}</b>" for k, v in facts if v is not None)
    ended = (run.summary.get("ended") or {}).get("message")
    if ended:
        sub += f" · ended: {escape(ended)}"
    parts = [
        f"<h1>{escape(run.name)} {badge}</h1>",
        f'<p class="sub">{sub}</p>',
        f'<p class="sub">{escape(str(run_dir.resolve()))} · report written '
        f"{escape(dt.datetime.now().strftime('%Y-%m-%d %H:%M'))}</p>",
        '<div class="grid"><section>', "<h2>Metrics</h2>", _metrics_html(run, metric, mode),
        "</section><section>", "<h2>Throughput</h2>", _table(_throughput(run)), _input_bound_html(run, config),
        "</section></div>",
        *_per_class_html(run),
        _model_html(run_dir),
        f"<h2>Plots ({plots})</h2>",
        f'<div class="plots">{figures}</div>' if plots else
        f'<p class="muted">no plots{NOT_DRAWN if plots_off else ""}</p>',
        _provenance_html(run_dir),
        "<h2>Config</h2>",
        f"<details><summary>{CONFIG_FILE}</summary>"
        f"<pre>{escape(config_text)}</pre></details>" if config_text else
        f'<p class="muted">no {CONFIG_FILE} in {escape(str(run_dir))}</p>',
    ]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(run.name)}: visiontrain report</title><style>{CSS}</style></head>\n"
            "<body><main>\n" + "\n".join(parts) + "\n</main></body></html>\n")


#: What the report of a run trained with ``trainer.plots: false`` says in place of its plots.
NOT_DRAWN = ": trained with trainer.plots=false (<code>visiontrain report RUN_DIR</code> draws the curves)"

#: The plots in the order a reader wants them: the data as the model saw it, how training went, how
#: the model does per class; then the rest, by name.
PLOT_ORDER = ("train_batch", "labels", "losses", "eval", "pr_curves", "mask_pr_curves", "confusion_matrix",
              "val_detections", "val_masks", "val_segmentation", "schedules", "throughput")


def _plot_order(path: Path) -> tuple[int, str]:
    return (PLOT_ORDER.index(path.stem) if path.stem in PLOT_ORDER else len(PLOT_ORDER), path.name)


def write_report(run_dir: str | Path, out: str | Path | None = None, *, as_trained: bool = False) -> tuple[Path, int]:
    """Write the report (default ``RUN_DIR/report.html``); returns (path, number of plots embedded).
    A file that cannot be written (a read-only run dir, a full disk) is a ``WriteError`` naming it;
    the run dir is only read, so ``out`` elsewhere reports a run that cannot be written to.
    ``as_trained``: see ``build_report``."""
    text = build_report(run_dir, as_trained=as_trained)
    path = Path(out) if out is not None else Path(run_dir) / REPORT_FILE
    tmp = path.with_name(f".{path.name}.tmp")  # a reader never sees half a page
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        elsewhere = "; pass --out FILE.html to write it elsewhere" if out is None else ""
        raise WriteError(f"could not write the report {path}: {why_not_written(err, path.parent)}{elsewhere}") \
            from None
    return path, text.count('src="data:image/png;base64,')


def _plots_html(run: RunRecord, run_dir: Path, draw: bool) -> tuple[int, str]:
    """RUN_DIR/plots/ embedded (how many, the HTML). With ``draw``, a run without its curves (trained
    with trainer.plots=false, or stopped before its first evaluation) gets them drawn into
    RUN_DIR/plots, or, when the run dir cannot be written (a read-only copy), into a temporary directory."""
    roots = [run_dir / PLOTS_DIR]
    with tempfile.TemporaryDirectory(prefix="visiontrain-report-") as spare:
        if draw and run.train and not (run_dir / PLOTS_DIR / "losses.png").is_file():
            try:
                write_curves(run_dir)
            except OSError:
                write_curves(run_dir, Path(spare))
                roots.append(Path(spare))
        found = {p.relative_to(root): (p, root) for root in roots if root.is_dir()  # the fresh curves win
                 for p in root.rglob("*.png") if p.is_file()}
        plots = sorted(found.values(), key=lambda pair: _plot_order(pair[0]))
        return len(plots), "".join(_figure(p, root) for p, root in plots)


def _read_config(run_dir: Path) -> tuple[str, dict[str, Any]]:
    """config.yaml as written (shown verbatim) and as a plain mapping. It is not validated against
    today's schema: a report of an older run must not fail on a renamed key."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        return "", {}
    text = path.read_text(encoding="utf-8")
    try:
        tree = safe_yaml.load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"{path}{where}: not valid YAML ({getattr(err, 'problem', None) or 'parse error'})") from None
    return text, tree if isinstance(tree, dict) else {}


def _checkpoint_metric(run: RunRecord, config: dict[str, Any]) -> tuple[str | None, str]:
    """The metric checkpoints were chosen by, and its direction: summary.json says it for a finished
    run; otherwise the config's ``eval`` section, else the task's own default (as the Trainer does)."""
    if run.summary.get("metric"):
        return run.summary["metric"], run.summary.get("mode") or "max"
    ev = config.get("eval") or {}
    metric, mode = ev.get("metric"), ev.get("mode")
    if metric is None or mode is None:
        try:
            from visiontrain.engine.protocols.task import TASK_REGISTRY

            catalog.load()  # the built-in tasks (loads torch, which the rest of the report skips)

            cls = TASK_REGISTRY[str((config.get("task") or {}).get("name"))].task_class
        except (ImportError, KeyError):  # a broken install, or a task of a module not imported: no default
            cls = None
        metric = metric or getattr(cls, "metric", None)
        mode = mode or getattr(cls, "mode", None)
    return metric, mode or "max"


def _best(run: RunRecord, key: str, mode: str) -> tuple[float, int] | None:
    """(best value, step of its first occurrence) of one evaluation metric, NaN never best."""
    points = [(row[key], row[STEP]) for row in run.evals if is_number(row.get(key)) and not math.isnan(row[key])]
    if not points:
        return None
    value = (max if mode == "max" else min)(v for v, _ in points)
    return value, next(s for v, s in points if v == value)


def _metrics_html(run: RunRecord, metric: str | None, mode: str) -> str:
    """The last evaluation (every metric it logged) and the best of the checkpoint metric."""
    values, where = _last_values(run)
    values = {k: v for k, v in values.items() if not is_per_class(k)}  # tables: the "Per class" section
    if not values:
        return '<p class="muted">no evaluation logged yet</p>'
    html = [f'<p class="muted">last evaluation ({escape(where)})</p>',
            _table([(k, value_text(v)) for k, v in values.items()])]
    if metric:
        rows = []
        for label, key in (("model", metric), ("EMA", ema_key(metric))):
            best = _best(run, key, mode)
            if best is not None:
                rows.append((f"{key} ({label})", f"{value_text(best[0])} at step {best[1]}"))
        if rows:
            html += [f'<p class="muted">best {escape(metric)} ({escape(mode)}, the checkpoint metric)</p>',
                     _table(rows)]
    return "\n".join(html)


def _last_values(run: RunRecord) -> tuple[dict[str, Any], str]:
    """The last evaluation's values (summary.json's ``final`` if no row has any) and where from."""
    last = run.evals[-1] if run.evals else {}
    values = {k: v for k, v in last.items() if k not in ROW_KEYS} or run.summary.get("final", {})
    return values, f"step {last[STEP]}, epoch {last.get(EPOCH, '?')}" if last else SUMMARY_FILE


def _per_class_html(run: RunRecord) -> list[str]:
    """The section "Per class": the last evaluation's per-class tables (the model's, then the
    EMA's, side by side), one row per class in the task's order; nothing for a task without one."""
    values, where = _last_values(run)
    tables = per_class_tables(values)
    if not tables:
        return []
    parts = ["<h2>Per class</h2>", f'<p class="muted">last evaluation ({escape(where)})</p>', '<div class="grid">']
    for key, table in tables.items():
        columns: list[str] = []
        for row in table.values():
            columns += [c for c in row if c not in columns]
        head = "".join(f"<th>{escape(c)}</th>" for c in ["class", *columns])
        body = "".join(f"<tr><th>{escape(str(name))}</th>"
                       + "".join(f'<td class="num">{escape(value_text(row.get(c)))}</td>' for c in columns) + "</tr>"
                       for name, row in table.items())
        parts.append(f'<section><h3>{escape(key)} ({len(table)} classes)</h3>'
                     f'<table class="classes"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></section>')
    return [*parts, "</div>"]


def _throughput(run: RunRecord) -> list[tuple[str, str]]:
    """Speed from the training rows: each row covers one log window of ``data_s + compute_s``
    seconds at ``samples_per_s``, so the mean rate is weighted by window length (not a mean of
    rates), and the data-wait share is the time the step waited for the loader."""
    summary = run.summary
    steps = summary.get("steps", run.metrics.last_step)
    rows: list[tuple[str, str]] = [("steps", str(steps))]
    if "epochs" in summary:
        rows.append(("epochs", str(summary["epochs"])))
    if is_number(summary.get("wall_s")):
        rows.append(("wall time", _duration(summary["wall_s"])))
    else:
        times = [r[TIME] for r in run.train + run.evals if is_number(r.get(TIME))]
        if len(times) > 1:
            rows.append(("wall time", f"{_duration(max(times) - min(times))} (between first and last row)"))
    windows = [(r[SAMPLES_PER_S], r[DATA_S], r[COMPUTE_S]) for r in run.train
               if all(is_number(r.get(k)) for k in (SAMPLES_PER_S, DATA_S, COMPUTE_S))]
    total_s = sum(d + c for _, d, c in windows)
    if windows and total_s > 0:
        rows.append(("mean samples/s (training)", f"{sum(r * (d + c) for r, d, c in windows) / total_s:,.1f}"))
        rows.append(("data-wait share", f"{100 * sum(d for _, d, _ in windows) / total_s:.1f} %"))
    if is_number(summary.get("samples_per_s")):
        rows.append(("samples/s over wall time", f"{summary['samples_per_s']:,.1f}"))
    for key in ("skipped_steps", "fp16_overflow_skips"):
        value = summary.get(key, run.train[-1].get(key) if run.train else None)
        if value:
            rows.append((key.replace("_", " "), str(value)))
    return rows


def _input_bound_html(run: RunRecord, config: dict[str, Any]) -> str:
    """The run log's hint, when the windows after the first (whose workers' start-up and first batch
    inflate it) waited for data more than ``INPUT_BOUND`` of their time; nothing otherwise."""
    windows = [(r[DATA_S], r[COMPUTE_S]) for r in run.train[1:]
               if is_number(r.get(DATA_S)) and is_number(r.get(COMPUTE_S))]
    wait_s, total_s = sum(d for d, _ in windows), sum(d + c for d, c in windows)
    if total_s <= 0 or wait_s <= INPUT_BOUND * total_s:
        return ""
    workers = (config.get("data") or {}).get("num_workers", "?")
    return f'<p class="muted">{escape(input_bound_hint(wait_s / total_s, workers))}</p>'


def _model_html(run_dir: Path) -> str:
    """The model's size from RUN_DIR/model_summary.json (written at the start of a fresh run)."""
    path = run_dir / MODEL_SUMMARY_FILE
    if not path.is_file():
        return ""
    size = json.loads(path.read_text())
    head = "<tr><th>module</th><th>class</th><th>params</th><th>trainable</th><th>frozen</th></tr>"
    rows = "".join(f'<tr><td>{escape(module["name"])}</td><td>{escape(module["kind"])}</td>'
                   + "".join(f'<td class="num">{module[k]:,}</td>' for k in ("total", "trainable", "frozen"))
                   + "</tr>" for module in [*size["modules"], size["total"]])
    flops = size.get("flops_per_sample")
    note = (f"{flops / 1e9:.4g} GFLOPs per sample ({escape(size['flops_note'])})" if flops
            else f"FLOPs: {escape(size['flops_note'])}")
    return (f"<h2>Model</h2><p class=\"sub\">{escape(size['model'])}: {note}</p>"
            f"<table>{head}{rows}</table>")


def cpus(launch: dict[str, Any]) -> str:
    """The machine's CPUs, and the cores the run was allowed where fewer (a cpuset, a tune job's share)."""
    total, usable = launch.get("cpu_count"), launch.get("usable_cores")
    return f"{total} CPUs" + (f", {usable} of them usable by the run" if usable not in (None, total) else "")


def _provenance_html(run_dir: Path) -> str:
    """Where the run came from (provenance.json): each launch, and the last one's code and machine."""
    try:
        launches = read_provenance(run_dir).get("launches") or []
    except ValueError as err:  # the rest of the report still stands
        return f'<h2>Provenance</h2><p class="muted">{escape(str(err))}</p>'
    if not launches:
        return f'<h2>Provenance</h2><p class="muted">no {PROVENANCE_FILE} (a run of an older visiontrain)</p>'
    last = launches[-1]
    git = last.get("git") or {}
    rows = [*((f"{launch.get('started')} at step {launch.get('step')}", launch.get("command")) for launch in launches),
            ("recipe", last.get("recipe")),
            ("git commit", f"{git['commit']}{' (dirty)' if git.get('dirty') else ''}" if git else "not a git checkout"),
            ("host", f"{last.get('host')}: {last.get('platform')}, {cpus(last)}"),
            ("GPUs", ", ".join(last.get("gpus") or []) or "none"),
            ("versions", ", ".join(f"{k} {v}" for k, v in (last.get("versions") or {}).items()))]
    body = "".join(f"<tr><th>{escape(k)}</th><td>{escape(str(v))}</td></tr>" for k, v in rows)
    return (f'<h2>Provenance</h2><p class="muted">{len(launches)} launch{"es" if len(launches) > 1 else ""} '
            f"(each command line), then the last launch's code and machine</p><table>{body}</table>")


def _figure(path: Path, root: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    name = escape(str(path.relative_to(root)))
    return (f'<figure><img alt="{name}" src="data:image/png;base64,{data}">'
            f"<figcaption>{name}</figcaption></figure>")


def _table(rows: list[tuple[str, str]]) -> str:
    body = "".join(f'<tr><th>{escape(k)}</th><td class="num">{escape(v)}</td></tr>' for k, v in rows)
    return f"<table>{body}</table>"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m} min {s:02d} s" if m < 60 else f"{m // 60} h {m % 60:02d} min"
