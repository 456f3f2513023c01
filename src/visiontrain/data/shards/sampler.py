"""The order a run reads shards in: whole shards in a shuffled order, each process's and each
worker's share a contiguous run of it, shuffled within a buffer of samples.

An epoch's order is a pure function of (seed, epoch), as the map-style sampler's is, so a resumed
run asks for exactly the batches the uninterrupted run read (``ResumableBatchSampler``):

1. the split's shards are permuted (seeded by seed and epoch) and their samples laid end to end;
2. the first ``world_size x batches x batch_size`` samples are cut into one contiguous range per
   process, and each process's range into one per stream; a stream is a DataLoader worker
   (``max(1, data.num_workers)`` of them). The fewer than ``world_size x batch_size`` samples left
   over are not read this epoch (other ones each epoch, as the map-style sampler's leftovers);
3. each stream's samples are shuffled by a buffer of ``data.shuffle_buffer`` samples (a sample is
   put in the buffer as it is read and a random one of the buffer taken out, as WebDataset's
   ``shuffle`` does), seeded by (seed, epoch, process, stream), and cut into batches;
4. the process's batch ``b`` is batch ``b // streams`` of stream ``b % streams``: DataLoader hands
   its workers batches in turn, so each worker reads its own stream front to back, through a few
   consecutive shards.

Every sample is read at most once an epoch and every process reads the same number of batches.
A run may only be resumed with the same number of processes, batch size, workers and buffer
(``order_state``), which the resume checks.
"""
from __future__ import annotations

from typing import Any

import torch

from visiontrain.data.samplers import ResumableBatchSampler


def buffer_shuffle(samples: list[int], buffer: int, generator: torch.Generator) -> list[int]:
    """``samples`` in the order a shuffle buffer of ``buffer`` samples gives them out."""
    if buffer <= 1 or len(samples) <= 1:
        return list(samples)
    draws = torch.rand(len(samples), generator=generator).tolist()
    held: list[int] = []
    out: list[int] = []
    for sample, draw in zip(samples, draws):
        if len(held) < buffer:
            held.append(sample)
            continue
        slot = int(draw * buffer)
        out.append(held[slot])
        held[slot] = sample
    tail = torch.randperm(len(held), generator=generator).tolist()
    return out + [held[i] for i in tail]


class ShardBatchSampler(ResumableBatchSampler):
    """Batches of a split of shards in the order of this module's docstring."""

    def __init__(self, shard_sizes: list[int], batch_size: int, *, seed: int, buffer: int, streams: int,
                 rank: int = 0, world_size: int = 1, shuffle: bool = True, seeded: bool = True) -> None:
        super().__init__(sum(shard_sizes), batch_size, seed=seed, shuffle=shuffle, rank=rank,
                         world_size=world_size, seeded=seeded)
        self.shard_sizes, self.buffer, self.streams = list(shard_sizes), int(buffer), max(1, int(streams))
        starts = torch.tensor([0, *self.shard_sizes]).cumsum(0)
        self.shard_starts = starts[:-1].tolist()

    def order_state(self) -> dict[str, Any]:
        return {"order": "shards", "streams": self.streams, "shuffle_buffer": self.buffer}

    def stream_lengths(self) -> list[int]:
        """Samples of each of this process's streams: the batches it hands that stream's worker."""
        return [len(range(w, self.batches_per_epoch, self.streams)) * self.batch_size for w in range(self.streams)]

    def indices(self, epoch: int) -> list[int]:
        """This process's samples of ``epoch``, batch after batch (module docstring)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        shards = torch.randperm(len(self.shard_sizes), generator=g).tolist() if self.shuffle else \
            list(range(len(self.shard_sizes)))
        order = [i for s in shards for i in range(self.shard_starts[s], self.shard_starts[s] + self.shard_sizes[s])]
        per_process = self.batches_per_epoch * self.batch_size
        mine = order[self.rank * per_process:(self.rank + 1) * per_process]
        batches: list[list[list[int]]] = []
        start = 0
        for stream, length in enumerate(self.stream_lengths()):
            g.manual_seed(((self.seed * 1_000_003 + epoch) * 1_009 + self.rank) * 1_009 + stream)
            run = mine[start:start + length]
            start += length
            if self.shuffle:
                run = buffer_shuffle(run, self.buffer, g)
            batches.append([run[i:i + self.batch_size] for i in range(0, length, self.batch_size)])
        return [i for b in range(self.batches_per_epoch) for i in batches[b % self.streams][b // self.streams]]
