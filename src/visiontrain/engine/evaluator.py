"""The evaluator: when the model (and its EMA) are measured, and how.

Its cadence is ``eval.every`` in ``eval.unit`` (steps or epochs), the run's last epoch, and
optionally step 0 (``eval.at_start``); the end of fit measures once more if the last step has not
been. An evaluation is a sync point by nature: it reads the recorded rows first (nothing is
measured after a bad step under ``nonfinite=raise``), the task reads its metrics on the host, and
under FSDP the ranks' buffers are made equal first. Choosing which checkpoints to keep from the
metrics is the checkpointer's business: the evaluator hands them over.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from visiontrain.config import Config
from visiontrain.engine.eval_loop import EvalData
from visiontrain.engine.fsdp import sync_buffers
from visiontrain.engine.logging import RunLogger
from visiontrain.engine.metrics_file import EMA_PREFIX
from visiontrain.engine.parts import Progress
from visiontrain.engine.run import EvalRun


def evaluate_models(run: EvalRun, which: str = "both") -> dict[str, Any]:
    """The task's metrics of the model and of its EMA (``ema/``-prefixed, its per-class table
    ``ema/per_class`` too), as ``eval.models`` asks; each in eval mode under no_grad, put back in the
    mode it was in. ``validate`` calls this too."""
    data = EvalData(run.val_loader, run.device, run.dist, run.cfg.trainer.channels_last)
    models = {"": run.raw_model, EMA_PREFIX: run.ema_model}
    if run.ema_model is None or which == "model":
        del models[EMA_PREFIX]
    elif which == "ema":
        del models[""]
    metrics: dict[str, Any] = {}
    for prefix, model in models.items():
        was_training = model.training
        model.eval()
        with torch.no_grad():
            metrics.update({prefix + k: v for k, v in run.task.evaluate(model, data).items()})
        model.train(was_training)
    return metrics


class Evaluator:
    def __init__(self, cfg: Config, run: EvalRun, progress: Progress, log: RunLogger, *,
                 check_finite: Callable[[], None], after_eval: Callable[[dict[str, Any]], Any],
                 sharded: bool) -> None:
        self.cfg, self.built, self.progress, self.log = cfg, run, progress, log
        self.check_finite, self.after_eval, self.sharded = check_finite, after_eval, sharded
        self.last: dict[str, Any] = {}
        self.last_step = -1
        self.running = False  # for an out-of-memory message: what ran out

    def due(self, step: int, epoch_end: bool) -> bool:
        e = self.cfg.eval
        if epoch_end:
            done = self.progress.epochs_done()
            return e.unit == "epochs" and (self.progress.last_epoch_done() or (e.every > 0 and done % e.every == 0))
        return e.unit == "steps" and e.every > 0 and step % e.every == 0 and step < self.progress.total

    def due_at_start(self) -> bool:
        """``eval.at_start``: the metric at initialisation, measured the same way as later ones."""
        return self.cfg.eval.at_start and self.progress.step == 0

    def due_at_end(self) -> bool:
        return self.last_step != self.progress.step

    def run(self, epoch_end: bool = False) -> dict[str, Any]:
        self.check_finite()  # host sync: never evaluate or save after a bad step under `raise`
        r = self.built
        if self.sharded:
            sync_buffers([r.raw_model] + ([r.ema_model] if r.ema_model is not None else []))
        self.running = True
        metrics = evaluate_models(r, self.cfg.eval.models)  # host sync (the task's metrics)
        self.running = False
        self.last, self.last_step = metrics, self.progress.step
        self.log.log("eval", self.progress.step, self.progress.epoch, metrics)
        self.after_eval(metrics)
        return metrics
