"""The checkpoint's format: composed of the registered states, read in one module, upgraded from the
format before it (a run interrupted under commit 22eb1c6 finishes bit-identically), and a newer
format refused in one line."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import format1_run
from procs import cli_here
from toy_task import ToyTask, toy_config
from visiontrain.engine.loop.trainer import Trainer
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.engine.state.checkpoint import CheckpointError, load_checkpoint

FIXTURE = Path(__file__).parents[1] / "fixtures" / "format1"


def fixture_run(tmp_path: Path) -> Path:
    """A run dir holding the fixture's last.pt, as the interrupted run left it."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(FIXTURE / "last.pt", run / "checkpoints" / "last.pt")
    return run


#: What the log point's state holds since after format 1 (the data-wait totals): not in such a file
LATER_LOG_POINT_KEYS = ("wait_s", "logged_s")


def to_format_1(state: dict[str, Any]) -> dict[str, Any]:
    """A current checkpoint written as commit 22eb1c6 wrote it (format 1): the inverse of the upgrade
    ``checkpoint_format`` applies when it reads one."""
    weights, data = state[fmt.WEIGHTS], state[fmt.DATA]
    progress = {**state[fmt.PROGRESS], "batch_size": data["batch_size"], "world_size": data["world_size"],
                "strategy": weights[fmt.STRATEGY]}
    return {fmt.FORMAT: 1, "model": weights["model"], "optimizer": weights["optimizer"], "ema": weights.get("ema"),
            "scaler": state.get(fmt.SCALER), "progress": progress, "sampler_seed": data["seed"], "rng": state[fmt.RNG],
            "best": state[fmt.BEST], "early_stop": state[fmt.EARLY_STOP],
            "metrics": {k: v for k, v in state[fmt.LOG_POINT].items() if k not in LATER_LOG_POINT_KEYS},
            "task": state[fmt.TASK], "data_info": state[fmt.DATA_INFO], "config": state[fmt.CONFIG]}


def layout(tree: Any) -> Any:
    """The names of a checkpoint's entries and of their dicts' keys, down to the tensors."""
    if isinstance(tree, dict) and not all(isinstance(v, torch.Tensor) for v in tree.values()):
        return {k: layout(v) for k, v in tree.items() if k not in (fmt.CONFIG, "optimizer")}
    return type(tree).__name__


def resume_to_the_end(run: Path) -> Trainer:
    cfg = toy_config(**format1_run.OVERRIDES)
    resumed = Trainer(cfg, ToyTask(cfg), run, resume=str(run / "checkpoints" / "last.pt"))
    assert (resumed.step, resumed.epoch, resumed.step_in_epoch) == (format1_run.CHECKPOINT_AT, 1, 8)
    resumed.fit()
    assert resumed.step == format1_run.TOTAL_STEPS
    # what it writes now is the current format
    assert torch.load(run / "checkpoints" / "last.pt", weights_only=True)[fmt.FORMAT] == fmt.FORMAT_VERSION
    return resumed


def test_a_run_interrupted_under_format_1_ends_bit_identical_to_its_straight_run(tmp_path, monkeypatch):
    """Both runs are made here, on this machine (float results are bit-identical only between runs on
    the same kind of CPU); the cut run's checkpoint is written back in format 1, in the layout of the
    file commit 22eb1c6 wrote, and resumed. They seed each batch's augmentation as the versions that
    wrote format 1 did, as a resume of such a file goes on doing (its data entry has no ``seeding``)."""
    from visiontrain.data.samplers import ResumableBatchSampler

    monkeypatch.setattr(ResumableBatchSampler, "seeding", "batch")  # the straight and the cut run, as then
    final, cut = format1_run.straight_and_cut(tmp_path)
    monkeypatch.undo()  # the resume takes it from the file
    old = to_format_1(torch.load(cut, weights_only=True))
    assert layout(old) == layout(torch.load(FIXTURE / "last.pt", weights_only=True))
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    torch.save(old, run / "checkpoints" / "last.pt")
    resumed = resume_to_the_end(run)
    for which, module in (("model", resumed.raw_model), ("ema", resumed.ema.module)):
        for name, tensor in module.state_dict().items():
            assert torch.equal(tensor, final[which][name]), f"{which}.{name}"


#: The committed run's end against its resume here: 24 steps of AdamW continued on another CPU's
#: kernels. The largest difference of any weight, measured on an AMD EPYC (AVX2): 0 under
#: ATEN_CPU_CAPABILITY=avx2, 8.9e-8 under =default; on an AVX-512 Xeon without AVX512-BF16 the old
#: bit-exact check failed. About ten times the larger.
CROSS_CPU_ATOL = 1e-6


def test_the_format_1_checkpoint_commit_22eb1c6_wrote_resumes_and_continues(tmp_path):
    torch.set_num_threads(1)  # as the fixture was made (conftest's setting, said again here)
    run = fixture_run(tmp_path)
    raw = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert raw[fmt.FORMAT] == 1  # the file as commit 22eb1c6 wrote it
    resumed = resume_to_the_end(run)
    final = torch.load(FIXTURE / "final.pt", weights_only=True)
    for which, module in (("model", resumed.raw_model), ("ema", resumed.ema.module)):
        for name, tensor in module.state_dict().items():
            torch.testing.assert_close(tensor, final[which][name], atol=CROSS_CPU_ATOL, rtol=0,
                                       msg=lambda m: f"{which}.{name}: {m}")


