"""The first look at a run, before its first step: the first training batch drawn as the model
receives it, the training labels (detection), and the model's size: parameters per top-level
module (total, trainable, frozen) and FLOPs per sample at the training size.

What a user checks before trusting a run with a week of GPU time: a wrong label map, a transform
that loses the boxes, a backbone meant to be frozen that is not, a model ten times the intended size.

The batch is the one the training source gives first (epoch 0, batch 0, with its augmentation
seed), loaded here in the main process the way a worker loads it (``TrainSource.first_items``), so
the drawing shows the very tensors of the first step. Nothing here moves the training streams:
``SeededDataset`` forks torch's RNG while it loads, and the FLOP count runs one forward pass under
no_grad with every RNG forked and the model's buffers (BatchNorm statistics) and the task's state
(DINO's centre) put back after, so a run with the first look trains bit-identically to one without
(``trainer.summary=false``).
"""
from __future__ import annotations

import copy
import logging
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from visiontrain.core.config import Config
from visiontrain.engine.parallel.distributed import DistInfo
from visiontrain.engine.parallel.fsdp import is_sharded
from visiontrain.engine.protocols.hooks import Hook
from visiontrain.engine.protocols.task import Task
from visiontrain.engine.records.plots import save_figure
from visiontrain.engine.records.run_log import RunLogger, dumps_json
from visiontrain.engine.setup.data_choices import choose_workers, device_type
from visiontrain.engine.setup.loaders import train_loader, train_sampler
from visiontrain.engine.setup.placement import seed_everything
from visiontrain.engine.setup.training import TrainingRun
from visiontrain.engine.state.checkpoint import write_run_file
from visiontrain.engine.step.pipeline import to_device
from visiontrain.engine.step.source import LoaderSource, TrainSource
from visiontrain.rundir.run_files import MODEL_SUMMARY_FILE, PLOTS_DIR

log = logging.getLogger("visiontrain")

#: Samples of the first batch whose forward pass is counted (two: BatchNorm needs more than one value).
FLOP_SAMPLES = 2


def write_previews(task: Task, batch: Any, out_dir: Path) -> list[Path]:
    """The task's preview figures (``Task.preview_figures``) as ``out_dir/NAME.png``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in task.preview_figures(batch).items():
        save_figure(fig, out_dir / f"{name}.png", fast=True)
        written.append(out_dir / f"{name}.png")
    return written


@dataclass
class ModuleSize:
    name: str          # the top-level module's attribute name ("(own)": parameters of the root itself)
    kind: str          # its class
    total: int
    trainable: int

    @property
    def frozen(self) -> int:
        return self.total - self.trainable


@dataclass
class ModelSummary:
    model: str
    modules: list[ModuleSize]
    flops_per_sample: float | None
    flops_note: str    # how the FLOPs were counted, or why they were not

    def total(self) -> ModuleSize:
        return ModuleSize("total", "", sum(m.total for m in self.modules), sum(m.trainable for m in self.modules))

    def lines(self) -> list[str]:
        """The summary as aligned text lines, for the log."""
        rows = [(m.name, m.kind, m.total, m.trainable, m.frozen) for m in [*self.modules, self.total()]]
        name_w = max(len("module"), *(len(r[0]) for r in rows))
        kind_w = max(len("class"), *(len(r[1]) for r in rows))
        head = f"{'module':<{name_w}}  {'class':<{kind_w}}  {'params':>12}  {'trainable':>12}  {'frozen':>12}"
        out = [f"model {self.model}:", head]
        out += [f"{n:<{name_w}}  {k:<{kind_w}}  {t:>12,}  {tr:>12,}  {f:>12,}" for n, k, t, tr, f in rows]
        out.append(f"{self.flops_per_sample / 1e9:.4g} GFLOPs per sample (a training forward pass, "
                   f"torch.utils.flop_counter)" if self.flops_per_sample else f"FLOPs: {self.flops_note}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "modules": [{**asdict(m), "frozen": m.frozen} for m in self.modules],
                "total": {**asdict(self.total()), "frozen": self.total().frozen},
                "flops_per_sample": self.flops_per_sample, "flops_note": self.flops_note}


def parameter_table(model: nn.Module) -> list[ModuleSize]:
    """Parameters per top-level module, each shared tensor counted once (as ``named_parameters``
    gives it), in the model's own order; modules without parameters are left out."""
    children = dict(model.named_children())
    rows: dict[str, ModuleSize] = {}
    for name, param in model.named_parameters():
        top = name.split(".", 1)[0]
        key, kind = (top, type(children[top]).__name__) if top in children else ("(own)", type(model).__name__)
        row = rows.setdefault(key, ModuleSize(key, kind, 0, 0))
        row.total += param.numel()
        row.trainable += param.numel() if param.requires_grad else 0
    return list(rows.values())


