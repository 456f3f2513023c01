"""The checkpointer: when ``last.pt`` is written, the best checkpoints, resume, and the run's last files.

A checkpoint is composed of the states registered in ``States`` (``engine.state.checkpoint_format``):
the weights, the loop's position, the data source, every part and hook with state, the RNGs. The
checkpointer knows none of them by name: it writes what they compose and hands each its entry back
on resume, so a part added to the run is checkpointed without a change here. Writes are atomic
(``engine.state.checkpoint.atomic_save``); every write first reads the recorded rows (no checkpoint
holds weights after a bad step) and checks the weights are finite: both host syncs. Under torchrun
every rank first takes rank 0's buffers (``sync_buffers``), the model's and the EMA's: the ranks
then go on from what the checkpoint holds, as a resumed run's ranks do.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

from visiontrain.core.config import config_to_dict, register_section
from visiontrain.core.typed_config import doc
from visiontrain.engine.parallel.distributed import broadcast_object, sync_buffers
from visiontrain.engine.parallel.fsdp import full_state_dict, is_sharded
from visiontrain.engine.parts.evaluator import checkpoint_metric
from visiontrain.engine.protocols.cadence import Cadence
from visiontrain.engine.protocols.part import Part, Progress
from visiontrain.engine.records.run_log import RunLogger, dumps_json
from visiontrain.engine.setup.training import TrainingRun
from visiontrain.engine.state.checkpoint import (BestTracker, CheckpointError, WeightsState, atomic_save,
                                                 load_checkpoint, write_run_file)
from visiontrain.engine.state.run_dir import config_changes
from visiontrain.engine.state.weights import check_resume_compatible, save_safetensors
from visiontrain.engine.step.guards import check_weights
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.rundir.metrics_file import ema_key, is_per_class, model_scalars
from visiontrain.rundir.run_files import LAST_CHECKPOINT, SUMMARY_FILE


@dataclass
class CheckpointConfig:
    every: int = doc("write checkpoints/last.pt every N units (0 = only at the end)", 1, minimum=0)
    unit: Literal["epochs", "steps"] = doc("unit of checkpoint.every", "epochs")
    keep_best: int = doc("also keep the k best checkpoints as best-stepS.pt (0 = only best.pt)", 0, minimum=0)
    keep_every: int = doc("keep a copy step-S.pt every N steps (0 = off)", 0, minimum=0)


register_section("checkpoint", CheckpointConfig, "checkpoint section")


class Checkpointer(Part):
    name, keeps = "checkpointer", True
    state_name = fmt.BEST  # its own state: the best values and the kept best-k files

    def __init__(self, settings: CheckpointConfig, run: TrainingRun, progress: Progress, states: fmt.States,
                 log: RunLogger, *, check_finite: Callable[[], None]) -> None:
        """Every checkpoint records the run's resolved config (a resume prints what changed);
        ``trainer.max_steps`` is what summary.json says ended the run; best checkpoints follow the
        metric ``eval.metric`` / ``eval.mode`` or the task names (``checkpoint_metric``)."""
        self.settings, self.built, self.progress, self.states, self.log = settings, run, progress, states, log
        self.config, self.max_steps = config_to_dict(run.cfg), run.cfg.trainer.max_steps
        metric, mode = checkpoint_metric(run.cfg.eval, run.task)
        self.check_finite, self.metric, self.mode = check_finite, metric, mode
        self.dir = run.ckpt_dir
        self.cadence = Cadence(settings.every, settings.unit)
        self.best = BestTracker(self.dir, mode, settings.keep_best) if run.writes else None
        self.weights_ok_at = 0  # the step at which the weights were last checked finite
        self.last_eval: dict[str, Any] = {}

    @classmethod
    def for_run(cls, trainer: Any) -> "Checkpointer":
        return cls(trainer.cfg.checkpoint, trainer.run, trainer.progress, trainer.states, trainer.log,
                   check_finite=trainer.parts["log_point"].check_finite)

    def due(self, step: int, epoch_end: bool) -> bool:
        """``checkpoint.every`` in ``checkpoint.unit``; not at the run's last step, whose end writes
        ``last.pt`` anyway (``finish``)."""
        return step < self.progress.total and self.cadence.due(self.progress, epoch_end, keeps=True)

    def run(self, epoch_end: bool = False) -> None:
        self.save_last()

    def after_eval(self, metrics: dict[str, Any]) -> None:
        self.last_eval = metrics
        self.keep_best(metrics)

    # ------------------------------------------------------------------ the state
    def state_dict(self) -> dict[str, Any] | None:
        return self.best.state_dict() if self.best is not None else None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.best is not None:
            self.best.load_state_dict(state)

    def compose(self) -> dict[str, Any]:
        """The whole training state. Under FSDP every rank calls it: each writes its shards of the
        model, EMA and optimizer (engine.fsdp), and the dict names their directory instead."""
        r, p = self.built, self.progress
        check_weights([r.raw_model] + ([r.ema_model] if r.ema_model is not None else []), p.step,
                      self.weights_ok_at, reduce=r.sharded is not None and r.dist.enabled,
                      ckpt_dir=self.dir)  # host sync (checkpoint)
        self.weights_ok_at = p.step
        return self.states.compose(self.config, r.data_info)

    def resume(self, source: str) -> None:
        """Every state back where the checkpoint left it; refused (naming why) when it cannot be exact."""
        state = load_checkpoint(source, resolve_sharded=False)
        check_resume_compatible(state, self.built, source)
        for line in config_changes(fmt.config_of(state) or {}, self.config):
            self.log.print(line)
        weights = self.states.get(fmt.WEIGHTS)
        if isinstance(weights, WeightsState):
            weights.checkpoint_path = Path(source)  # an FSDP run's shards are beside it
        try:
            absent, unknown = self.states.restore(state)
        except ValueError as err:  # a state this run cannot continue exactly, in the words of its owner
            raise CheckpointError(f"--resume {source}: {err}; use --init {source} to start a new run from its "
                                  f"weights") from None
        for name in absent:  # a part this run has and the checkpoint's did not: it starts as built
            self.log.print(f"resume: {source} holds no state of {name!r}: it starts afresh")
        for name in unknown:
            self.log.print(f"resume: {source} holds the state of {name!r}, which this run has no part for")
        p = self.progress
        self.log.rewind(p.step)
        self.log.print(f"resumed from {source} at step {p.step} (epoch {p.epoch}, step {p.step_in_epoch} of the epoch)")

    # ------------------------------------------------------------------ the files
    def save_last(self) -> None:
        self.check_finite()  # host sync: a checkpoint never holds weights after a bad step
        r = self.built
        sync_buffers([r.raw_model, r.ema_model], r.dist)  # every rank, also those that write nothing
        if self.dir is None or not (r.dist.is_main or r.sharded is not None):
            return
        state = self.compose()
        if not r.dist.is_main:
            return
        atomic_save(state, self.dir / LAST_CHECKPOINT)
        every = self.settings.keep_every
        if every and self.progress.step % every == 0:
            atomic_save(state, self.dir / f"step-{self.progress.step}.pt")
        if r.sharded is not None:
            r.sharded.prune()

    def keep_best(self, metrics: dict[str, Any]) -> None:
        """best.pt / best_ema.pt on a new record of the checkpoint metric, and the k best."""
        r, metric = self.built, self.metric
        scalars = model_scalars(metrics)
        if self.best is not None and metric and is_per_class(metric):
            raise ValueError(f"eval.metric={metric!r} is a per-class table, not a number: choose one of {scalars}")
        if self.best is not None and metric and metric not in metrics and ema_key(metric) not in metrics:
            raise KeyError(f"eval.metric={metric!r} is not among the task's metrics {scalars}")
        if self.best is None and r.sharded is None:
            return
        keys = {"model": metric, "ema": ema_key(metric)}
        wants = [w for w, k in keys.items() if self.best and k in metrics and self.best.wants(w, metrics[k])]
        if r.sharded is not None:
            wants = broadcast_object(wants, r.dist)  # host sync: every rank writes its shards
        state = self.compose() if wants else None
        for which in wants if self.best is not None else ():
            self.best.update(which, metrics[keys[which]], state, self.progress.step)
        if wants and r.sharded is not None and r.dist.is_main:
            r.sharded.prune()

    def finish(self) -> dict[str, Any]:
        """The last checkpoint, the final weights as safetensors (FSDP: gathered), summary.json."""
        self.save_last()
        r, p = self.built, self.progress
        for name, module in (("model", r.raw_model), ("model_ema", r.ema_model)):
            sharded = is_sharded(list(module.parameters())) if module is not None else False
            if module is not None and r.run_dir is not None and (r.dist.is_main or sharded):
                weights = full_state_dict(module) if sharded else module.state_dict()  # FSDP: a gather
                if r.dist.is_main:
                    save_safetensors(weights, r.run_dir / f"{name}.safetensors")
        if not r.writes:
            return {}
        summary = {
            "steps": p.step, "epochs": p.epoch, "wall_s": round(p.wall_before + p.trained_s, 3),
            "final": dict(self.last_eval), "best": dict(self.best.best) if self.best else {},
            "metric": self.metric, "mode": self.mode,
            "ended": p.end_reason(self.max_steps), "precision": r.precision.record(),
        }
        for part in self.trainer.parts.values():  # each part's own measures (the log point's throughput...)
            if isinstance(part, Part):
                summary.update(part.summary())
        write_run_file(r.run_dir, SUMMARY_FILE, dumps_json(summary, indent=2))
        self.log.table("final", {**summary["final"], "wall_s": summary["wall_s"]})
        return summary
