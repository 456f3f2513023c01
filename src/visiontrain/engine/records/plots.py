"""Plots in the run dir: the curves of every logged scalar, and the task's own figures.

``PlotHook`` rewrites ``RUN_DIR/plots/*.png`` after every evaluation (a run always ends with one):
- ``losses.png``: one panel per loss term (and the total, the gradient norm, every logged extra),
- ``schedules.png``: the lr of each param group and every other scheduled scalar,
- ``throughput.png``: samples/s and the share of time spent waiting for data,
- ``eval.png``: one panel per evaluation metric, the EMA's on the same panel as the model's, and
  the training value of the same quantity as a thin line (``train/acc`` under ``top1``: both in
  percent),
- and whatever the task draws from its last evaluation (``Task.eval_figures``: a confusion
  matrix, detections against ground truth), also sent to TensorBoard as images under
  ``figures/``. The scalars themselves are already in TensorBoard, logged as they happen.

The curves are read back from ``metrics.jsonl`` (``metrics_file.read_metrics``), so a resumed run's
plots hold its whole history. ``draw_panel`` is public so that other views of a run
(``benchmarks/plot_run.py``) draw their curves the same way.
Figures are built with ``matplotlib.figure.Figure`` (no pyplot, no global backend state); this
runs on rank 0, on the host, after evaluations only: nothing here touches the step loop.
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

from visiontrain.engine.optim.schedules import SCHEDULED_SCALARS
from visiontrain.engine.protocols.hooks import Hook
from visiontrain.evaluation.panels import panel_grid
from visiontrain.rundir.metrics_file import (COMPUTE_S, DATA_S, SAMPLES_PER_S, STEP, Row, ema_key, is_ema, model_key,
                                             numeric_keys, read_metrics, series)
from visiontrain.rundir.run_files import PLOTS_DIR

log = logging.getLogger("visiontrain")

THROUGHPUT = {SAMPLES_PER_S, DATA_S, COMPUTE_S, "eta_s", "gpu_peak_mem_gb", "skipped_steps",
              "fp16_overflow_skips"}
SCHEDULED = frozenset(SCHEDULED_SCALARS)


#: Training keys that measure what an evaluation key of another name measures (same scale:
#: percent). A training key with the evaluation key's own name (the toy task's mse) pairs too.
TRAIN_TWIN = {"top1": "acc"}
TRAIN_PREFIX = "train/"


def train_twin(eval_key: str, train_keys: list[str]) -> str | None:
    """The training key drawn on ``eval_key``'s panel of eval.png, if the run logs one."""
    for key in (TRAIN_TWIN.get(eval_key), eval_key):
        if key in train_keys and key not in THROUGHPUT and not is_scheduled(key):
            return key
    return None


def is_scheduled(key: str) -> bool:
    return key in SCHEDULED or key.startswith(("lr/", "loss.", "task."))


def group_terms(keys: list[str]) -> list[list[str]]:
    """One group per term; numbered variants share their base term's panel (DETR's auxiliary
    decoder losses ``loss_ce_0`` ... next to ``loss_ce``)."""
    groups: dict[str, list[str]] = {}
    for k in keys:
        base, _, last = k.rpartition("_")
        groups.setdefault(base if base and last.isdigit() else k, []).append(k)
    return [sorted(g, key=lambda k: (k[-1].isdigit(), k)) for g in groups.values()]


