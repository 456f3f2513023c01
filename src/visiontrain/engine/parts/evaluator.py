"""The evaluator: when the model (and its EMA) are measured, and how.

Its cadence is ``eval.every`` in ``eval.unit`` (steps or epochs), the run's last epoch, and
optionally step 0 (``eval.at_start``); the end of fit measures once more if the last step has not
been. An evaluation is a sync point by nature: it reads the recorded rows first (nothing is
measured after a bad step under ``nonfinite=raise``), the task reads its metrics on the host, and
under torchrun (DDP or FSDP) every rank first takes rank 0's buffers (``sync_buffers``), so that the
shards are measured with one model: the one the checkpoint holds. Choosing which checkpoints to
keep from the metrics is the checkpointer's business: the evaluator hands them to every hook
(``after_eval``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from visiontrain.core.config import register_section
from visiontrain.core.typed_config import doc
from visiontrain.engine.parallel.distributed import sync_buffers
from visiontrain.engine.protocols.cadence import Cadence
from visiontrain.engine.protocols.part import Part, Progress
from visiontrain.engine.records.run_log import RunLogger
from visiontrain.engine.setup.training import EvalRun
from visiontrain.engine.step.eval_loop import EvalData
from visiontrain.rundir.metrics_file import EMA_PREFIX


@dataclass
class EvalConfig:
    every: int = doc("evaluate every N units (0 = only at the end)", 1, minimum=0)
    unit: Literal["epochs", "steps"] = doc("unit of eval.every", "epochs")
    metric: str | None = doc("checkpoint metric (default: the task's)", None)
    mode: Literal["max", "min"] | None = doc("max or min for the checkpoint metric", None)
    models: Literal["both", "model", "ema"] = doc(
        "which weights to evaluate when an EMA is kept (ema: only the EMA, e.g. DINO's teacher)", "both")
    at_start: bool = doc("also evaluate before the first step (the metric at initialisation)", False)
    patience: int = doc("stop after this many evaluations in a row without an improvement of the checkpoint "
                        "metric (0 = never stop early)", 0, minimum=0)
    min_delta: float = doc("patience: an improvement must beat the best value by more than this, in the "
                           "metric's own units", 0.0, minimum=0)
    precision: Literal["fp32", "train"] = doc(
        "what evaluation and validate compute in: fp32 (the metric does not depend on the precision "
        "trainer.precision=auto picked on the machine), or train: under the run's resolved trainer.precision (bf16 "
        "autocast where the run trains in it; faster, for a metric that 16 bits do not move, such as a label map's "
        "argmax)", "fp32")
    patience_after: float | Literal["warmup"] = doc(
        "patience: only evaluations from this point on count, and the best value is taken among them (Keras' "
        "start_from_epoch): a position in eval.unit, or warmup: the end of schedules.lr's warmup (a metric that "
        "dips while the lr is still rising stops nothing)", 0.0, minimum=0)


register_section("eval", EvalConfig, "evaluation section")


def checkpoint_metric(settings: EvalConfig, task: Any) -> tuple[str, str]:
    """The metric best checkpoints and early stopping follow, and its direction: ``eval.metric`` /
    ``eval.mode``, else the task's."""
    return settings.metric or task.metric, settings.mode or task.mode


def evaluate_models(run: EvalRun, which: str = "both") -> dict[str, Any]:
    """The task's metrics of the model and of its EMA (``ema/``-prefixed, its per-class table
    ``ema/per_class`` too), as ``eval.models`` asks; each in eval mode under no_grad and the
    evaluation's precision (``eval.precision``), put back in the mode it was in. ``validate`` calls this too."""
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
        with torch.no_grad(), run.eval_precision.autocast(run.device):
            metrics.update({prefix + k: v for k, v in run.task.evaluate(model, data).items()})
        model.train(was_training)
    return metrics


class Evaluator(Part):
    name = "evaluator"

    def __init__(self, settings: EvalConfig, run: EvalRun, progress: Progress, log: RunLogger, *,
                 check_finite: Callable[[], None]) -> None:
        self.settings, self.built, self.progress, self.log = settings, run, progress, log
        self.check_finite = check_finite
        self.cadence = Cadence(settings.every, settings.unit, at_end=settings.unit == "epochs")  # and the last epoch
        self.last: dict[str, Any] = {}
        self.last_step = -1

    @classmethod
    def for_run(cls, trainer: Any) -> "Evaluator":
        return cls(trainer.cfg.eval, trainer.run, trainer.progress, trainer.log,
                   check_finite=trainer.parts["log_point"].check_finite)

    def due(self, step: int, epoch_end: bool) -> bool:
        """``eval.every`` in ``eval.unit`` and the last epoch; under ``eval.unit=steps`` the end of fit
        measures the last step (``finish``, after the epoch's turn)."""
        last = self.cadence.unit == "steps" and step >= self.progress.total
        return not last and self.cadence.due(self.progress, epoch_end)

    def start(self) -> None:
        """``eval.at_start``: the metric at initialisation, measured the same way as later ones."""
        if self.settings.at_start and self.progress.step == 0:
            self.run()

    def finish(self) -> None:
        """The end of fit measures the last step, unless it was measured already."""
        if self.last_step != self.progress.step:
            self.run()

    def run(self, epoch_end: bool = False) -> dict[str, Any]:
        self.check_finite()  # host sync: never evaluate or save after a bad step under `raise`
        r = self.built
        sync_buffers([r.raw_model, r.ema_model], r.dist)  # every rank: the model the checkpoint holds
        self.progress.evaluating = True
        metrics = evaluate_models(r, self.settings.models)  # host sync (the task's metrics)
        self.progress.evaluating = False
        self.last, self.last_step = metrics, self.progress.step
        self.log.log("eval", self.progress.step, self.progress.epoch, metrics)
        self.trainer.hooks("after_eval", metrics)  # the checkpointer keeps the best, early stopping counts
        return metrics
