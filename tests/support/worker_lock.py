"""A module-level lock and a dataset that takes it: what a library's first-use initialisation in
another thread looks like to a forked DataLoader worker (tests/data/test_worker_start.py)."""
import threading

import torch

LOCK = threading.Lock()


class TakesTheLock(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        with LOCK:
            return torch.tensor([i])


class LargeItems(torch.utils.data.Dataset):
    """4 MB an item: a worker is still handing over its prefetched batches when the loader stops."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((1024, 1024), float(i))


def stack_unshared(items: list[torch.Tensor]) -> torch.Tensor:
    """A batch in ordinary memory (torch's default collate writes straight into shared memory in a
    worker): the queue's feeder thread then copies it into shared memory while sending it."""
    return torch.stack(items)
