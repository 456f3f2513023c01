"""The resumable batch sampler and the dataset wrapper that makes augmentation reproducible.

Exact mid-epoch resume, also on another number of processes, needs two things from the data side:
1. the order of batches is a pure function of (seed, epoch): a permutation from a generator seeded
   with both, split into this rank's shard, cut into batches; resuming at batch k just starts the
   same list at k. The shards are strided, so the batches of one step over every rank are one
   contiguous piece of the epoch's permutation, the same piece on 1, 2 or 3 processes as long as the
   global batch (batch size x processes x accumulation) is the same;
2. the random augmentation of a sample depends on nothing but the sample and the epoch: not on the
   worker process that loads it, what that worker loaded before, the batch it lands in or the rank
   that trains it. Each sample carries a seed derived from (seed, epoch, sample index);
   ``SeededDataset`` seeds torch's RNG with it while it loads that sample and restores the RNG
   after, so sample i gets the same crop in epoch e in an uninterrupted run and after a resume, with
   0 or 8 workers, on one process or three.
"""
from __future__ import annotations

import math
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads nearby (seed, epoch, index) apart


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample ``index``'s random transforms in ``epoch`` of a run seeded ``seed``."""
    return ((seed * _MIX + epoch) * _MIX + index) % (2**63 - 1)


def follows_split(follows: str, written: tuple[int, int, int], now: tuple[int, int, int],
                  order_processes: int | None = None) -> bool:
    """Whether a sampler whose ``follows_world_size`` is ``follows`` gives each optimizer step the
    samples it gave under the split ``written`` also under ``now``, each a (per-process batch,
    processes, micro-batches a step): ``any`` where the global batch is the same, ``accumulation``
    where the per-process batch is the same too, ``canonical`` (shards, their order cut for
    ``order_processes``) where the accumulation and the global micro-batch are the same and the
    processes divide ``order_processes``, ``none`` only where nothing changed."""
    if written == now:
        return True
    same_global = math.prod(written) == math.prod(now)
    if follows == "canonical":
        return same_global and written[2] == now[2] and bool(order_processes) and order_processes % now[1] == 0
    return follows == "any" and same_global or follows == "accumulation" and same_global and written[0] == now[0]


