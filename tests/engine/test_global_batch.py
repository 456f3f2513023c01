"""A resume keeps the checkpoint's global batch: the split it chooses on another number of processes,
what it refuses, and the data source's own check (engine.setup.global_batch, engine.step.source).
The whole chain through the CLI, killed and resumed on 1, 2, 3 and 1 processes:
tests/reliability/test_world_size_change.py."""
from __future__ import annotations

import pytest
import torch

from toy_task import ToyTask, toy_config, train
from visiontrain.core.config import ConfigError
from visiontrain.engine.loop.trainer import Trainer
from visiontrain.engine.setup.global_batch import keep_global_batch
from visiontrain.engine.state.checkpoint import load_checkpoint
from visiontrain.rundir import checkpoint_format as fmt


def written(batch_size: int, world_size: int, accum_steps: int = 1, follows: str = "any") -> dict:
    """The entries of a checkpoint the plan reads: the data source's split and the run's config."""
    return {fmt.DATA: {"seed": 0, "batch_size": batch_size, "world_size": world_size, "accum_steps": accum_steps,
                       "follows_world_size": follows},
            fmt.CONFIG: {"trainer": {"accum_steps": accum_steps}, "task": {"name": "toy"},
                         "data": {"name": "fashion-mnist"}}}


def plan(checkpoint: dict, world_size: int, **overrides) -> tuple[tuple[int, int], str | None]:
    cfg, line = keep_global_batch(toy_config(**overrides), checkpoint, world_size)
    return (cfg.data.batch_size, cfg.trainer.accum_steps), line


@pytest.mark.parametrize("was, world, asked, chosen, line", [
    # fewer processes: the accumulation makes up for them, each process's batch (and memory) as configured
    ((6, 2, 1), 1, (6, 1), (6, 2), "resumed on 1 process (written on 2): trainer.accum_steps 1 -> 2: global "
                                   "batch 12 kept"),
    # more: the per-process batch shrinks
    ((6, 1, 2), 3, (6, 2), (4, 1), "resumed on 3 processes (written on 1): data.batch_size 6 -> 4, "
                                   "trainer.accum_steps 2 -> 1: global batch 12 kept"),
    # the largest per-process batch not above the configured one: 12 / 2 = 6 = 3 x 2
    ((4, 3, 1), 2, (4, 1), (3, 2), "resumed on 2 processes (written on 3): data.batch_size 4 -> 3, "
                                   "trainer.accum_steps 1 -> 2: global batch 12 kept"),
    # a split that already keeps it is taken as configured, and said
    ((8, 2, 1), 1, (8, 2), (8, 2), "resumed on 1 process (written on 2): global batch 16 kept "
                                   "(data.batch_size=8 on 1 process x trainer.accum_steps=2)"),
    # the same processes, a smaller batch asked (to fit in memory): accumulation keeps the global batch
    ((32, 1, 1), 1, (16, 1), (16, 2), "resumed on 1 process: trainer.accum_steps 1 -> 2: global batch 32 kept"),
    # nothing changed: nothing to say
    ((32, 1, 1), 1, (32, 1), (32, 1), None),
])
def test_the_split_that_keeps_the_global_batch(was, world, asked, chosen, line):
    assert plan(written(*was), world, data__batch_size=asked[0], trainer__accum_steps=asked[1]) == (chosen, line)


def test_grouped_batches_keep_the_per_process_batch_and_refuse_what_accumulation_cannot_make():
    grouped = written(4, 2, 3, follows="accumulation")  # 24 images a step, batches of 4 by orientation
    assert plan(grouped, 3, data__batch_size=4, trainer__accum_steps=3)[0] == (4, 2)
    assert plan(grouped, 1, data__batch_size=2, trainer__accum_steps=3)[0] == (4, 6)  # not 2: the walk is cut at 4
    with pytest.raises(ConfigError) as info:
        plan(grouped, 4, data__batch_size=4, trainer__accum_steps=3)
    assert str(info.value) == (
        "resume on 4 processes: the checkpoint trained with a global batch of 24 (data.batch_size=4 on 2 processes x "
        "trainer.accum_steps=3), which 4 processes cannot make: its batches are grouped by aspect ratio, so the "
        "per-process batch stays 4 and only trainer.accum_steps may change. Resume on 1, 2, 3, 6 processes, or "
        "start a new run from its weights with --init")


def test_a_global_batch_the_processes_do_not_divide_is_refused_naming_those_that_do():
    with pytest.raises(ConfigError, match=r"global batch of 16 \(data.batch_size=16 on 1 process x trainer.accum_steps"
                                          r"=1\), which 3 processes cannot make\. Resume on 1, 2, 4, 8, 16 processes"):
        plan(written(16, 1), 3, data__batch_size=16)


