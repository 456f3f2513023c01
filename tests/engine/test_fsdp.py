"""FSDP2 (distributed.strategy=fsdp) on CPU with gloo: 2 sharded ranks x batch B equal 1 process x 2B
(with an EMA, clipping, accumulation, a skipped NaN step); sharded checkpoints resume exactly,
consolidate into one file, and name only complete directories."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from procs import run_cli
from toy_ranks import run
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.engine.state.checkpoint import CheckpointError, load_checkpoint

FSDP = {"distributed__strategy": "fsdp"}
COMMON = {"trainer__epochs": 2, "optim__name": "adamw", "optim__lr": 0.01, "checkpoint__every": 1,
          "ema__enabled": True, "ema__decay": 0.9, "trainer__clip_grad": 0.5}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("case", [
    {"trainer__accum_steps": 2, "distributed__fsdp_units": ["0", "3"]},              # each Linear its own unit
    {"task__poison_step": 5, "trainer__nonfinite": "skip", "optim__impl": "foreach"},  # a skipped step, non-fused
])
def test_sharded_ranks_equal_one_process_with_twice_the_batch(tmp_path, case):
    run(2, tmp_path / "fsdp.pt", tmp_path / "fsdp", data__batch_size=16, **COMMON, **FSDP, **case)
    run(1, tmp_path / "single.pt", tmp_path / "single", data__batch_size=32, **COMMON, **case)
    a, b = torch.load(tmp_path / "fsdp.pt"), torch.load(tmp_path / "single.pt")
    assert max_diff(a["model"], b["model"]) < 1e-5 and max_diff(a["ema"], b["ema"]) < 1e-5
    run_dir = tmp_path / "fsdp"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["skipped_steps"] == (1 if "task__poison_step" in case else 0)
    # the safetensors files hold the gathered full weights
    assert max_diff(load_file(run_dir / "model.safetensors"), a["model"]) == 0.0
    # rank 0 wrote the .pt files; each names one complete sharded directory, and no other is left
    ckpts = run_dir / "checkpoints"
    named = {fmt.sharded_record(load_checkpoint(p, resolve_sharded=False))["dir"] for p in ckpts.glob("*.pt")}
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == sorted(named)
    assert all((ckpts / d / ".metadata").is_file() for d in named)
    assert not [p for p in run_dir.rglob(".step-*")]  # no half-written or set-aside directory


def test_sharded_resume_is_exact_and_consolidates(tmp_path):
    common = {**COMMON, **FSDP, "data__batch_size": 16, "eval__every": 1}
    run(2, tmp_path / "whole.pt", tmp_path / "whole", **common)
    run(2, tmp_path / "part.pt", tmp_path / "part", trainer__max_steps=5, **common)  # stops mid-epoch 0
    last = tmp_path / "part" / "checkpoints" / "last.pt"
    assert fmt.step_of(load_checkpoint(last, resolve_sharded=False)) == 5
    run(2, tmp_path / "resumed.pt", tmp_path / "part", resume=last, **common)
    whole, resumed = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "resumed.pt")
    assert max_diff(whole["model"], resumed["model"]) == 0.0 and max_diff(whole["ema"], resumed["ema"]) == 0.0

    # a .pt of an FSDP run reads as one file: full tensors, the optimizer keyed by parameter name
    state = load_checkpoint(last)
    assert max_diff(fmt.model_weights(state), whole["model"]) == 0.0
    assert max_diff(fmt.ema_weights(state), whole["ema"]) == 0.0
    assert set(fmt.optimizer_state(state)["state"]) == set(whole["model"])
    proc = run_cli("consolidate", str(last))
    assert proc.returncode == 0, proc.stderr
    full = load_checkpoint(last.with_name("last-full.pt"), resolve_sharded=False)
    assert fmt.sharded_record(full) is None and max_diff(fmt.model_weights(full), whole["model"]) == 0.0
    again = run_cli("consolidate", str(last.with_name("last-full.pt")))
    assert again.returncode == 2 and "already a single-file checkpoint" in again.stderr

    # a replicated (one-process) run refuses to resume a sharded checkpoint, and says what to do
    from toy_task import ToyTask, toy_config
    from visiontrain.engine.loop.trainer import Trainer

    cfg = toy_config(**{k: v for k, v in common.items() if k != "distributed__strategy"})
    with pytest.raises(CheckpointError, match="sharded .*same distributed.strategy.*--init"):
        Trainer(cfg, ToyTask(cfg), tmp_path / "other", resume=str(last))


def test_a_missing_or_foreign_sharded_directory_is_named(tmp_path):
    run(2, tmp_path / "w.pt", tmp_path / "r", **COMMON, **FSDP, data__batch_size=16, trainer__max_steps=2)
    ckpts = tmp_path / "r" / "checkpoints"
    record = fmt.sharded_record(load_checkpoint(ckpts / "last.pt", resolve_sharded=False))
    (ckpts / record["dir"] / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=f"{record['dir']}.*incomplete"):
        load_checkpoint(ckpts / "last.pt")


def test_prune_keeps_what_a_pt_file_names_and_never_reuses_a_directory(tmp_path):
    from visiontrain.engine.parallel.distributed import DistInfo
    from visiontrain.engine.state.checkpoint import atomic_save
    from visiontrain.engine.state.sharded import ShardedCheckpoints

    sharded = ShardedCheckpoints(tmp_path, DistInfo())
    for name in ("step-4.dcp", "step-8.dcp", "step-12.dcp", ".step-16.dcp.tmp"):  # the last: a crash mid-save
        (tmp_path / name).mkdir()
    for pt, named in (("last.pt", "step-12.dcp"), ("best.pt", "step-4.dcp")):
        atomic_save({fmt.FORMAT: fmt.FORMAT_VERSION, fmt.WEIGHTS: {fmt.SHARDED: {"dir": named}}}, tmp_path / pt)
    (tmp_path / "notes.pt").write_text("not a checkpoint")  # unreadable: ignored, not fatal
    sharded.prune()
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step-12.dcp", "step-4.dcp"]
    # a run resumed from before step 12 that reaches it again writes beside it, not over it
    assert sharded._free_name(12) == "step-12-1.dcp" and sharded._free_name(13) == "step-13.dcp"
