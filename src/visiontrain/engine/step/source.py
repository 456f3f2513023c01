"""The training data as the loop sees it: one interface, whatever the data is made of.

The trainer asks a :class:`TrainSource` for this process's batches of an epoch from a given batch on
(a resumed run starts mid-epoch), and the checkpoint holds the source's state; neither knows more.
:class:`LoaderSource` is today's source: a map-style dataset, the resumable batch sampler
(``data.samplers``: the order of an epoch is a function of the seed and the epoch) and a DataLoader.
A task may hand the engine any other source as ``TaskData.train`` (a stream, shards read in
order...): to resume exactly it must give, for (epoch, start_batch), the batches the uninterrupted
run gave from that batch on. Under torchrun each process's source gives its own share, and every
process the same number of batches.
"""
from __future__ import annotations

from typing import Any, Iterator, Protocol, runtime_checkable

from torch.utils.data import DataLoader

from visiontrain.data.samplers import ResumableBatchSampler, follows_split
from visiontrain.data.stacked import as_samples


@runtime_checkable
class TrainSource(Protocol):
    batches_per_epoch: int  # this process's batches in every epoch

    def batches(self, epoch: int, start_batch: int = 0) -> Iterator[Any]:
        """This process's batches of ``epoch`` (0-based) from batch ``start_batch`` on, on the host,
        drawing nothing from the global random streams (a resumed run asks for them at another point
        of those streams than the run it continues): a DataLoader here takes a generator of its own."""

    def first_items(self, limit: int | None = None) -> list[Any]:
        """The samples of epoch 0's first batch (its first ``limit``), loaded as training loads them,
        without moving a random stream the run draws from: what the first look draws and measures."""

    def collate(self, items: list[Any]) -> Any:
        """Samples into a batch, as ``batches`` gives them."""

    def state_dict(self) -> dict[str, Any]:
        """What the epoch's order depends on besides (epoch, start_batch); in every checkpoint."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict``; a state this source cannot continue exactly raises ValueError
        saying why."""

    def close(self) -> None:
        """Release what the source holds (worker processes) at the end of ``fit``."""


class LoaderSource:
    """A map-style dataset through a ``ResumableBatchSampler`` and a DataLoader (``engine.setup``).
    ``accum_steps``: the micro-batches of an optimizer step, which with the batch size and the
    number of processes make the global batch a resume must keep."""

    def __init__(self, sampler: ResumableBatchSampler, loader: DataLoader, accum_steps: int = 1) -> None:
        self.sampler, self.loader, self.accum_steps = sampler, loader, accum_steps
        self.batches_per_epoch = sampler.batches_per_epoch

    def batches(self, epoch: int, start_batch: int = 0) -> Iterator[Any]:
        self.sampler.set_epoch(epoch, start_batch=start_batch)
        return iter(self.loader)

    def first_items(self, limit: int | None = None) -> list[Any]:
        """The batch sampler's first keys through the dataset's ``__getitems__`` where it has one, as
        torch's fetcher does; ``SeededDataset`` forks torch's RNG while it loads."""
        keys = next(iter(self.loader.batch_sampler))[:limit]
        getitems = getattr(self.loader.dataset, "__getitems__", None)
        return as_samples(getitems(keys)) if getitems else [self.loader.dataset[k] for k in keys]

    def collate(self, items: list[Any]) -> Any:
        return self.loader.collate_fn(items)

    def state_dict(self) -> dict[str, Any]:
        s = self.sampler
        return {"seed": s.seed, "batch_size": s.batch_size, "world_size": s.world_size,
                "accum_steps": self.accum_steps, "follows_world_size": s.follows_world_size, "seeding": s.seeding,
                **s.order_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The seed of the data order; refused (ValueError) when the global batch, or a split of it the
        sampler cannot follow (``follows_world_size``), or what else its order depends on
        (``order_state``) differs: the position inside an epoch is counted in optimizer steps, each one
        piece of the epoch's order. ``engine.setup.global_batch`` has chosen the split before."""
        s = self.sampler
        if hasattr(s, "adopt_order"):  # an order cut for the written run's numbers (shards): read as written
            s.adopt_order(state)
        size, world = int(state.get("batch_size") or s.batch_size), int(state.get("world_size") or 1)
        accum = int(state.get("accum_steps") or self.accum_steps)
        if (size, world, accum) != (s.batch_size, s.world_size, self.accum_steps) and not self._follows(state):
            raise ValueError(f"it was written with data.batch_size={size} on {world} process(es) x trainer.accum_steps="
                             f"{accum}; this run has data.batch_size={s.batch_size} on {s.world_size} x "
                             f"{self.accum_steps}. An exact resume needs {self._needs()}")
        for key, value in s.order_state().items():  # what else the sampler's order depends on
            if key in state and state[key] != value:
                raise ValueError(f"it was written with its data read in an order of {key}={state[key]!r}; this "
                                 f"run's is {value!r}. An exact resume needs it unchanged")
        s.seed = int(state["seed"])
        s.seeding = state.get("seeding", "batch")  # a run from before per-sample seeds goes on as it was

    def _follows(self, state: dict[str, Any]) -> bool:
        """Whether this sampler gives each optimizer step the samples it had under the written split."""
        s = self.sampler
        if state.get("follows_world_size") != s.follows_world_size or state.get("seeding") != "sample":
            return False  # a checkpoint from before the split could change
        written = (state["batch_size"], state["world_size"], state["accum_steps"])
        return follows_split(s.follows_world_size, written, (s.batch_size, s.world_size, self.accum_steps),
                             state.get("order_processes"))

    def _needs(self) -> str:
        follows = self.sampler.follows_world_size
        if follows == "none":
            return "all three unchanged (the position inside the epoch is counted in batches)"
        if follows == "canonical":
            return ("trainer.accum_steps and the global micro-batch (data.batch_size x processes) unchanged, on a "
                    f"number of processes that divides the {self.sampler.order_processes} its shards' order is cut "
                    f"for (data.order_processes)")
        kept = "the global batch kept" + (" and data.batch_size unchanged" if follows == "accumulation" else "")
        return f"{kept} (the position inside the epoch is counted in optimizer steps)"

    def close(self) -> None:
        stop_workers(self.loader)


def stop_workers(loader: DataLoader) -> None:
    """End a loader's persistent workers now. Dropping the iterator is not enough: when a reference
    cycle holds it, its shutdown waits for the garbage collector, and one seen shut down that way
    (a rank of a 2-process run) never heard back from its worker: 5 s of waiting, a SIGTERM the
    worker ignores, 5 s more."""
    iterator, loader._iterator = loader._iterator, None
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
