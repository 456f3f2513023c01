"""Where a resumed run's sampler starts: the batches of a replay, found without one (the time it takes is
benchmarks/scale/resume_position.py's, not a test's)."""
from __future__ import annotations

import pytest
import torch

from visiontrain.data.samplers import GroupedBatchSampler, ResumableBatchSampler


def walked_batches(sampler: GroupedBatchSampler, epoch: int) -> list[list[int]]:
    """The grouped batches as the sampler used to make them: each index of the epoch's order joins
    its group's open batch, a batch is emitted when full. The reference the tensor form must equal."""
    group_ids = [int(g) for g in sampler.group_ids]
    if sampler.shuffle:
        order = torch.randperm(sampler.num_samples, generator=torch.Generator().manual_seed(
            sampler.seed * 1_000_003 + epoch)).tolist()
    else:
        order = list(range(sampler.num_samples))
    open_batches: dict[int, list[int]] = {}
    full: list[list[int]] = []
    for i in order:
        batch = open_batches.setdefault(group_ids[i], [])
        batch.append(i)
        if len(batch) == sampler.batch_size:
            full.append(batch)
            open_batches[group_ids[i]] = []
    return full[sampler.rank::sampler.world_size][: sampler.batches_per_epoch]


# two orientations, several groups of odd ids, one group alone, a group too small for a batch
GROUPINGS = [[0, 1] * 20 + [1] * 7, [2, 0, 0, 5, 1, 0, 2, 2, 5, 0] * 9, [1] * 33, [0] * 1 + [1] * 41]


@pytest.mark.parametrize("groups", GROUPINGS)
@pytest.mark.parametrize("shuffle", [True, False])
def test_grouped_batches_are_the_walks_batches(groups: list[int], shuffle: bool) -> None:
    for world_size in (1, 2, 3):
        for rank in range(world_size):
            for batch_size in (2, 4):
                sampler = GroupedBatchSampler(groups, batch_size, seed=11, shuffle=shuffle, rank=rank,
                                              world_size=world_size, seeded=False)
                for epoch in range(4):
                    assert sampler.batches(epoch) == walked_batches(sampler, epoch), (world_size, rank, batch_size)


def replayed(sampler: ResumableBatchSampler, epoch: int, start_batch: int) -> list:
    """The batches an uninterrupted run trains on from (epoch, start_batch) to the epoch's end: every
    epoch before it and the batches of this one before ``start_batch`` iterated and passed over."""
    for e in range(epoch):
        sampler.set_epoch(e)
        list(sampler)
    sampler.set_epoch(epoch)
    return list(sampler)[start_batch:]


@pytest.mark.parametrize("make", [
    lambda rank: ResumableBatchSampler(103, 4, seed=5, rank=rank, world_size=3),
    lambda rank: GroupedBatchSampler([0, 1, 1] * 34 + [0], 4, seed=5, rank=rank, world_size=3),
])
def test_a_positioned_sampler_yields_what_a_replay_yields(make) -> None:
    for rank in range(3):
        for epoch, start_batch in [(0, 0), (0, 5), (3, 1), (6, 0), (6, 7)]:
            positioned = make(rank)
            positioned.set_epoch(epoch, start_batch=start_batch)
            assert list(positioned) == replayed(make(rank), epoch, start_batch), (rank, epoch, start_batch)
