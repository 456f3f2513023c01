"""The checkpointer: when ``last.pt`` is written, what a checkpoint holds, and the run's last files.

A checkpoint composes the state of every part of the run (weights and optimizer, replicated or
sharded; the loop's position; the log point's unread rows and counters; the best-k record; the
task's state; the RNGs) so that a resume continues bit-exactly. Writes are atomic
(``engine.checkpoint.atomic_save``); every write first reads the recorded rows (no checkpoint
holds weights after a bad step) and checks the weights are finite: both host syncs.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from visiontrain.config import config_to_dict
from visiontrain.engine.checkpoint import BestTracker, ReplicatedWeights, atomic_save, capture_rng, restore_rng, \
    write_run_file
from visiontrain.engine.distributed import broadcast_object
from visiontrain.engine.early_stop import EarlyStopping
from visiontrain.engine.fsdp import full_state_dict
from visiontrain.engine.guards import check_weights
from visiontrain.engine.log_point import LogPoint
from visiontrain.engine.logging import RunLogger, dumps_json
from visiontrain.engine.metrics_file import ema_key, is_per_class, model_scalars
from visiontrain.engine.parts import Progress
from visiontrain.engine.run import TrainingRun
from visiontrain.engine.run_dir import config_changes
from visiontrain.engine.weights import check_resume_compatible, save_safetensors

CHECKPOINT_FORMAT = 1


class Checkpointer:
    def __init__(self, run: TrainingRun, progress: Progress, log_point: LogPoint, log: RunLogger,
                 early_stop: EarlyStopping, metric: str, mode: str) -> None:
        self.built, self.progress, self.log_point, self.log = run, progress, log_point, log
        self.early_stop = early_stop
        self.cfg, self.metric, self.mode = run.cfg, metric, mode
        self.dir = run.ckpt_dir
        self.weights = run.sharded or ReplicatedWeights()
        self.best = BestTracker(self.dir, mode, run.cfg.checkpoint.keep_best) if run.writes else None
        self.weights_ok_at = 0  # the step at which the weights were last checked finite

    def due(self, step: int, epoch_end: bool) -> bool:
        """``checkpoint.every`` epochs or steps. A step checkpoint that falls on an epoch's last step
        waits for that epoch's end (its log point and evaluation): written before them, a resume
        would run them again and log the step's evaluation twice."""
        c, p = self.cfg.checkpoint, self.progress
        if c.every <= 0 or step >= p.total:
            return False
        if epoch_end:  # after Progress.next_epoch: a checkpoint here resumes at the next epoch
            by_epoch = c.unit == "epochs" and not p.last_epoch_done() and p.epochs_done() % c.every == 0
            return by_epoch or (c.unit == "steps" and step % c.every == 0)
        return c.unit == "steps" and step % c.every == 0 and not p.epoch_steps_done()

    def run(self, epoch_end: bool = False) -> None:
        self.save_last()

    # ------------------------------------------------------------------ the state
    def state_dict(self) -> dict[str, Any]:
        """The whole training state. Under FSDP every rank calls it: each writes its shards of the
        model, EMA and optimizer (engine.fsdp), and the dict names their directory instead."""
        r, p = self.built, self.progress
        check_weights([r.raw_model] + ([r.ema_model] if r.ema_model is not None else []), p.step,
                      self.weights_ok_at, reduce=r.sharded is not None, ckpt_dir=self.dir)  # host sync (checkpoint)
        self.weights_ok_at = p.step
        return {
            "format": CHECKPOINT_FORMAT,
            **self.weights.save(p.step, r.raw_model, r.optimizer, r.ema),
            "scaler": r.scaler.state_dict() if r.scaler is not None else None,
            "progress": {**p.state_dict(), "batch_size": self.cfg.data.batch_size, "world_size": r.dist.world_size,
                         "strategy": "fsdp" if r.sharded is not None else "replicated"},
            "sampler_seed": r.sampler.seed,
            "rng": capture_rng(),
            "best": self.best.state_dict() if self.best is not None else None,
            "early_stop": self.early_stop.state_dict(),
            "metrics": self.log_point.state_dict(),
            "task": r.task.state_dict(),
            "data_info": r.data_info,
            "config": config_to_dict(self.cfg),
        }

    def resume(self, state: dict[str, Any], source: str) -> None:
        """Every part back where the checkpoint left it; refused (naming why) when it cannot be exact."""
        r = self.built
        check_resume_compatible(state, r, source)
        for line in config_changes(state["config"], config_to_dict(self.cfg)):
            self.log.print(line)
        self.weights.load(Path(source), state, r.raw_model, r.optimizer, r.ema)
        if r.scaler is not None and state["scaler"] is not None:
            r.scaler.load_state_dict(state["scaler"])
        self.progress.load_state_dict(state["progress"])
        r.sampler.seed = int(state["sampler_seed"])
        if self.best is not None and state["best"] is not None:
            self.best.load_state_dict(state["best"])
        self.log_point.load_state_dict(state["metrics"])
        self.early_stop.load_state_dict(state.get("early_stop"))
        r.task.load_state_dict(state["task"])
        restore_rng(state["rng"])
        p = self.progress
        self.log.rewind(p.step)
        self.log.print(f"resumed from {source} at step {p.step} (epoch {p.epoch}, step {p.step_in_epoch} of the epoch)")

    # ------------------------------------------------------------------ the files
    def save_last(self) -> None:
        self.log_point.check_finite()  # host sync: a checkpoint never holds weights after a bad step
        r = self.built
        if self.dir is None or not (r.dist.is_main or r.sharded is not None):
            return
        state = self.state_dict()
        if not r.dist.is_main:
            return
        atomic_save(state, self.dir / "last.pt")
        every = self.cfg.checkpoint.keep_every
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
        state = self.state_dict() if wants else None
        for which in wants if self.best is not None else ():
            self.best.update(which, metrics[keys[which]], state, self.progress.step)
        if wants and r.sharded is not None and r.dist.is_main:
            r.sharded.prune()

    def finish(self, last_eval: dict[str, Any], wall_s: float, ended: dict[str, str]) -> dict[str, Any]:
        """The last checkpoint, the final weights as safetensors (FSDP: gathered), summary.json
        (``ended``: why the run ended)."""
        self.save_last()
        r, p, lp = self.built, self.progress, self.log_point
        for name, module in (("model", r.raw_model), ("model_ema", r.ema_model)):
            if module is not None and r.run_dir is not None and (r.dist.is_main or r.sharded):
                weights = full_state_dict(module) if r.sharded else module.state_dict()  # FSDP: a gather
                if r.dist.is_main:
                    save_safetensors(weights, r.run_dir / f"{name}.safetensors")
        if not r.writes:
            return {}
        summary = {
            "steps": p.step, "epochs": p.epoch, "wall_s": round(p.wall_before + wall_s, 3),
            "samples_per_s": lp.samples_seen / max(wall_s, 1e-9), "final": dict(last_eval),
            "best": dict(self.best.best) if self.best else {}, "metric": self.metric, "mode": self.mode,
            "skipped_steps": lp.skipped, "fp16_overflow_skips": lp.overflow_skipped, "ended": ended,
        }
        write_run_file(r.run_dir, "summary.json", dumps_json(summary, indent=2))
        self.log.table("final", {**summary["final"], "wall_s": summary["wall_s"]})
        return summary