def test_a_format_1_checkpoint_reads_as_the_current_format(tmp_path):
    from visiontrain.use.trained import load_trained

    state = load_checkpoint(FIXTURE / "last.pt")
    assert state[fmt.FORMAT] == fmt.FORMAT_VERSION and not fmt.missing_entries(state)
    assert fmt.step_of(state) == format1_run.CHECKPOINT_AT and fmt.strategy_of(state) == fmt.REPLICATED
    assert fmt.entry(state, fmt.DATA) == {"seed": 0, "batch_size": 16, "world_size": 1}
    trained = load_trained(FIXTURE / "last.pt")  # what validate, predict and export take
    assert trained.step == format1_run.CHECKPOINT_AT and trained.has_ema
    assert trained.model(ema=True)(torch.zeros(1, 16)).shape == (1, 1)


def test_a_newer_format_is_refused_in_one_line_naming_both_versions(tmp_path, capfd):
    run = fixture_run(tmp_path)
    state = load_checkpoint(run / "checkpoints" / "last.pt")
    state[fmt.FORMAT] = fmt.FORMAT_VERSION + 1
    torch.save(state, run / "checkpoints" / "last.pt")
    before = sorted(p.name for p in run.rglob("*"))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(run / "checkpoints" / "last.pt")
    assert (f"has format {fmt.FORMAT_VERSION + 1}, newer than format {fmt.FORMAT_VERSION} that this visiontrain "
            f"reads") in str(err.value)
    proc = cli_here("validate", str(run / "checkpoints" / "last.pt"), capture=capfd)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"format {fmt.FORMAT_VERSION + 1}" in lines[0] and f"format {fmt.FORMAT_VERSION}" in lines[0]
    assert sorted(p.name for p in run.rglob("*")) == before  # nothing written


def test_the_checkpoint_is_composed_of_the_registered_states(tmp_path):
    cfg = toy_config(trainer__max_steps=3, ema__enabled=True)
    trainer = Trainer(cfg, ToyTask(cfg), tmp_path / "run")
    trainer.fit()
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert list(state) == [fmt.FORMAT, *trainer.states.names(), fmt.CONFIG, fmt.DATA_INFO]
    assert trainer.states.names() == [fmt.WEIGHTS, fmt.PROGRESS, fmt.DATA, fmt.TASK, fmt.LOG_POINT, fmt.BEST,
                                      fmt.EARLY_STOP, fmt.RNG]
    with pytest.raises(ValueError, match="checkpoint entry 'progress' is taken"):
        trainer.states.register(fmt.PROGRESS, trainer.progress)


class ReadsOf(dict):
    """A checkpoint that notes which module reads each of its top-level entries by name."""

    def __init__(self, *args: Any, reads: list[tuple[str, str]]) -> None:
        super().__init__(*args)
        self.reads = reads

    def _note(self, key: Any) -> None:
        self.reads.append((key, sys._getframe(2).f_globals.get("__name__", "?")))

    def __getitem__(self, key: Any) -> Any:
        self._note(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._note(key)
        return super().get(key, default)

    def __contains__(self, key: Any) -> bool:
        self._note(key)
        return super().__contains__(key)


def test_only_the_format_module_reads_a_checkpoint_entry_by_name(tmp_path, monkeypatch):
    """Every reader of a checkpoint goes through engine.state.checkpoint_format: resume, validate/predict/
    export (use/trained.py), --init, consolidate's check and the FSDP pruning of directories."""
    from visiontrain.engine.parallel.distributed import DistInfo
    from visiontrain.engine.state.sharded import ShardedCheckpoints
    from visiontrain.engine.state.weights import load_init_weights
    from visiontrain.use.trained import load_trained

    cfg = toy_config(trainer__max_steps=4, ema__enabled=True)
    Trainer(cfg, ToyTask(cfg), tmp_path / "a").fit()
    last = tmp_path / "a" / "checkpoints" / "last.pt"
    reads: list[tuple[str, str]] = []
    load = torch.load

    def watched(*args: Any, **kwargs: Any) -> Any:
        obj = load(*args, **kwargs)
        return ReadsOf(obj, reads=reads) if isinstance(obj, dict) and fmt.FORMAT in obj else obj

    monkeypatch.setattr(torch, "load", watched)
    more = toy_config(trainer__max_steps=6, ema__enabled=True)
    Trainer(more, ToyTask(more), tmp_path / "a", resume=str(last)).fit()
    trained = load_trained(last)
    trained.model(ema=True), trained.step
    fresh = ToyTask(cfg).build_model({"dim": 16})
    load_init_weights(fresh, last)
    fmt.sharded_record(load_checkpoint(last, resolve_sharded=False))
    ShardedCheckpoints(tmp_path / "a" / "checkpoints", DistInfo()).prune()
    names = {*fmt.META, fmt.WEIGHTS, fmt.PROGRESS, fmt.DATA, fmt.TASK, fmt.LOG_POINT, fmt.BEST, fmt.EARLY_STOP, fmt.RNG}
    outside = sorted({(key, module) for key, module in reads if module != fmt.__name__})
    assert not outside, f"checkpoint entries read outside {fmt.__name__}: {outside}"
    assert {key for key, _ in reads} == names  # every entry was read, so the check saw every reader
