"""Two processes on CPU (gloo, torchrun): the same weights as one process with the global batch, under
DDP and FSDP, with gradient accumulation (non-final micro-steps skip the all-reduce), and only rank 0
writes (with BatchNorm they differ: tests/engine/test_ddp_replicas.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from toy_ranks import first_loss, run


def test_two_ranks_equal_one_process_with_twice_the_batch(tmp_path):
    """docs/distributed.md's condition, under DDP and FSDP: rank r's batch b is every world_size-th
    sample of one process's batch b of twice the size, and the gradients are averaged, so without a
    batch-dependent layer the weights are the same; with accumulation (non-final micro-steps skip the
    all-reduce). Only rank 0 writes."""
    common = {"trainer__epochs": 2, "optim__name": "adamw", "optim__lr": 0.01, "trainer__accum_steps": 2,
              "checkpoint__every": 1, "trainer__log_every": 1, "trainer__plots": True}  # rank 0 draws them
    run(1, tmp_path / "single.pt", tmp_path / "single", data__batch_size=32, **common)
    one = torch.load(tmp_path / "single.pt")["model"]
    for strategy in ("ddp", "fsdp"):
        run(2, tmp_path / f"{strategy}.pt", tmp_path / strategy, data__batch_size=16,
            distributed__strategy=strategy, **common)
        two = torch.load(tmp_path / f"{strategy}.pt")["model"]
        weights = max((two[k].float() - one[k].float()).abs().max().item() for k in one)
        loss = abs(first_loss(tmp_path / strategy) / first_loss(tmp_path / "single") - 1)  # relative
        # Float rounding only (two partial sums of 16 for one of 32). Measured on an AMD EPYC under
        # ATEN_CPU_CAPABILITY=avx2 and =default: the first loss 0 and 1.2e-7 relative, the weights after
        # 16 AdamW steps 3.0e-8 and 6.0e-8 (and on an AVX-512 Xeon, after 3 steps: 9.7e-8 and 3.0e-8).
        # About ten times the largest.
        assert loss < 1.5e-6 and weights < 6e-7, (strategy, loss, weights)
    # only rank 0 wrote: one metrics file, no stray per-rank files
    files = sorted(p.relative_to(tmp_path / "ddp").as_posix() for p in (tmp_path / "ddp").rglob("*")
                   if p.is_file() and "tb/" not in p.as_posix())
    assert files == ["checkpoints/best.pt", "checkpoints/last.pt", "config.yaml", "metrics.jsonl",
                     "model.safetensors", "model_summary.json", "plots/eval.png", "plots/losses.png", "plots/schedules.png",
                     "plots/throughput.png", "provenance.json", "summary.json"]


@pytest.mark.parametrize("world", [2, 3])
def test_shards_are_disjoint_cover_the_data_and_depend_on_seed_and_epoch(world):
    from visiontrain.data.samplers import ResumableBatchSampler

    n, batch = 103, 4

    def epoch_batches(rank: int, epoch: int, seed: int = 7, start: int = 0) -> list[list[int]]:
        s = ResumableBatchSampler(n, batch, seed=seed, rank=rank, world_size=world, seeded=False)
        s.set_epoch(epoch, start_batch=start)
        return list(s)

    shards = [[i for b in epoch_batches(r, 1) for i in b] for r in range(world)]
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat))                      # disjoint
    assert len(flat) == (n // world // batch) * batch * world and len(flat) > n - world * batch  # all but the remainder
    assert len({len(s) for s in shards}) == 1               # the same step count on every rank
    assert shards[0] == [i for b in epoch_batches(0, 1) for i in b]           # a function of (seed, epoch)
    assert shards[0] != [i for b in epoch_batches(0, 2) for i in b]
    assert shards[0] != [i for b in epoch_batches(0, 1, seed=8) for i in b]
    assert epoch_batches(1, 1, start=3) == epoch_batches(1, 1)[3:]             # mid-epoch resume


def test_ddp_searches_unused_parameters_only_when_the_task_asks(monkeypatch):
    from toy_task import ToyTask, toy_config
    from visiontrain.engine.setup import placement
    from visiontrain.engine.loop import trainer as trainer_module

    seen = []
    monkeypatch.setattr(placement, "wrap_ddp", lambda model, *a, **kw: seen.append(kw) or model)
    cfg = toy_config()
    trainer_module.Trainer(cfg, ToyTask(cfg), None)
    task = ToyTask(cfg)
    task.find_unused_parameters = True
    trainer_module.Trainer(cfg, task, None)
    assert [kw["find_unused_parameters"] for kw in seen] == [False, True]


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_evaluation_counts_every_sample_once(world):
    """The eval sampler pads the set so that every rank runs as many batches (FSDP's forwards are
    collectives); the padding repeats must not be counted. Each rank's shard evaluated on its own
    (the all-reduce sums them): the confusion counts add up to the set, and top-1 to one process's."""
    from visiontrain.core.config import load_config
    from visiontrain.engine.setup.loaders import eval_loader
    from visiontrain.engine.parallel.distributed import DistInfo, real_samples
    from visiontrain.engine.step.eval_loop import EvalData
    from visiontrain.tasks import build_task

    cfg = load_config("classify-fashion", ["data.name=digits", "data.limit_val=101", "data.eval_batch_size=16"])
    task = build_task(cfg)
    data = task.build_data()
    model = task.build_model(data.info).eval()
    n = len(data.val)
    assert n == 101 and n % world  # the padding case

    def evaluate(info: DistInfo) -> tuple[torch.Tensor, int | None]:
        loader = eval_loader(data.val, 16, collate=data.eval_collate, dist_info=info)  # in this process
        with torch.no_grad():  # one shard at a time in one process: no all-reduce (EvalData.local)
            task.evaluate(model, EvalData.local(loader))
        return task.confusion.clone(), real_samples(loader)

    whole, real = evaluate(DistInfo())
    assert real is None and int(whole.sum()) == n
    shards = [evaluate(DistInfo(rank, world, rank)) for rank in range(world)]
    assert sum(r for _, r in shards) == n
    assert torch.equal(sum(c for c, _ in shards), whole)


def test_fit_nproc_leaves_no_log_dir_of_torchrun_behind(monkeypatch, tmp_path):
    """torchrun's default log dir (a /tmp/torchelastic_* a launch) is never removed; `fit --nproc` gives
    it one that goes when the agent returns or raises. Its agent is replaced here by one that writes a
    rank's error file there and fails, as a failed rank ends it."""
    import argparse
    import tempfile

    import torch.distributed.run as torchrun
    from visiontrain.app import launch
    from visiontrain.core.process_tree import LAUNCHER_PID_ENV

    seen = {}

    def agent(parsed: argparse.Namespace) -> None:  # torchrun's run(), as run_torchrun calls it
        logs = Path(parsed.log_dir)
        (logs / "attempt_0").mkdir()
        (logs / "attempt_0" / "error.json").write_text("{}")
        seen["logs"] = logs
        raise RuntimeError("a rank failed")

    monkeypatch.setattr(torchrun, "run", agent)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    for key in (launch.COMMAND_ENV, LAUNCHER_PID_ENV):  # run_torchrun sets them for the ranks
        monkeypatch.setenv(key, "")
    args = argparse.Namespace(imports=[], recipe="classify-fashion", overrides=[], run_dir=None, resume=None,
                              init=None, nproc=2, command_line="visiontrain fit classify-fashion --nproc 2")
    with pytest.raises(RuntimeError, match="a rank failed"):
        launch.run_torchrun(args)
    assert seen["logs"].parent == tmp_path and not list(tmp_path.iterdir())