def seed_coins(seeds: Sequence[int]) -> torch.Tensor:
    """A fair coin for each seed (bool [n]), a pure function of it: the top bit of splitmix64's
    finaliser, for a dataset that draws one coin a sample for a whole batch at once (a flip)
    without making a generator for each."""
    with np.errstate(over="ignore"):
        z = np.asarray(seeds, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return torch.from_numpy((z >> np.uint64(63)).astype(bool))


#: The same mixing of (seed, epoch, batch position): how a batch was seeded before samples were,
#: kept for the runs those versions wrote (``BatchSeeded``).
batch_seed = sample_seed


class BatchSeeded(list):
    """A batch's keys as versions before per-sample seeds made them: every sample carries the
    batch's seed, and ``SeededDataset`` seeds torch's RNG once for the whole batch. A run resumed
    from a checkpoint of those versions goes on this way (``seeding`` in the source's state), so
    that it stays the run it was."""


class ResumableBatchSampler(Sampler[list]):
    """Shuffled (or ordered), sharded, drop-last batches that can start at any batch of an epoch.

    Yields lists of ``(index, sample_seed)`` pairs that ``SeededDataset`` unpacks, or plain index
    lists when ``seeded=False`` (a dataset without random transforms needs no seed).

    ``follows_world_size`` says what a resume on another number of processes may change while the
    samples of each optimizer step stay the same (``engine.setup.global_batch``): ``any`` (the
    per-process batch and the accumulation), ``accumulation`` (only it) or ``none``.
    """

    follows_world_size = "any"
    seeding = "sample"  # "batch": a run a version before per-sample seeds wrote (BatchSeeded)

    def __init__(self, num_samples: int, batch_size: int, *, seed: int, shuffle: bool = True,
                 drop_last: bool = True, rank: int = 0, world_size: int = 1, seeded: bool = True) -> None:
        if num_samples <= 0:
            raise ValueError("the dataset is empty: no samples to train on")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.rank, self.world_size = rank, world_size
        self.epoch, self.start_batch = 0, 0
        self.seeded = seeded  # False: plain index lists (no random transforms to seed)
        per_rank = num_samples // world_size  # equal shards: every rank runs the same step count
        self.batches_per_epoch = per_rank // batch_size if drop_last else -(-per_rank // batch_size)
        if self.batches_per_epoch == 0:
            raise ValueError(f"{num_samples} samples over {world_size} process(es) do not fill one "
                             f"batch of {batch_size} (lower data.batch_size)")

    def order_state(self) -> dict[str, Any]:
        """What the order of an epoch depends on besides the seed, the batch size and the number of
        processes (which every checkpoint holds): a resume refuses a run where it differs."""
        return {}

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch's permutation; start at batch ``start_batch`` (mid-epoch resume)."""
        self.epoch, self.start_batch = epoch, start_batch

    def indices(self, epoch: int) -> list[int]:
        """This rank's sample order for an epoch (disjoint across ranks)."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(self.num_samples, generator=g)
        else:
            order = torch.arange(self.num_samples)
        # Strided shards (like DistributedSampler): batch b of every rank together are exactly the
        # samples of batch b of one process with a world_size-times larger batch.
        per_rank = self.num_samples // self.world_size
        return order[self.rank:per_rank * self.world_size:self.world_size].tolist()

    def __iter__(self) -> Iterator[list]:
        order, size = self.indices(self.epoch), self.batch_size
        for b in range(self.start_batch, self.batches_per_epoch):
            yield self.keys(order[b * size:(b + 1) * size], b)

    def keys(self, batch: list[int], position: int) -> list:
        """What the loader is given for batch ``position`` of the epoch: each index with its sample's
        seed, or the indices."""
        if not self.seeded:
            return batch
        if self.seeding == "batch":
            return BatchSeeded((i, batch_seed(self.seed, self.epoch, position)) for i in batch)
        return [(i, sample_seed(self.seed, self.epoch, i)) for i in batch]

    def __len__(self) -> int:
        return self.batches_per_epoch - self.start_batch


class GroupedBatchSampler(ResumableBatchSampler):
    """Batches whose samples share a group (e.g. aspect ratio < 1 or >= 1), so padding is small.

    The epoch's permutation is walked in order, each index joining its group's open batch; a batch
    is emitted when full (seamseg / torchvision's references). Group sizes are fixed, so the number
    of batches per epoch is too (leftovers of each group are dropped; other samples each epoch).
    Ranks take every world_size-th batch. Resume and seeding work as in the parent. The batches are
    cut at the per-process batch size, so a resume on another number of processes keeps it and
    changes the accumulation instead.
    """

    follows_world_size = "accumulation"

    def __init__(self, group_ids: list[int], batch_size: int, *, seed: int, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1, seeded: bool = True) -> None:
        self.group_ids = torch.as_tensor(list(group_ids), dtype=torch.int64)  # one tensor: batches() indexes it
        self.num_samples, self.batch_size = len(self.group_ids), batch_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, True
        self.rank, self.world_size, self.seeded = rank, world_size, seeded
        self.epoch, self.start_batch = 0, 0
        if self.num_samples == 0:
            raise ValueError("the dataset is empty: no samples to train on")
        groups, sizes = torch.unique(self.group_ids, return_counts=True)  # sorted by group id
        self.group_counts = counts = dict(zip(groups.tolist(), sizes.tolist()))
        self.batches_per_epoch = sum(n // batch_size for n in counts.values()) // world_size
        if self.batches_per_epoch == 0:
            full = sum(n // batch_size for n in counts.values())
            short = f"no orientation has enough images for one batch of {batch_size}" if full == 0 else \
                f"they fill only {full} batch(es) of {batch_size}, fewer than one for each of {world_size} processes"
            raise ValueError(
                f"the {self.num_samples} training images are batched by orientation ({self._describe()}), "
                f"so that the images of a batch need little padding, and {short}. Lower data.batch_size, "
                f"or set task.group_aspect=false to batch images of any orientation together")

    def _describe(self) -> str:
        """The group sizes in words: group 1 is aspect ratio (width/height) >= 1, 0 is < 1."""
        names = {0: "portrait", 1: "landscape or square"}
        return ", ".join(f"{n} {names.get(g, f'group {g}')}" for g, n in self.group_counts.items())

    @property
    def left_out_per_epoch(self) -> int:
        """Images no batch of an epoch holds: each group's leftovers (fewer than a batch), and on
        several processes the full batches that do not divide among them. Which images they are
        changes from epoch to epoch; how many does not."""
        return self.num_samples - self.batches_per_epoch * self.batch_size * self.world_size

    def left_out_message(self) -> str:
        """One start-up line about the images each epoch leaves out (empty when none)."""
        left = self.left_out_per_epoch
        if not left:
            return ""
        return (f"batching {self.num_samples} training images by orientation "
                f"({self._describe()}) in batches of {self.batch_size} leaves {left} out of each epoch "
                f"(the leftovers of each orientation, other images each epoch); task.group_aspect=false "
                f"mixes orientations in a batch instead")

    def batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of an epoch, in order (a pure function of seed and epoch).

        The walk of the module docstring, done with tensors (a resumed run positions itself in one
        epoch's permutation, not in a Python loop over a million samples): the k-th sample of a group
        in the epoch's order joins that group's batch k // batch_size, and a batch is emitted where
        its last sample comes, so sorting the full batches by that position gives the walk's order."""
        if self.shuffle:
            order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(
                self.seed * 1_000_003 + epoch))
        else:
            order = torch.arange(self.num_samples)
        groups, size = self.group_ids.index_select(0, order), self.batch_size
        members, emitted_at = [], []
        for group in self.group_counts:
            positions = (groups == group).nonzero().flatten()
            full = len(positions) // size * size  # a group's leftovers never fill a batch
            members.append(order.index_select(0, positions[:full]).view(-1, size))
            emitted_at.append(positions[size - 1:full:size])
        walk_order = torch.cat(emitted_at).argsort()
        mine = walk_order[self.rank::self.world_size][: self.batches_per_epoch]
        return torch.cat(members).index_select(0, mine).tolist()

    def __iter__(self) -> Iterator[list]:
        for b, batch in enumerate(self.batches(self.epoch)[self.start_batch:], start=self.start_batch):
            yield self.keys(batch, b)


class SeededDataset(Dataset):
    """Loads a batch of ``(index, seed)`` keys, each sample with torch's RNG seeded by its own seed.

    Only datasets with random transforms are wrapped (see ``ResumableBatchSampler.seeded``). A
    dataset that draws for several samples at once, for speed, offers ``seeded_items(indices,
    seeds)``: it must draw sample k's parameters from ``seeds[k]`` alone. Any other dataset is
    loaded one sample at a time (``dataset[i]``) after seeding torch's RNG.
    """

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset
        self._batched = hasattr(dataset, "__getitems__")

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def _load(self, indices: list[int]) -> list[Any]:
        if self._batched:
            return self.dataset.__getitems__(indices)  # type: ignore[attr-defined]
        return [self.dataset[i] for i in indices]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        seeded_items = getattr(self.dataset, "seeded_items", None)
        with torch.random.fork_rng(devices=[]):
            if isinstance(keys, BatchSeeded):
                torch.random.default_generator.manual_seed(keys[0][1])
                return self._load([k[0] for k in keys])
            if seeded_items is not None:
                return seeded_items([k[0] for k in keys], [k[1] for k in keys])
            items = []
            for index, seed in keys:
                torch.random.default_generator.manual_seed(seed)
                items.append(self.dataset[index])
            return items

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__([key])[0]
