"""DataLoader workers start from a forkserver by default: a worker forked from the training
process inherits every lock its other threads hold at that instant, and waits forever for one."""
from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.data import DataLoader

from visiontrain.config import load_config
from visiontrain.engine import build
from visiontrain.engine.distributed import DistInfo
from worker_lock import LOCK, TakesTheLock


def first_batch_while_a_thread_holds_the_lock(start: str, timeout: float) -> torch.Tensor:
    held, release = threading.Event(), threading.Event()

    def holder() -> None:  # another thread of the training process, mid-way through something
        with LOCK:
            held.set()
            release.wait()

    thread = threading.Thread(target=holder, daemon=True)
    thread.start()
    held.wait()
    try:
        loader = DataLoader(TakesTheLock(), batch_size=2, num_workers=1, timeout=timeout,
                            multiprocessing_context=build.worker_context(start))
        return next(iter(loader))
    finally:
        release.set()
        thread.join()


def test_a_forkserver_worker_does_not_inherit_a_held_lock():
    assert first_batch_while_a_thread_holds_the_lock("forkserver", timeout=60).tolist() == [[0], [1]]


def test_a_forked_worker_waits_for_it_forever():
    """The hazard itself, so the test above is known to test something: fork copies the held lock."""
    with pytest.raises(RuntimeError, match="timed out"):
        first_batch_while_a_thread_holds_the_lock("fork", timeout=3)


@pytest.mark.parametrize("start", ["forkserver", "fork"])
def test_the_loaders_use_data_worker_start(start):
    cfg = load_config("classify-fashion", ["data.name=digits", "data.num_workers=1", f"data.worker_start={start}"])
    from visiontrain.tasks import build_task

    data = build_task(cfg).build_data()
    _, train, val = build.loaders(data, cfg, DistInfo(), torch.device("cpu"))
    assert train.multiprocessing_context.get_start_method() == start
    assert val.multiprocessing_context.get_start_method() == start
    images, labels = next(iter(val))  # the digits data and its transforms pickle and load in a worker
    assert images.shape[0] == labels.shape[0] > 0
    build.stop_workers(train)


def ignored_signals(pid: int) -> set[int]:
    mask = next(int(line.split()[1], 16) for line in open(f"/proc/{pid}/status") if line.startswith("SigIgn:"))
    return {sig for sig in range(1, 65) if mask >> (sig - 1) & 1}


def test_the_forkserver_and_its_workers_leave_stop_signals_to_the_training_process():
    """A scheduler signals the whole job; a server that died of it would take the workers along
    and the run would fail instead of writing last.pt at its next step."""
    import signal
    from multiprocessing import forkserver

    from visiontrain.engine.preemption import STOP_SIGNALS, ignore_stop_signals

    loader = DataLoader(TakesTheLock(), batch_size=2, num_workers=1, worker_init_fn=ignore_stop_signals,
                        multiprocessing_context=build.worker_context("forkserver"), persistent_workers=True)
    next(iter(loader))
    stop = {int(s) for s in STOP_SIGNALS}
    assert stop <= ignored_signals(forkserver._forkserver._forkserver_pid)
    assert stop <= ignored_signals(loader._iterator._workers[0].pid)
    build.stop_workers(loader)
    import visiontrain.data.worker_preload  # noqa: F401  (imported here, outside a server: no change)
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN


def test_a_dataset_class_a_worker_cannot_import_is_refused_at_start(monkeypatch):
    """A notebook's class: the forkserver's workers could not unpickle it."""
    import types

    from visiontrain.config import ConfigError

    class NotebookDataset(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int) -> int:
            return i

    NotebookDataset.__module__ = "__main__"
    monkeypatch.setitem(__import__("sys").modules, "__main__", types.ModuleType("__main__"))  # no __file__
    with pytest.raises(ConfigError, match=r"data.worker_start=forkserver: .*NotebookDataset.*data.worker_start=fork"):
        build.check_importable_in_workers("forkserver", NotebookDataset(), None)
    build.check_importable_in_workers("fork", NotebookDataset(), None)  # a fork copies it: fine