def count_flops(model: nn.Module, task: Task, batch: Any, samples: int, device: torch.device,
                transform: Callable[[Any], Any] | None) -> float:
    """FLOPs of the model's own forward pass (not the loss, not a teacher) on ``batch`` in training
    mode, per sample, as torch.utils.flop_counter counts them (a multiply-add is two). One pass
    under no_grad that leaves no trace: see the module docstring."""
    counter, total = FlopCounterMode(display=False), [0]

    def enter(module: nn.Module, args: Any) -> None:
        counter.__enter__()

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        counter.__exit__(None, None, None)
        total[0] += counter.get_total_flops()

    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    task_state, py_state, np_state = copy.deepcopy(task.state_dict()), random.getstate(), np.random.get_state()
    was_training = model.training
    # With no tensor that requires grad, the counter's module tracker hooks no backward (which it
    # cannot do on some inputs under no_grad, e.g. DETR-R50's)
    params = [(p, p.requires_grad) for p in model.parameters()]
    for param, _ in params:
        param.requires_grad_(False)
    handles = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave, always_call=True)]
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            model.train()
            batch = to_device(batch, device, channels_last=False)
            task.losses(model, transform(batch) if transform is not None else batch)
    finally:
        for handle in handles:
            handle.remove()
        for param, flag in params:
            param.requires_grad_(flag)
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        task.load_state_dict(task_state)
        random.setstate(py_state)
        np.random.set_state(np_state)
        model.train(was_training)
    return total[0] / samples


def summarize_model(model: nn.Module, task: Task, items: list[Any], collate: Callable[[list], Any],
                    device: torch.device, *, sharded: bool) -> ModelSummary:
    """The parameter table and, unless the model is sharded (its layers then exist whole on no one
    process), the FLOPs per sample of the first ``FLOP_SAMPLES`` samples' forward pass. A count that
    fails is a note in the summary, never a failed run."""
    modules, name = parameter_table(model), type(model).__name__
    if sharded:
        return ModelSummary(name, modules, None, "not counted under FSDP: each process holds a shard of the layers")
    n = min(FLOP_SAMPLES, len(items))
    try:
        flops = count_flops(model, task, collate(items[:n]), n, device, task.device_transform(channels_last=False))
    except Exception as err:  # noqa: BLE001  (a summary must never stop a run)
        return ModelSummary(name, modules, None, f"counting failed: {type(err).__name__}: {err}")
    return ModelSummary(name, modules, flops, f"one training-mode forward pass of the model on {n} samples of "
                                              f"the first batch, torch.utils.flop_counter, a multiply-add = 2")


def first_look(run: TrainingRun, task: Task, log: RunLogger, *, plots: bool, summary: bool) -> None:
    """At the start of a fresh run: the preview figures into RUN_DIR/plots (rank 0, ``plots``) and
    the model summary in the log and RUN_DIR/model_summary.json (``summary``; counted on every rank,
    as a SyncBatchNorm forward pass is a collective). Neither may stop the run: a failure is a warning."""
    plots = plots and run.writes
    if not (plots or summary):
        return
    collate = run.source.collate
    items = run.source.first_items(None if plots else FLOP_SAMPLES)
    if plots:
        try:
            write_previews(task, collate(items), run.run_dir / PLOTS_DIR)
        except Exception as err:  # noqa: BLE001  (a view of the run, not part of it)
            log.print(f"warning: preview plots not drawn: {type(err).__name__}: {err}")
    if summary:
        sharded = is_sharded(list(run.raw_model.parameters()))  # FSDP on several processes
        result = summarize_model(run.raw_model, task, items, collate, run.device, sharded=sharded)
        log.print("\n".join(result.lines()))
        if run.writes:
            write_run_file(run.run_dir, MODEL_SUMMARY_FILE, dumps_json(result.to_dict(), indent=2))


def preview(cfg: Config, task: Task, out_dir: Path) -> list[Path]:
    """``visiontrain preview``: the figures a fresh run of ``cfg`` draws at its start, without a model
    or a process group: the same seed, data, sampler and first batch (of a single-process run)."""
    choose_workers(cfg, device_type(cfg.trainer.device))  # a shard source's order follows the workers
    seed_everything(cfg.seed)  # as engine.setup.training.build_training does before build_data
    data = task.build_data()
    if isinstance(data.train, TrainSource):
        source = data.train
    else:
        sampler = train_sampler(data, cfg, DistInfo())
        source = LoaderSource(sampler, train_loader(  # in this process
            data.train, sampler, random_transforms=data.random_transforms, collate=data.train_collate))
    return write_previews(task, source.collate(source.first_items()), out_dir)


class FirstLook(Hook):
    """The first look as a hook of the run: before the first step of a fresh run, after every other
    ``before_train`` hook (a task's may bind what its forward pass needs, as DINO's teacher)."""

    @classmethod
    def for_run(cls, trainer: Any) -> "FirstLook":
        return cls()

    def before_train(self) -> None:
        t = self.trainer
        if t.step == 0:  # a fresh run: its first batch drawn, the model's size logged
            first_look(t.run, t.task, t.log, plots=t.cfg.trainer.plots, summary=t.cfg.trainer.summary)
