"""A module-level lock and a dataset that takes it: what a library's first-use initialisation in
another thread looks like to a forked DataLoader worker (tests/test_worker_start.py)."""
import threading

import torch

LOCK = threading.Lock()


class TakesTheLock(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        with LOCK:
            return torch.tensor([i])
