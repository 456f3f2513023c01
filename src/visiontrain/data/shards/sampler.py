"""The order a run reads shards in: whole shards in a shuffled order, cut into canonical streams
read front to back, each shuffled within a buffer of samples, so that every optimizer step trains
on the same samples whatever the number of processes and DataLoader workers a resume runs on.

An epoch's order is a pure function of (seed, epoch) and of two numbers fixed when the run starts
and kept in its checkpoints: ``G`` canonical processes (``data.order_processes``, default the run's
number of processes) and ``R`` canonical workers (the first run's ``max(1, data.num_workers)``):

1. the split's shards are permuted (seeded by seed and epoch) and their samples laid end to end;
2. an epoch has ``steps = samples // global micro-batch`` micro-steps (a global micro-batch is
   ``processes x data.batch_size``, the same on any number of processes); the first ``steps x
   global micro-batch`` samples are cut into ``G x R`` contiguous canonical streams, stream (m, q)
   holding what canonical process m's worker q reads: ``len(range(q, steps, R))`` chunks of
   ``global micro-batch / G`` samples. The fewer than a global micro-batch of samples left over are
   not read this epoch (other ones each epoch);
3. each canonical stream is shuffled by a buffer of ``data.shuffle_buffer`` samples (a sample is put
   in the buffer as it is read and a random one of the buffer taken out, as WebDataset's
   ``shuffle`` does), seeded by (seed, epoch, m, q), and cut into its chunks;
4. micro-step ``k`` trains on chunk ``k // R`` of the streams (m, k % R) of every m: the global
   micro-batch is those G chunks whatever the processes. On ``W`` processes (``W`` divides ``G``)
   process ``r`` takes the chunks of the canonical processes ``r x G/W ... (r+1) x G/W - 1``, in
   that order. DataLoader hands its workers batches in turn, so with ``R`` workers each reads its own
   canonical streams front to back, through a few consecutive shards; with another number it reads
   the same batches (a batch is the same whichever worker loads it), touching more shards at once.

A run written with ``G`` canonical processes resumes exactly on any number of processes that
divides ``G`` (with the accumulation unchanged and the per-process batch that keeps the global
micro-batch: ``engine.setup.global_batch`` plans it), and with any number of workers. Runs from
before the canonical order read it with ``G`` = their number of processes, which is the order they
had. Every sample is read at most once an epoch and every process reads the same number of batches.

Grouped by aspect ratio (a detector's ``task.group_aspect``: ``group_ids``), ``G`` is the run's
number of processes and steps 2 and 3 change within each stream: the process's samples are cut into
``R`` runs of equal length, and each stream walks its buffer-shuffled run, each sample joining its
group's open batch, a batch given out when full (as the map-style ``GroupedBatchSampler`` walks its
permutation), until it has given its quota. A run of L samples in G groups always fills ``(L - (G -
1) x (batch_size - 1)) // batch_size`` batches (each group leaves fewer than a batch), so that quota
is the same every epoch, for every stream of every process: an epoch's length is fixed and a
resumed run counts the same batches. What a stream walks past once it has its quota, and each
group's leftovers, wait for another epoch (``left_out_message``). A grouped run resumes on its own
number of processes only.
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
    sample, in the split's order): batches of one group each. ``streams``: the canonical workers of a
    new run (``R``); ``order_processes``: its canonical processes (``G``; None: ``world_size``). A
    resume takes both from the checkpoint (:meth:`adopt_order`)."""

    follows_world_size = "canonical"

    def __init__(self, shard_sizes: list[int], batch_size: int, *, seed: int, buffer: int, streams: int,
                 rank: int = 0, world_size: int = 1, shuffle: bool = True, seeded: bool = True,
                 group_ids: list[int] | None = None, order_processes: int | None = None) -> None:
        super().__init__(sum(shard_sizes), batch_size, seed=seed, shuffle=shuffle, rank=rank,
                         world_size=world_size, seeded=seeded)
        self.shard_sizes, self.buffer = list(shard_sizes), int(buffer)
        starts = torch.tensor([0, *self.shard_sizes]).cumsum(0)
        self.shard_starts = starts[:-1].tolist()
        self.group_ids = None if group_ids is None else torch.as_tensor(list(group_ids), dtype=torch.int64)
        if self.group_ids is not None:
            if len(self.group_ids) != self.num_samples:
                raise ValueError(f"{len(self.group_ids):,} aspect-ratio groups for {self.num_samples:,} samples")
            if order_processes not in (None, world_size):
                raise ValueError(f"data.order_processes={order_processes}: batches grouped by aspect ratio are cut "
                                 f"for this run's {world_size} process(es); set task.group_aspect=false to cut the "
                                 f"order for another number")
            self.follows_world_size = "none"  # a group's batches are cut per process
            self.groups = int(torch.unique(self.group_ids).numel())
        self.quota: int | None = None  # grouped: the batches each stream gives an epoch
        self._set_order(order_processes or world_size, max(1, int(streams)))

    def _set_order(self, processes: int, streams: int) -> None:
        """The canonical processes (G) and workers (R) the epoch's order is cut for."""
        micro = self.world_size * self.batch_size  # the global micro-batch
        if processes % self.world_size or micro % processes:
            raise ValueError(f"the shards' order is cut for {processes} process(es) (data.order_processes): "
                             f"{self.world_size} process(es) must divide it, and it must divide the global "
                             f"micro-batch of {micro} samples (data.batch_size x processes)")
        self.order_processes, self.streams, self.chunk = processes, streams, micro // processes
        if self.group_ids is not None:
            # the most a run of run_length() samples always fills (module docstring)
            self.quota = max(0, (self.run_length() - (self.groups - 1) * (self.batch_size - 1)) // self.batch_size)
            self.batches_per_epoch = self.quota * self.streams
            if self.batches_per_epoch == 0:
                raise ValueError(f"the {self.num_samples} training samples are batched by orientation in each of "
                                 f"{self.world_size} x {self.streams} streams (process x data.num_workers) of "
                                 f"{self.run_length()} samples, which fill no batch of {self.batch_size} of one "
                                 f"orientation; lower data.batch_size or data.num_workers, or set "
                                 f"task.group_aspect=false")

    def order_state(self) -> dict[str, Any]:
        grouped = {} if self.quota is None else {"aspect_groups": self.groups}
        return {"order": "shards", "streams": self.streams, "order_processes": self.order_processes,
                "shuffle_buffer": self.buffer, **grouped}

    def adopt_order(self, state: dict[str, Any]) -> None:
        """A resume reads the checkpoint's order: its canonical processes and workers (a checkpoint
        from before ``order_processes`` was recorded: its own number of processes)."""
        processes = int(state.get("order_processes") or state.get("world_size") or 1)
        self._set_order(processes, int(state.get("streams") or self.streams))

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

    def stream_length(self, worker: int) -> int:
        """Samples of canonical stream (m, ``worker``), the same for every m: its chunks (grouped: the
        run it walks)."""
        if self.quota is not None:
            return self.run_length()
        return len(range(worker, self.batches_per_epoch, self.streams)) * self.chunk

    def indices(self, epoch: int) -> list[int]:
        """This process's samples of ``epoch``, batch after batch (module docstring)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        shards = torch.randperm(len(self.shard_sizes), generator=g).tolist() if self.shuffle else \
            list(range(len(self.shard_sizes)))
        order = [i for s in shards for i in range(self.shard_starts[s], self.shard_starts[s] + self.shard_sizes[s])]
        share = self.order_processes // self.world_size
        mine = range(self.rank * share, (self.rank + 1) * share)  # this process's canonical processes
        chunks: dict[tuple[int, int], list[list[int]]] = {}
        start = 0
        for m in range(self.order_processes):
            for q in range(self.streams):
                length = self.stream_length(q)
                run, start = order[start:start + length], start + length
                if m not in mine:
                    continue
                g.manual_seed(((self.seed * 1_000_003 + epoch) * 1_009 + m) * 1_009 + q)
                if self.shuffle:
                    run = buffer_shuffle(run, self.buffer, g)
                chunks[m, q] = self._batches(run)
        return [i for k in range(self.batches_per_epoch) for m in mine
                for i in chunks[m, k % self.streams][k // self.streams]]

    def _batches(self, run: list[int]) -> list[list[int]]:
        """A stream's run cut into its chunks: in turn, or grouped, each sample joining its group's
        open batch, the first ``quota`` full batches in the order they fill."""
        size, quota = self.chunk, self.quota
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