def draw_panel(ax: Any, rows: list[Row], keys: list[str], *, marker: str = "", title: str | None = None,
               legend: bool | None = None) -> None:
    """The keys' curves against the step on one panel. A training series (``train/...``) in an
    evaluation panel is a thin line, as it is a point per log window; a curve falling over decades
    gets a log axis; a panel without one finite value says so rather than looking empty."""
    any_finite = False
    for key in keys:
        steps, values = series(rows, key)
        finite = [v for v in values if math.isfinite(v)]
        any_finite = any_finite or len(finite) > 0
        train_key = key.startswith(TRAIN_PREFIX)
        ax.plot(steps, values, marker="" if train_key else marker, markersize=3,
                linewidth=0.8 if train_key else 1.2, alpha=0.7 if train_key else 1.0, label=key)
        if len(finite) > 1 and min(finite) > 0 and max(finite) / min(finite) > 100:
            ax.set_yscale("log")  # a loss falling over decades reads better on a log axis
    if title is None:
        title = keys[0] if len(keys) <= 2 else f"{keys[0]} (+{len(keys) - 1})"
    ax.set_title(title, fontsize=9)
    if not any_finite:
        ax.text(0.5, 0.5, "no finite value", ha="center", va="center", transform=ax.transAxes, fontsize=8)
    ax.set_xlabel(STEP, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if legend or (legend is None and len(keys) > 1):  # one curve: the title names it
        ax.legend(fontsize=7)


def _curves(records: list[Row], groups: list[list[str]], title: str, *, marker: str = "") -> Any:
    """One panel per group of keys; keys of a group share the panel (e.g. ``top1`` and ``ema/top1``)."""
    fig, axes = panel_grid(len(groups), title=title)
    for ax, group in zip(axes, groups):
        draw_panel(ax, records, group, marker=marker)
    return fig


def curve_figures(train: list[Row], evals: list[Row], run_name: str = "") -> dict[str, Any]:
    """The run's curves as named Figures (see the module docstring); empty kinds are left out."""
    figures: dict[str, Any] = {}
    prefix = f"{run_name}: " if run_name else ""
    keys = numeric_keys(train)
    losses = group_terms([k for k in keys if k not in THROUGHPUT and not is_scheduled(k) and not k.endswith("_w")])
    if losses:
        figures["losses"] = _curves(train, losses, f"{prefix}training (means over each log window)")
    lrs = [k for k in keys if k == "lr" or k.startswith("lr/")]
    lrs = [k for k in lrs if k != "lr"] or lrs  # per-group lrs include the first group's
    scheduled = [lrs] if lrs else []
    scheduled += [[k] for k in keys if is_scheduled(k) and k not in lrs and k != "lr"]
    if scheduled:
        figures["schedules"] = _curves(train, scheduled, f"{prefix}schedules")
    if SAMPLES_PER_S in keys:
        rows = [{**r, "data_wait_share": r[DATA_S] / max(r[DATA_S] + r[COMPUTE_S], 1e-12)}
                if DATA_S in r and COMPUTE_S in r else r for r in train]
        groups = [[SAMPLES_PER_S]] + ([["data_wait_share"]] if any("data_wait_share" in r for r in rows) else [])
        figures["throughput"] = _curves(rows, groups, f"{prefix}throughput")
    eval_keys = numeric_keys(evals)
    metrics = [k for k in eval_keys if not is_ema(k)]
    groups = [[k] + ([ema_key(k)] if any(ema_key(k) in r for r in evals) else []) for k in metrics]
    groups += [[k] for k in eval_keys if is_ema(k) and model_key(k) not in metrics]  # EMA-only runs
    if groups:
        # the training value of the same quantity on the same axis (training acc under top1)
        pairs = {g[0]: train_twin(model_key(g[0]), keys) for g in groups}
        twins = {t for t in pairs.values() if t}
        twin_rows = [{STEP: r[STEP], **{f"{TRAIN_PREFIX}{t}": r[t] for t in twins if t in r}}
                     for r in train] if twins else []
        rows = evals + twin_rows
        groups = [g + ([f"{TRAIN_PREFIX}{pairs[g[0]]}"] if pairs[g[0]] else []) for g in groups]
        figures["eval"] = _curves(rows, groups, f"{prefix}evaluation", marker="o")
    return figures


def render(fig: Any, dpi: int = 100) -> Any:
    """The figure as an RGB uint8 array [H, W, 3], drawn once for both the PNG and TensorBoard."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig.set_dpi(dpi)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def save_figure(fig: Any, path: Path, *, fast: bool = False) -> Any:
    """Write a Figure (or an RGB uint8 image already drawn) as a PNG, atomically (a kill while saving
    never leaves a half-written plot); returns the pixels. ``fast``: the quickest compression (a
    photo-like image, written at the start of every run), not the smallest file."""
    import numpy as np
    from PIL import Image

    pixels = fig if isinstance(fig, np.ndarray) else render(fig)
    tmp = path.with_name(f".{path.name}.tmp")
    Image.fromarray(pixels).save(tmp, format="PNG", compress_level=1 if fast else 6)
    tmp.replace(path)
    return pixels


def write_curves(run_dir: Path, out: Path | None = None) -> list[Path]:
    """Draw a run dir's curves from its metrics.jsonl into RUN_DIR/plots/, or ``out`` (also for a
    finished or stopped run: ``visiontrain report`` calls it)."""
    train, evals = read_metrics(run_dir, strict=False)  # a view of the run: a damaged line is passed over
    out = out if out is not None else run_dir / PLOTS_DIR
    out.mkdir(exist_ok=True)
    written = []
    for name, fig in curve_figures(train, evals, run_dir.name).items():
        save_figure(fig, out / f"{name}.png")
        written.append(out / f"{name}.png")
    return written


class PlotHook(Hook):
    """After each evaluation: the curves and the task's figures as PNGs in RUN_DIR/plots/, the
    task's figures also in TensorBoard. A plotting failure is logged, never allowed to stop
    training."""

    def __init__(self, run_dir: Path, min_interval_s: float = 30.0) -> None:
        self.run_dir, self.min_interval_s = run_dir, min_interval_s
        self.last = -math.inf

    @classmethod
    def for_run(cls, trainer: Any) -> "PlotHook | None":
        """``trainer.plots`` on the rank that writes the run dir."""
        return cls(trainer.run.run_dir) if trainer.run.writes and trainer.cfg.trainer.plots else None

    def before_train(self) -> None:
        self.last = time.monotonic()

    def after_eval(self, metrics: dict[str, Any]) -> None:
        # Drawing takes about a second: evaluations less than min_interval_s after the start or
        # the last drawing (short runs, tests) skip it, except the last one, so the plots always
        # show the end of the run.
        now, final = time.monotonic(), self.trainer.step >= self.trainer.clock.total_steps
        if now - self.last < self.min_interval_s and not final:
            return
        self.last = now
        try:
            write_curves(self.run_dir)
            for name, fig in self.trainer.task.eval_figures().items():
                pixels = save_figure(fig, self.run_dir / PLOTS_DIR / f"{name}.png")
                self.trainer.log.image(f"figures/{name}", pixels, self.trainer.step)
        except Exception as err:  # noqa: BLE001  (plots are a view of the run, not part of it)
            log.warning("plots: could not write %s: %s: %s", self.run_dir / PLOTS_DIR, type(err).__name__, err)
