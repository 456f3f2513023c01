"""The shards' canonical order (data/shards/sampler.py): every optimizer step trains on the same
samples on any number of processes that divides ``data.order_processes`` and with any number of
workers, across resumes through the source's state (the ledger of a run resumed on 1 -> 2 -> 3 -> 1
processes, against the straight run on one)."""
from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

from visiontrain.data.shards.sampler import ShardBatchSampler
from visiontrain.engine.step.source import LoaderSource

SIZES = [17, 9, 30, 12, 25, 8, 14, 21]   # samples a shard: 136, 11 global micro-batches of 12 an epoch
GLOBAL = 12


def sources(world: int, workers: int, order_processes: int | None = 6) -> list[LoaderSource]:
    """One rank's source per process of a run on ``world`` processes with ``workers`` streams."""
    out = []
    for rank in range(world):
        sampler = ShardBatchSampler(SIZES, GLOBAL // world, seed=3, buffer=5, streams=workers, rank=rank,
                                    world_size=world, order_processes=order_processes)
        out.append(LoaderSource(sampler, DataLoader(range(sum(SIZES)), batch_sampler=sampler)))
    return out


def steps(run: list[LoaderSource], epoch: int, first: int, last: int) -> list[list[int]]:
    """The global micro-batches ``first`` .. ``last - 1`` of ``epoch``: each the samples of every
    process's batch, as a set (the order inside a global batch is the processes')."""
    size = run[0].sampler.batch_size
    order = [source.sampler.indices(epoch) for source in run]
    return [sorted(i for o in order for i in o[k * size:(k + 1) * size]) for k in range(first, last)]


def test_a_run_resumed_on_one_two_three_one_processes_trains_the_straight_runs_steps():
    straight = sources(1, 2)
    epochs = {e: steps(straight, e, 0, straight[0].sampler.batches_per_epoch) for e in (0, 1)}
    assert len(epochs[0]) == 136 // GLOBAL
    for e, batches in epochs.items():  # every sample at most once an epoch, the leftovers other ones each epoch
        flat = [i for b in batches for i in b]
        assert len(flat) == len(set(flat)) == 11 * GLOBAL
    assert epochs[0] != epochs[1]
    # killed at (epoch, step) and resumed on the next number of processes, with another number of workers
    # the first segment is the same fresh run (data.order_processes=6, two workers); killed at
    # (epoch, step) and resumed on the next number of processes, with another number of workers and
    # the config's default order_processes (null): a resume reads the order the checkpoint was written with
    chain = [(1, 2, 6, (0, 0), (0, 4)), (2, 3, None, (0, 4), (1, 2)), (3, 1, None, (1, 2), (1, 9)),
             (1, 4, None, (1, 9), (1, 11))]
    state = None
    for world, workers, order, (e0, k0), (e1, k1) in chain:
        run = sources(world, workers, order_processes=order)
        if state is not None:
            for source in run:
                source.load_state_dict(state)
        got = [b for e in range(e0, e1 + 1) for b in steps(run, e, k0 if e == e0 else 0, k1 if e == e1 else 11)]
        want = [b for e in range(e0, e1 + 1) for b in epochs[e][(k0 if e == e0 else 0):(k1 if e == e1 else 11)]]
        assert got == want, (world, workers)
        state = run[0].state_dict()
    assert state["order_processes"] == 6 and state["streams"] == 2  # the order as the first run cut it


def test_a_resume_on_processes_that_do_not_divide_the_order_is_refused_in_one_line():
    state = sources(2, 1)[0].state_dict()
    (one,) = sources(1, 1, order_processes=None)
    one.load_state_dict(state)  # 1 divides 6
    sampler = ShardBatchSampler(SIZES, 3, seed=3, buffer=5, streams=1, rank=0, world_size=4)
    with pytest.raises(ValueError, match=r"the shards' order is cut for 6 process\(es\) \(data.order_processes\): "
                                         r"4 process\(es\) must divide it"):
        LoaderSource(sampler, DataLoader(range(sum(SIZES)), batch_sampler=sampler)).load_state_dict(state)


def test_grouped_shards_keep_their_processes():
    with pytest.raises(ValueError, match="data.order_processes=4: batches grouped by aspect ratio"):
        ShardBatchSampler(SIZES, 3, seed=0, buffer=5, streams=1, world_size=2, order_processes=4,
                          group_ids=[i % 2 for i in range(sum(SIZES))])
