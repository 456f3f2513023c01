"""Early stopping: ``eval.patience`` evaluations in a row without an improvement of the checkpoint
metric end the run (Lightning's EarlyStopping, Ultralytics' ``patience``).

Counted in evaluations rather than epochs, so that it means the same under ``eval.unit=steps``.
The metric followed is the checkpointer's (``eval.metric``, else the task's) in its direction,
the model's value, or the EMA's where only the EMA is evaluated (``eval.models=ema``). An
improvement must beat the best by more than ``eval.min_delta``; a NaN never improves.

``eval.patience_after`` starts the watch later (Keras' ``start_from_epoch``): evaluations before
that step neither count nor set the best, so a metric that dips during the lr warmup (a one-cycle
schedule's rising half) ends nothing. ``warmup`` is where ``schedules.lr``'s warmup ends.

Its record (the best value and its step, the evaluations since) is in every checkpoint, so a
resumed run counts on where it stopped. Whether patience has run out is decided against the
current ``eval.patience``: a run that stopped early can be resumed with a larger patience.
Under torchrun rank 0 decides (a detection rank other than 0 holds no metrics) and every rank
receives its record: one broadcast per evaluation, only when patience is on.

A hook of the run (``after_eval``): when patience runs out it tells the loop to end
(``Progress.end_early``), after that evaluation's checkpoint.
"""
from __future__ import annotations

import math
from typing import Any

from visiontrain.core.config import ConfigError
from visiontrain.engine.optim.schedules import Schedule, StepClock
from visiontrain.engine.parallel.distributed import DistInfo, broadcast_object
from visiontrain.engine.parts.evaluator import EvalConfig, checkpoint_metric
from visiontrain.engine.protocols.hooks import Hook
from visiontrain.engine.protocols.part import Progress
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.rundir.metrics_file import ema_key, model_scalars


def patience_start(settings: EvalConfig, clock: StepClock, lr: Schedule | None) -> float:
    """The first optimizer step whose evaluation counts toward ``eval.patience``: ``patience_after``
    in ``eval.unit``, or the end of the lr warmup (none, or no lr schedule: step 0)."""
    after = settings.patience_after
    if after == "warmup":
        if lr is None:
            return 0.0
        return clock.epoch_start(lr.warmup_steps) if lr.epoch_starts else lr.warmup_steps  # per_epoch: in epochs
    if not math.isfinite(after) or after < 0:
        raise ConfigError(f"eval.patience_after={after}: expected a number >= 0 (in eval.unit={settings.unit}) "
                          f"or 'warmup'")
    return clock.to_steps(after, settings.unit)


class EarlyStopping(Hook):
    name = fmt.EARLY_STOP

    def __init__(self, settings: EvalConfig, metric: str, mode: str, dist: DistInfo, *,
                 start: float = 0.0, progress: Progress | None = None) -> None:
        """``settings``: the ``eval`` section (``patience``, ``min_delta``); ``metric`` and ``mode``: the
        checkpoint metric it follows (``checkpoint_metric``)."""
        patience = settings.patience
        if patience and not metric:
            raise ConfigError(f"eval.patience={patience} follows the checkpoint metric, and this task names none: "
                              f"set eval.metric")
        self.patience, self.min_delta, self.metric, self.mode, self.dist = patience, settings.min_delta, metric, \
            mode, dist
        self.start = start  # evaluations at an earlier step are not watched (eval.patience_after)
        self.best: float | None = None
        self.best_step = -1
        self.since_best = 0  # evaluations since the last improvement
        self.progress = progress  # told when patience runs out

    @classmethod
    def for_run(cls, trainer: Any) -> "EarlyStopping":
        """The stopper ``cfg.eval`` asks for, on a built run's clock and lr schedule."""
        settings, run = trainer.cfg.eval, trainer.run
        start = patience_start(settings, run.clock, run.scalars.schedules.get("lr")) if settings.patience else 0.0
        metric, mode = checkpoint_metric(settings, trainer.task)
        return cls(settings, metric, mode, run.dist, start=start, progress=trainer.progress)

    def after_eval(self, metrics: dict[str, Any]) -> None:
        if self.update(metrics, self.progress.step):
            self.trainer.log.print(f"stopping: {self.reason()}")

    @property
    def enabled(self) -> bool:
        return self.patience > 0

    def fired(self) -> bool:
        """Patience has run out: the loop ends after this evaluation's checkpoint."""
        return self.enabled and self.since_best >= self.patience

    def followed(self, metrics: dict[str, Any]) -> str | None:
        """The key this stopper reads: the model's metric, else its EMA twin."""
        for key in (self.metric, ema_key(self.metric)):
            if key in metrics:
                return key
        return None

    def improves(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        return value > self.best + self.min_delta if self.mode == "max" else value < self.best - self.min_delta

    def update(self, metrics: dict[str, Any], step: int) -> bool:
        """Count one evaluation; True when it makes patience run out (the caller says so once)."""
        if not self.enabled:
            return False
        key = self.followed(metrics)
        if key is None and metrics:
            raise KeyError(f"eval.patience follows eval.metric={self.metric!r}, which is not among the task's "
                           f"metrics {model_scalars(metrics)}")
        if step < self.start:  # every rank sees the same step: nothing to agree on
            return False
        if key is not None:  # rank 0 (and every rank of a task that reduces its metrics)
            value = float(metrics[key])
            if self.improves(value):
                self.best, self.best_step, self.since_best = value, step, 0
            else:
                self.since_best += 1
        if self.dist.enabled:
            self.load_state_dict(broadcast_object(self.state_dict(), self.dist))  # host sync (evaluation)
        self._tell_progress()
        return self.fired()

    def _tell_progress(self) -> None:
        if self.progress is not None and self.fired():
            self.progress.end_early("early_stopping", self.reason())

    def reason(self) -> str:
        """Why the run ended, in the words summary.json and the log use."""
        best = "none" if self.best is None else f"{self.best:.6g} at step {self.best_step}"
        since = f", counted from step {self.start:g}" if self.start else ""
        return (f"early stopping: {self.metric} did not improve by more than {self.min_delta:g} in "
                f"{self.since_best} evaluations (eval.patience={self.patience}{since}; best {best})")

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "since_best": self.since_best}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """``None``: a checkpoint written before early stopping existed; the record starts empty."""
        if not state:
            return
        self.best = None if state["best"] is None else float(state["best"])
        self.best_step, self.since_best = int(state["best_step"]), int(state["since_best"])
        self._tell_progress()  # a resumed run whose patience ran out (under this run's eval.patience) is done
