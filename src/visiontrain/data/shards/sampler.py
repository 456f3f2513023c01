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

Grouped by aspect ratio (a detector's ``task.group_aspect``: ``group_ids``), steps 2 and 3 change
within each stream: the process's samples are cut into ``streams`` runs of equal length, and each
stream walks its buffer-shuffled run, each sample joining its group's open batch, a batch given out
when full (as the map-style ``GroupedBatchSampler`` walks its permutation), until it has given its
quota. A run of L samples in G groups always fills ``(L - (G - 1) x (batch_size - 1)) // batch_size``
batches (each group leaves fewer than a batch), so that quota is the same every epoch, for every
stream of every process: an epoch's length is fixed and a resumed run counts the same batches. What a
stream walks past once it has its quota, and each group's leftovers, wait for another epoch
(``left_out_message``).
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
    """Batches of a split of shards in the order of this module's docstring; ``group_ids`` (one a
    sample, in the split's order): batches of one group each. The order depends on processes x
    workers (the streams), so a resume on another number of processes is refused."""

    follows_world_size = "none"

    def __init__(self, shard_sizes: list[int], batch_size: int, *, seed: int, buffer: int, streams: int,
                 rank: int = 0, world_size: int = 1, shuffle: bool = True, seeded: bool = True,
                 group_ids: list[int] | None = None) -> None:
        super().__init__(sum(shard_sizes), batch_size, seed=seed, shuffle=shuffle, rank=rank,
                         world_size=world_size, seeded=seeded)
        self.shard_sizes, self.buffer, self.streams = list(shard_sizes), int(buffer), max(1, int(streams))
        starts = torch.tensor([0, *self.shard_sizes]).cumsum(0)
        self.shard_starts = starts[:-1].tolist()
        self.group_ids = None if group_ids is None else torch.as_tensor(list(group_ids), dtype=torch.int64)
        self.quota: int | None = None  # grouped: the batches each stream gives an epoch
        if self.group_ids is not None:
            if len(self.group_ids) != self.num_samples:
                raise ValueError(f"{len(self.group_ids):,} aspect-ratio groups for {self.num_samples:,} samples")
            self.groups = int(torch.unique(self.group_ids).numel())
            # the most a run of run_length() samples always fills (module docstring)
            self.quota = max(0, (self.run_length() - (self.groups - 1) * (batch_size - 1)) // batch_size)
            self.batches_per_epoch = self.quota * self.streams
            if self.batches_per_epoch == 0:
                raise ValueError(f"the {self.num_samples} training samples are batched by orientation in each of "
                                 f"{world_size} x {self.streams} streams (process x data.num_workers) of "
                                 f"{self.run_length()} samples, which fill no batch of {batch_size} of one "
                                 f"orientation; lower data.batch_size or data.num_workers, or set "
                                 f"task.group_aspect=false")

    def order_state(self) -> dict[str, Any]:
        grouped = {} if self.quota is None else {"aspect_groups": self.groups}
        return {"order": "shards", "streams": self.streams, "shuffle_buffer": self.buffer, **grouped}

    def run_length(self) -> int:
        """Grouped: the samples each stream walks (the process's share cut in ``streams`` equal runs)."""
        return self.num_samples // self.world_size // self.streams

    @property
    def left_out_per_epoch(self) -> int:
        """Samples no batch of an epoch holds (which ones changes each epoch; how many does not)."""
        return self.num_samples - self.batches_per_epoch * self.batch_size * self.world_size

    def left_out_message(self) -> str:
        """One start-up line about the samples a grouped epoch leaves out (empty when ungrouped or none)."""
        if self.quota is None or not self.left_out_per_epoch:
            return ""
        streams = self.world_size * self.streams
        return (f"data.name=shards: batching {self.num_samples:,} training samples by orientation in {streams} "
                f"stream{'s' if streams > 1 else ''} (process x data.num_workers), {self.batches_per_epoch:,} "
                f"batches of {self.batch_size} a process, leaves {self.left_out_per_epoch:,} out of each epoch (each "
                f"stream's leftovers, other samples each epoch); task.group_aspect=false mixes orientations instead")

    def stream_lengths(self) -> list[int]:
        """Samples of each of this process's streams: the batches it hands that stream's worker
        (grouped: the run each stream walks)."""
        if self.quota is not None:
            return [self.run_length()] * self.streams
        return [len(range(w, self.batches_per_epoch, self.streams)) * self.batch_size for w in range(self.streams)]

    def indices(self, epoch: int) -> list[int]:
        """This process's samples of ``epoch``, batch after batch (module docstring)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        shards = torch.randperm(len(self.shard_sizes), generator=g).tolist() if self.shuffle else \
            list(range(len(self.shard_sizes)))
        order = [i for s in shards for i in range(self.shard_starts[s], self.shard_starts[s] + self.shard_sizes[s])]
        per_process = sum(self.stream_lengths())
        mine = order[self.rank * per_process:(self.rank + 1) * per_process]
        batches: list[list[list[int]]] = []
        start = 0
        for stream, length in enumerate(self.stream_lengths()):
            g.manual_seed(((self.seed * 1_000_003 + epoch) * 1_009 + self.rank) * 1_009 + stream)
            run = mine[start:start + length]
            start += length
            if self.shuffle:
                run = buffer_shuffle(run, self.buffer, g)
            batches.append(self._batches(run))
        return [i for b in range(self.batches_per_epoch) for i in batches[b % self.streams][b // self.streams]]

    def _batches(self, run: list[int]) -> list[list[int]]:
        """A stream's run cut into batches: in turn, or grouped, each sample joining its group's open
        batch, the first ``quota`` full batches in the order they fill."""
        size, quota = self.batch_size, self.quota
        if quota is None:
            return [run[i:i + size] for i in range(0, len(run), size)]
        open_batches: dict[int, list[int]] = {}
        full: list[list[int]] = []
        for sample, group in zip(run, self.group_ids[run].tolist()):
            batch = open_batches.setdefault(group, [])
            batch.append(sample)
            if len(batch) == size:
                full.append(open_batches.pop(group))
                if len(full) == quota:
                    break
        return full
