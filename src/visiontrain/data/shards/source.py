"""``data.name: shards``: training from the tar shards ``visiontrain shard`` writes, in a directory or
at an fsspec URL (``data.shards``). The section has the keys of the sources shards are written
from, as a classification task reads an image folder's and a detector a detection source's (a
semantic or panoptic task reads the same: the bad-data policies, the limits, the splits), and
reads its samples in its own order (``ShardBatchSampler``)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from visiontrain.core.config import register_kind
from visiontrain.core.typed_config import doc
from visiontrain.data.datasets.sources import ImageFolderDataConfig
from visiontrain.data.detection.sources import DetectionDataConfig
from visiontrain.data.samplers import ResumableBatchSampler
from visiontrain.data.shards.layout import split_pattern
from visiontrain.data.shards.reader import ShardSpec, split_shard_sizes
from visiontrain.data.shards.sampler import ShardBatchSampler

log = logging.getLogger("visiontrain")


@dataclass
class ShardsDataConfig(DetectionDataConfig, ImageFolderDataConfig):
    """shards: a directory or URL of shards, read in shard order through a shuffle buffer."""

    name: str = doc("dataset: shards (the tar shards of `visiontrain shard`, at data.shards)", "shards")
    shards: str | None = doc("the shards' directory or URL (s3://bucket/prefix, gs://..., https://...; fsspec, "
                             "with the storage's usual credentials), holding index.json", None)
    order_processes: int | None = doc(
        "the number of processes an epoch's order is cut for: a resume runs exactly on any number of processes "
        "that divides it (12: on 1, 2, 3, 4, 6 or 12), with the per-process batch that keeps the global batch. "
        "It must divide data.batch_size x processes. null: this run's number of processes. Kept in the "
        "checkpoints: a resume reads the order it was written with", None, minimum=1)
    shuffle_buffer: int = doc("samples a worker shuffles among as it reads its shards (shards themselves are read "
                              "in a shuffled order each epoch); 0 or 1 reads them in their order", 1000, minimum=0)

    def location(self) -> str:
        if not self.shards:
            raise ValueError("data.name=shards needs data.shards=DIR or URL (the --out of `visiontrain shard`)")
        return self.shards

    def shard_spec(self) -> ShardSpec:
        """What the shard datasets read (``reader.ShardSpec``)."""
        directory, only = split_pattern(self.location())
        return ShardSpec(directory, self.shuffle_buffer, only)

    def batch_sampler(self, num_samples: int, group_ids: list[int] | None, *, seed: int, rank: int,
                      world_size: int) -> ResumableBatchSampler:
        """Whole shards in a shuffled order, each worker's share read front to back (``ShardBatchSampler``);
        a detector's aspect-ratio groups (``task.group_aspect``) formed within each worker's share,
        a fixed number of batches an epoch (what that leaves out said once)."""
        sizes = split_shard_sizes(self.shard_spec(), self.train_split, self.limit_train)
        if sum(sizes) != num_samples:  # a task that read another split than data.train_split
            raise ValueError(f"data.shards={self.location()}: the training set has {num_samples:,} samples, but "
                             f"split {self.train_split!r} gives {sum(sizes):,}")
        sampler = ShardBatchSampler(sizes, self.batch_size, seed=seed, buffer=self.shuffle_buffer,
                                    streams=max(1, self.num_workers), rank=rank, world_size=world_size,
                                    group_ids=group_ids, order_processes=self.order_processes)
        if rank == 0 and (left_out := sampler.left_out_message()):
            log.info("%s", left_out)
        return sampler


register_kind("data", "shards", ShardsDataConfig)
