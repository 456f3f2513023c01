"""visiontrain.engine.step.eval_loop.EvalData: batches on the device, the sampler's padding cut, ranks combined."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from visiontrain.engine.parallel.distributed import DistInfo
from visiontrain.engine.step.eval_loop import EvalData


class MovedTo(torch.Tensor):
    """Records the device a tensor was moved to, so a CPU-only test sees the move (non_blocking)."""

    moves: list[tuple[str, bool]] = []

    def to(self, *args, **kwargs):
        MovedTo.moves.append((str(args[0]), kwargs.get("non_blocking", False)))
        return super().to(*args, **kwargs)


def test_batches_are_moved_nested_and_channels_last_applied_to_images():
    images = torch.randn(2, 3, 4, 5).as_subclass(MovedTo)
    batch = (images, torch.zeros(2, 4, 5, dtype=torch.bool),
             [{"boxes": torch.zeros(1, 4), "image_id": 7}, {"boxes": torch.zeros(0, 4), "image_id": 8}])
    MovedTo.moves.clear()
    ((x, mask, targets), real), = list(EvalData.local([batch], channels_last=True))
    assert MovedTo.moves == [("cpu", True)]  # moved with non_blocking
    assert x.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous(
        memory_format=torch.channels_last)
    assert mask.shape == (2, 4, 5) and targets[0]["image_id"] == 7 and targets[1]["boxes"].shape == (0, 4)
    assert real == slice(None)  # not sharded: every sample is real
    ((plain, _, _), _), = list(EvalData.local([batch]))
    assert plain.is_contiguous() and not plain.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("world", [2, 3])
def test_the_sampler_padding_is_cut_from_each_rank_and_every_sample_counted_once(world):
    """7 samples over 2 or 3 ranks, batches of 2: the sampler repeats the first ones so every rank
    runs as many batches; the real slices keep each sample exactly once over all ranks, and a
    batch that is only padding still comes (its forward must run under FSDP), with nothing real."""
    n = 7
    ds = TensorDataset(torch.arange(n), torch.arange(n) * 10)
    kept, batches_per_rank = [], set()
    for rank in range(world):
        loader = DataLoader(ds, batch_size=2, sampler=DistributedSampler(ds, world, rank, shuffle=False))
        batches = list(EvalData.local(loader))
        batches_per_rank.add(len(batches))
        for (index, value), real in batches:
            assert torch.equal(value, index * 10)
            kept += index[real].tolist()
    assert len(batches_per_rank) == 1
    assert sorted(kept) == list(range(n))


def test_an_all_padding_last_batch_is_yielded_with_an_empty_real_slice():
    ds = TensorDataset(torch.arange(3))  # 2 ranks: rank 1 gets [1, 0(repeat)]; batches of 1
    loader = DataLoader(ds, batch_size=1, sampler=DistributedSampler(ds, 2, 1, shuffle=False))
    got = [(batch[0].tolist(), batch[0][real].tolist()) for batch, real in EvalData.local(loader)]
    assert got == [([1], [1]), ([0], [])]


def test_single_process_reductions_are_identities():
    data = EvalData.local([])
    t = torch.tensor([1.0, 2.0])
    data.sum_(t)
    assert t.tolist() == [1.0, 2.0]
    assert data.gather_rows(t) is t
    items = [{"image_id": 1}]
    assert data.gather(items) is items and data.gather(items, dst=0) is items
    assert data.over([(1,)]).loader == [(1,)] and data.over([]).device == torch.device("cpu")


def _ranks_worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    data = EvalData([], torch.device("cpu"), DistInfo(rank, 2, rank), channels_last=False)
    counts = torch.tensor([rank + 1.0, 10.0])
    data.sum_(counts)
    rows = data.gather_rows(torch.full((rank + 1, 2), float(rank)))  # 1 row on rank 0, 2 on rank 1
    out = {"sum": counts.tolist(), "rows": rows.tolist(), "all": data.gather([f"r{rank}a", f"r{rank}b"]),
           "dst0": data.gather([rank], dst=0)}
    (Path(out_dir) / f"{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_reductions_over_two_ranks(tmp_path):
    mp.spawn(_ranks_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    assert r0["sum"] == r1["sum"] == [3.0, 20.0]
    assert r0["rows"] == r1["rows"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
    assert r0["all"] == r1["all"] == ["r0a", "r0b", "r1a", "r1b"]
    assert r0["dst0"] == [0, 1] and r1["dst0"] is None
