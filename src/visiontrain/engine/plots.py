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

The curves are read back from ``metrics.jsonl``, so a resumed run's plots hold its whole history.
Figures are built with ``matplotlib.figure.Figure`` (no pyplot, no global backend state); this
runs on rank 0, on the host, after evaluations only: nothing here touches the step loop.
"""
from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from visiontrain.engine.hooks import Hook
from visiontrain.engine.logging import nan_for_null

log = logging.getLogger("visiontrain")

SKIP = {"kind", "step", "epoch", "time"}
THROUGHPUT = {"samples_per_s", "data_s", "compute_s", "eta_s", "gpu_peak_mem_gb", "skipped_steps",
              "fp16_overflow_skips"}
SCHEDULED = {"lr", "weight_decay", "momentum", "ema_decay", "bn_momentum"}


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


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, eval) records of a metrics.jsonl; a line cut short by a kill is passed over. A null
    (how a NaN is written) is read back as NaN: a missing value, shown as a gap."""
    train, evals = [], []
    for line in path.read_text().splitlines():
        try:
            record = nan_for_null(json.loads(line))
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        (train if record.get("kind") == "train" else evals if record.get("kind") == "eval" else []).append(record)
    return train, evals


def _keys(records: list[dict[str, Any]]) -> list[str]:
    """Every numeric key of the records, in first-seen order."""
    seen: dict[str, None] = {}
    for r in records:
        for k, v in r.items():
            if k not in SKIP and isinstance(v, (int, float)) and not isinstance(v, bool):
                seen.setdefault(k, None)
    return list(seen)


def panel_grid(n: int, *, title: str, width: float = 3.6, height: float = 2.6) -> tuple[Any, list[Any]]:
    """A Figure with ``n`` small panels (up to 4 a row); returns it and the used axes."""
    from matplotlib.figure import Figure

    cols = min(4, max(n, 1))
    rows = -(-max(n, 1) // cols)
    w, h = width * cols, height * rows + 0.5
    fig = Figure(figsize=(w, h))
    # fixed margins, in inches: a layout engine would double the drawing time
    fig.subplots_adjust(left=0.55 / w, right=1 - 0.15 / w, bottom=0.45 / h, top=1 - 0.55 / h,
                        hspace=0.55, wspace=0.3)
    fig.suptitle(title)
    axes = fig.subplots(rows, cols, squeeze=False).ravel().tolist()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], float(r[key])) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def group_terms(keys: list[str]) -> list[list[str]]:
    """One group per term; numbered variants share their base term's panel (DETR's auxiliary
    decoder losses ``loss_ce_0`` ... next to ``loss_ce``)."""
    groups: dict[str, list[str]] = {}
    for k in keys:
        base, _, last = k.rpartition("_")
        groups.setdefault(base if base and last.isdigit() else k, []).append(k)
    return [sorted(g, key=lambda k: (k[-1].isdigit(), k)) for g in groups.values()]


def _curves(records: list[dict[str, Any]], groups: list[list[str]], title: str, *, marker: str = "") -> Any:
    """One panel per group of keys; keys of a group share the panel (e.g. ``top1`` and ``ema/top1``)."""
    fig, axes = panel_grid(len(groups), title=title)
    for ax, group in zip(axes, groups):
        for key in group:
            steps, values = _series(records, key)
            finite = [v for v in values if math.isfinite(v)]
            # a training series in an evaluation panel: a thin line (a point per log window)
            train_key = key.startswith(TRAIN_PREFIX)
            ax.plot(steps, values, marker="" if train_key else marker, markersize=3,
                    linewidth=0.8 if train_key else 1.2, alpha=0.7 if train_key else 1.0, label=key)
            if len(finite) > 1 and min(finite) > 0 and max(finite) / min(finite) > 100:
                ax.set_yscale("log")  # a loss falling over decades reads better on a log axis
        ax.set_title(group[0] if len(group) <= 2 else f"{group[0]} (+{len(group) - 1})", fontsize=9)
        if not any(math.isfinite(v) for k in group for v in _series(records, k)[1]):
            ax.text(0.5, 0.5, "no finite value", ha="center", va="center", transform=ax.transAxes, fontsize=8)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if len(group) > 1:
            ax.legend(fontsize=7)
    return fig


def curve_figures(train: list[dict[str, Any]], evals: list[dict[str, Any]], run_name: str = "") -> dict[str, Any]:
    """The run's curves as named Figures (see the module docstring); empty kinds are left out."""
    figures: dict[str, Any] = {}
    prefix = f"{run_name}: " if run_name else ""
    keys = _keys(train)
    losses = group_terms([k for k in keys if k not in THROUGHPUT and not is_scheduled(k) and not k.endswith("_w")])
    if losses:
        figures["losses"] = _curves(train, losses, f"{prefix}training (means over each log window)")
    lrs = [k for k in keys if k == "lr" or k.startswith("lr/")]
    lrs = [k for k in lrs if k != "lr"] or lrs  # per-group lrs include the first group's
    scheduled = [lrs] if lrs else []
    scheduled += [[k] for k in keys if is_scheduled(k) and k not in lrs and k != "lr"]
    if scheduled:
        figures["schedules"] = _curves(train, scheduled, f"{prefix}schedules")
    if "samples_per_s" in keys:
        rows = [{**r, "data_wait_share": r["data_s"] / max(r["data_s"] + r["compute_s"], 1e-12)}
                if "data_s" in r and "compute_s" in r else r for r in train]
        groups = [["samples_per_s"]] + ([["data_wait_share"]] if any("data_wait_share" in r for r in rows) else [])
        figures["throughput"] = _curves(rows, groups, f"{prefix}throughput")
    metrics = [k for k in _keys(evals) if not k.startswith("ema/")]
    groups = [[k] + ([f"ema/{k}"] if any(f"ema/{k}" in r for r in evals) else []) for k in metrics]
    groups += [[k] for k in _keys(evals) if k.startswith("ema/") and k[4:] not in metrics]  # EMA-only runs
    if groups:
        # the training value of the same quantity on the same axis (training acc under top1)
        pairs = {g[0]: train_twin(g[0].removeprefix("ema/"), keys) for g in groups}
        twins = {t for t in pairs.values() if t}
        twin_rows = [{"step": r["step"], **{f"{TRAIN_PREFIX}{t}": r[t] for t in twins if t in r}}
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


def save_figure(fig: Any, path: Path) -> Any:
    """Write a PNG atomically (a kill while saving never leaves a half-written plot); returns the
    rendered pixels."""
    from PIL import Image

    pixels = render(fig)
    tmp = path.with_name(f".{path.name}.tmp")
    Image.fromarray(pixels).save(tmp, format="PNG")
    tmp.replace(path)
    return pixels


def write_curves(run_dir: Path) -> list[Path]:
    """Draw a run dir's curves from its metrics.jsonl into RUN_DIR/plots/ (also for a finished
    or stopped run: ``visiontrain report`` calls it)."""
    train, evals = read_metrics(run_dir / "metrics.jsonl")
    out = run_dir / "plots"
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

    def before_train(self) -> None:
        self.last = time.monotonic()

    def after_eval(self, metrics: dict[str, float]) -> None:
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
                pixels = save_figure(fig, self.run_dir / "plots" / f"{name}.png")
                self.trainer.log.image(f"figures/{name}", pixels, self.trainer.step)
        except Exception as err:  # noqa: BLE001  (plots are a view of the run, not part of it)
            log.warning("plots: could not write %s: %s: %s", self.run_dir / "plots", type(err).__name__, err)
