"""``visiontrain compare RUN_DIR RUN_DIR ...``: runs side by side, as a table and as curves.

The table holds, per run, the steps trained, the last evaluation's metrics, the best value of the
checkpoint metric, the wall time and the training throughput, read from ``summary.json`` when the
run finished and from ``metrics.jsonl`` alone when it did not (a run still training, or stopped);
the rows come from ``engine.records.metrics_file.read_metrics``, the one reader of that file.
The figure puts every run on shared axes: the training total loss, then each evaluation metric
the runs have in common, one panel each, against the optimizer step. A task's per-class table is
neither a column nor a panel (``Metrics.eval_keys`` leaves it out); ``visiontrain report`` shows it.
A second table lists the config keys whose values differ between the runs (``config.yaml``,
flattened to dotted keys).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from visiontrain.core import safe_yaml
from visiontrain.core.config import flatten
from visiontrain.rundir.metrics_file import (SAMPLES_PER_S, UNDEFINED, Metrics, Row, is_ema, is_per_class, nan_for_null,
                                             read_metrics, series, value_text)
from visiontrain.rundir.run_files import CONFIG_FILE, SUMMARY_FILE


@dataclass
class RunRecord:
    """One run as compare and report see it: its logged rows, and summary.json when it finished."""

    name: str
    metrics: Metrics
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def train(self) -> list[Row]:
        return self.metrics.train

    @property
    def evals(self) -> list[Row]:
        return self.metrics.evals

    @property
    def eval_keys(self) -> list[str]:
        return self.metrics.eval_keys


def read_run(run_dir: str | Path) -> RunRecord:
    """A run dir's logged rows and summary; a missing or unreadable ``metrics.jsonl`` or
    ``summary.json`` is an error naming the file, as the user asked about this run."""
    metrics = read_metrics(run_dir, strict=True)
    summary_path = Path(run_dir) / SUMMARY_FILE
    try:
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    except json.JSONDecodeError as err:  # e.g. a write cut short: name the file, as for the rows
        raise ValueError(f"{summary_path}: not valid JSON ({err.msg}, line {err.lineno})") from None
    for key in ("final", "best"):  # metric values: null back to NaN, as in the rows
        if isinstance(summary.get(key), dict):
            summary[key] = nan_for_null(summary[key])
    return RunRecord(Path(run_dir).resolve().name, metrics, summary)


def unique_names(dirs: list[str]) -> list[str]:
    """The runs' names: the run dir's; two with the same name are told apart by their parent
    directory, and by their whole path when that is the same too."""
    names = [Path(d).resolve().name for d in dirs]
    names = [f"{Path(d).resolve().parent.name}/{n}" if names.count(n) > 1 else n for n, d in zip(names, dirs)]
    return [str(Path(d).resolve()) if names.count(n) > 1 else n for n, d in zip(names, dirs)]


def config_diff(run_dirs: list[str]) -> tuple[list[str], list[list[str]]]:
    """(columns, one row per config key whose value is not the same in every run): each run's
    config.yaml flattened to dotted keys, a key a run lacks shown as ``-``. No rows when the configs
    are equal; a run without config.yaml (a metrics file given alone) is left out."""
    configs: dict[str, dict[str, Any]] = {}
    for name, run_dir in zip(unique_names(run_dirs), run_dirs):
        path = Path(run_dir) / CONFIG_FILE
        if path.is_file():
            try:
                configs[name] = flatten(safe_yaml.load(path.read_text()) or {})
            except yaml.YAMLError as err:
                raise ValueError(f"{path}: not valid YAML ({getattr(err, 'problem', None) or err})") from None
    keys = sorted({k for flat in configs.values() for k in flat})
    differ = [k for k in keys if len({repr(flat[k]) if k in flat else None for flat in configs.values()}) > 1]
    return ["key", *configs], [[k, *(_config_value(flat, k) for flat in configs.values())] for k in differ]


def _config_value(flat: dict[str, Any], key: str) -> str:
    """A config value as YAML-like text (JSON's true, null, [1, 2]); ``-`` where the run lacks the key."""
    if key not in flat:
        return "-"
    return flat[key] if isinstance(flat[key], str) else json.dumps(flat[key])


def table_rows(runs: list[RunRecord]) -> tuple[list[str], list[list[str]]]:
    """(column names, one row of strings per run): steps, final metrics, best, wall time, img/s."""
    metrics: list[str] = []
    for r in runs:
        metrics += [k for k in r.eval_keys if k not in metrics]
    columns = ["run", "steps", *metrics, "best", "wall", "samples/s"]
    rows = []
    for r in runs:
        last = r.evals[-1] if r.evals else {}
        steps = r.summary.get("steps", r.metrics.last_step)
        best = r.summary.get("best") or {}
        metric = r.summary.get("metric") or ""
        best_text = ", ".join(f"{k} {value_text(v)}" for k, v in best.items()) if best else UNDEFINED  # model / ema
        rate = r.summary.get("samples_per_s")
        if rate is None and r.train:
            rate = r.train[-1].get(SAMPLES_PER_S)
        wall = r.summary.get("wall_s")
        rows.append([r.name, str(steps), *(value_text(last.get(m)) for m in metrics),
                     f"{metric}: {best_text}" if metric else best_text,
                     f"{wall:.3g} s" if wall is not None else UNDEFINED,
                     f"{rate:,.1f}" if rate is not None else UNDEFINED])
    return columns, rows


def plot_runs(runs: list[RunRecord], out: Path, metrics: list[str] | None = None) -> list[str]:
    """The shared-axes figure; returns the panels drawn (training total first)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if metrics is None:  # the evaluation metrics every run has, EMA twins after the model's own
        common = [k for k in runs[0].eval_keys if all(k in r.eval_keys for r in runs[1:])]
        metrics = [k for k in common if not is_ema(k)] + [k for k in common if is_ema(k)]
    panels = (["total"] if any(r.train for r in runs) else []) + list(metrics)
    if not panels:
        raise ValueError("nothing to plot: the runs logged no training rows and share no evaluation metric")
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for r in runs:
            source = r.train if panel == "total" else r.evals
            steps, values = series(source, panel)
            if steps:
                ax.plot(steps, values, label=r.name, marker="" if panel == "total" else "o", markersize=3)
        ax.set(xlabel="step", title=f"train {panel}" if panel == "total" else panel)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return panels


def compare(run_dirs: list[str], out: Path, metrics: list[str] | None = None) -> tuple[list[str], list[list[str]]]:
    runs = [read_run(d) for d in run_dirs]
    for run, name in zip(runs, unique_names(run_dirs)):
        run.name = name
    if metrics:
        for m in metrics:
            if is_per_class(m):
                raise ValueError(f"--metrics {m}: a per-class table, not a curve (`visiontrain report` shows it)")
            missing = [r.name for r in runs if m not in r.eval_keys]
            if missing:
                raise ValueError(f"--metrics {m}: not logged by {', '.join(missing)}; "
                                 f"they log {sorted(set().union(*(r.eval_keys for r in runs)))}")
    plot_runs(runs, out, metrics)
    return table_rows(runs)