def test_accumulation_from_an_epoch_on_keeps_it_and_changes_the_batch():
    """Two global batches (one micro-batch a step before trainer.accum_after_epoch): both kept."""
    assert plan(written(8, 1, 2), 2, data__batch_size=8, trainer__accum_steps=2, trainer__accum_after_epoch=1)[0] \
        == (4, 2)


def test_a_sharded_checkpoint_is_planned_on_any_number_of_processes():
    """FSDP on one process shards nothing, and reads (and writes) the sharded format whole."""
    sharded = {**written(4, 2, 2), fmt.WEIGHTS: {fmt.SHARDED: {"dir": "step-4"}}}
    assert plan(sharded, 4, data__batch_size=4, trainer__accum_steps=2)[0] == (4, 1)
    assert plan(sharded, 1, data__batch_size=4, trainer__accum_steps=2)[0] == (4, 4)


def test_shards_follow_the_divisors_of_the_processes_their_order_is_cut_for():
    shards = written(6, 2, follows="canonical")
    shards[fmt.DATA]["order_processes"] = 6  # data.order_processes=6: resumable on 1, 2, 3 and 6 processes
    assert plan(shards, 3, data__batch_size=6) == ((4, 1), "resumed on 3 processes (written on 2): data.batch_size "
                                                           "6 -> 4: global batch 12 kept")
    assert plan(shards, 1, data__batch_size=6)[0] == (12, 1)  # not 6 x 2: the accumulation stays
    with pytest.raises(ConfigError) as info:
        plan(shards, 4, data__batch_size=6)
    assert str(info.value).endswith(
        "which 4 processes cannot make: its shards' order is cut for 6 processes (data.order_processes), so the "
        "processes must divide it and trainer.accum_steps stays 1. Resume on 1, 2, 3, 6 processes, or start a "
        "new run from its weights with --init")


def test_shards_grouped_by_aspect_and_a_task_source_are_left_to_the_source():
    cfg = toy_config(data__batch_size=8)
    assert keep_global_batch(cfg, written(8, 2, follows="none"), 1) == (cfg, None)
    assert keep_global_batch(cfg, {fmt.DATA: {"steps": 3}}, 1) == (cfg, None)


def test_a_resume_with_half_the_batch_accumulates_two_and_trains_the_straight_runs_steps(tmp_path):
    """Through the Trainer: the line, the checkpoint of the resumed run, and the weights of the
    straight run to float rounding (two micro-batches of 16 sum the gradient in another order than
    one of 32; measured 3e-8)."""
    straight = train(toy_config(trainer__max_steps=6), tmp_path / "straight")
    train(toy_config(trainer__max_steps=3), tmp_path / "cut")
    half = toy_config(trainer__max_steps=6, data__batch_size=16)
    resumed = Trainer(half, ToyTask(half), tmp_path / "cut", resume="auto")
    assert (resumed.cfg.data.batch_size, resumed.cfg.trainer.accum_steps) == (16, 2)
    assert "resumed on 1 process: trainer.accum_steps 1 -> 2: global batch 32 kept" in resumed.run.notes
    resumed.fit()
    for name, weight in straight.raw_model.state_dict().items():
        torch.testing.assert_close(resumed.raw_model.state_dict()[name], weight, rtol=1e-5, atol=1e-6)
    data = fmt.entry(load_checkpoint(tmp_path / "cut" / "checkpoints" / "last.pt"), fmt.DATA)
    assert (data["batch_size"], data["world_size"], data["accum_steps"]) == (16, 1, 2)


def test_a_checkpoint_that_records_no_split_is_refused_on_another_number_of_processes(tmp_path):
    """A checkpoint written before a resume could change the split (no accum_steps or
    follows_world_size in its data entry) resumes only as it was written."""
    from visiontrain.engine.state.checkpoint import CheckpointError

    train(cfg := toy_config(trainer__max_steps=3), tmp_path / "old")
    state = load_checkpoint(tmp_path / "old" / "checkpoints" / "last.pt")
    data = fmt.entry(state, fmt.DATA)
    del data["accum_steps"], data["follows_world_size"]
    data["world_size"] = 2  # as a run on two processes wrote it
    torch.save(state, path := tmp_path / "two-processes.pt")
    with pytest.raises(CheckpointError) as info:
        Trainer(cfg, ToyTask(cfg), None, resume=str(path))
    assert (f"--resume {path}: it was written with data.batch_size=32 on 2 process(es) x trainer.accum_steps=1; "
            f"this run has data.batch_size=32 on 1 x 1. An exact resume needs the global batch kept") in str(info.value)
