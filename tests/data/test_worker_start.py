"""DataLoader workers start from a forkserver by default: a worker forked from the training
process inherits every lock its other threads hold at that instant, and waits forever for one."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
from torch.utils.data import DataLoader

from procs import COMMAND_ENV, run_cli
from visiontrain.core.config import load_config
from visiontrain.engine.setup.loaders import loaders, worker_context
from visiontrain.engine.parallel.distributed import DistInfo
from visiontrain.engine.step.source import stop_workers
from worker_lock import LOCK, LargeItems, TakesTheLock, stack_unshared

SMALL_RECIPES = ("classify-fashion", "detect-detr", "detect-faster-rcnn", "detect-yolov3", "segment-mask-rcnn",
                 "segment-semantic", "ssl-dino")


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
                            multiprocessing_context=worker_context(start))
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
    source, val = loaders(data, cfg, DistInfo(), torch.device("cpu"))
    assert source.loader.multiprocessing_context.get_start_method() == start
    assert val.multiprocessing_context.get_start_method() == start
    images, labels = next(iter(val))  # the digits data and its transforms pickle and load in a worker
    assert images.shape[0] == labels.shape[0] > 0
    source.close()


def ignored_signals(pid: int) -> set[int]:
    mask = next(int(line.split()[1], 16) for line in open(f"/proc/{pid}/status") if line.startswith("SigIgn:"))
    return {sig for sig in range(1, 65) if mask >> (sig - 1) & 1}


def test_the_forkserver_and_its_workers_leave_stop_signals_to_the_training_process():
    """A scheduler signals the whole job; a server that died of it would take the workers along
    and the run would fail instead of writing last.pt at its next step."""
    import signal
    from multiprocessing import forkserver

    from visiontrain.core.stop_signals import STOP_SIGNALS, ignore_stop_signals

    loader = DataLoader(TakesTheLock(), batch_size=2, num_workers=1, worker_init_fn=ignore_stop_signals,
                        multiprocessing_context=worker_context("forkserver"), persistent_workers=True)
    next(iter(loader))
    stop = {int(s) for s in STOP_SIGNALS}
    assert stop <= ignored_signals(forkserver._forkserver._forkserver_pid)
    assert stop <= ignored_signals(loader._iterator._workers[0].pid)
    stop_workers(loader)
    import visiontrain.data.worker_preload  # noqa: F401  (imported here, outside a server: no change)
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN


def test_a_dataset_class_a_worker_cannot_import_is_refused_at_start(monkeypatch):
    """A notebook's class: the forkserver's workers could not unpickle it."""
    import types

    from visiontrain.core.config import ConfigError
    from visiontrain.engine.setup.worker_check import check_sendable_to_workers

    class NotebookDataset(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int) -> int:
            return i

    NotebookDataset.__module__ = "__main__"
    monkeypatch.setitem(__import__("sys").modules, "__main__", types.ModuleType("__main__"))  # no __file__
    with pytest.raises(ConfigError, match=r"data.worker_start=forkserver: .*NotebookDataset.*data.worker_start=fork"):
        check_sendable_to_workers("forkserver", {"training dataset": NotebookDataset()})
    check_sendable_to_workers("fork", {"training dataset": NotebookDataset()})  # a fork copies it: fine


@pytest.mark.parametrize("start", ["spawn", "fork"])
@pytest.mark.parametrize("recipe", SMALL_RECIPES)
def test_every_small_recipe_loads_a_batch_with_each_start_method(recipe, start):
    """tests/app/test_recipes.py runs each recipe with its own start method (the forkserver); here its
    dataset, transforms and collate reach a spawned worker (pickled, in a fresh interpreter) and a
    forked one, and load a training batch. The start method is this test's subject, hence the
    override; classify-fashion loads in-process as shipped (num_workers 0), so it gets one worker here."""
    from visiontrain.tasks import build_task

    cfg = load_config(recipe, [f"data.worker_start={start}", "data.limit_val=8",
                               *(["data.num_workers=1"] if recipe == "classify-fashion" else [])])
    data = build_task(cfg).build_data()
    source, _ = loaders(data, cfg, DistInfo(), torch.device("cpu"))
    assert source.loader.multiprocessing_context.get_start_method() == start
    batch = next(source.batches(0))
    images = batch[0][0] if isinstance(batch[0], list) else batch[0]  # DINO: a list of crops, each [B, C, H, W]
    assert len(images) == cfg.data.batch_size
    if cfg.task.name == "mask_rcnn":  # the masks (compressed RLE in the dataset) come back decoded, one a box
        shapes = [(tuple(t["masks"].shape), (len(t["boxes"]), *t["hw"])) for t in batch[2]]
        assert all(got == want for got, want in shapes), shapes
    source.close()


def test_a_spawned_worker_stopped_mid_epoch_ends_cleanly():
    """Stopping a loader whose spawned worker is still sending prefetched batches (a run that ends
    mid-epoch) must not abort the worker: with multiprocessing's own spawn context it exits with
    SIGABRT (-6) here, and the loader raises "killed by signal: Aborted"."""
    for _ in range(3):
        loader = DataLoader(LargeItems(), batch_size=4, num_workers=1, prefetch_factor=4,
                            collate_fn=stack_unshared, multiprocessing_context=worker_context("spawn"))
        iterator = iter(loader)
        assert next(iterator).shape == (4, 1024, 1024)
        iterator._shutdown_workers()  # what source.stop_workers does at the end of fit
        assert [w.exitcode for w in iterator._workers] == [0]


SHIFTED_TASK = '''"""Classification whose training images pass through a lambda, held by the dataset."""
from torch.utils.data import Dataset

from visiontrain.engine.protocols.task import register_task
from visiontrain.tasks.classification import ClassificationConfig, ClassificationTask


class Shifted(Dataset):
    def __init__(self, base):
        self.base, self.shift = base, lambda image: image + 0.0

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        image, label = self.base[index]
        return self.shift(image), label


class ShiftedTask(ClassificationTask):
    def build_data(self):
        data = super().build_data()
        data.train = Shifted(data.train)
        return data


register_task("classification", ShiftedTask, ClassificationConfig)
'''


def test_a_dataset_a_worker_cannot_receive_is_one_line_and_writes_nothing(tmp_path):
    """A lambda inside the training dataset: refused before training with its path and the way out,
    exit 2, no run dir; with data.worker_start=fork (which copies instead of pickling) it trains.
    num_workers=1: the recipe loads in-process, and workers are this test's subject."""
    (tmp_path / "shifted_task.py").write_text(SHIFTED_TASK)
    args = ["--import", "shifted_task.py", "fit", "classify-fashion", "data.name=digits", "data.num_workers=1",
            "trainer.max_steps=2", "eval.every=0"]
    proc = run_cli(*args, "--run-dir", "runs/shifted", cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert errors[-1].startswith("visiontrain: error: data.worker_start=forkserver: the training dataset cannot be "
                                 "sent to a forkserver DataLoader worker: training dataset.shift is a lambda "
                                 "(shifted_task.Shifted.__init__.<locals>.<lambda>), which cannot be pickled"), errors
    assert "data.worker_start=fork" in errors[-1] and "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()
    proc = run_cli(*args, "data.worker_start=fork", "--run-dir", "runs/shifted", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


# A training script as a user saves it from the docs. data.num_workers=1 is the subject (one forkserver
# worker, as detect-yolov3 ships); the other overrides are the run's data and size.
SCRIPT = """from visiontrain import Trainer, build_task, load_config

cfg = load_config("classify-fashion", ["data.name=digits", "data.num_workers=1", "data.batch_size=32",
                                       "trainer.max_steps=2", "data.limit_train=64", "data.limit_val=32"])
summary = Trainer(cfg, build_task(cfg), {run!r}).fit()
"""


def run_script(path, text: str) -> subprocess.CompletedProcess:
    path.write_text(text)
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300, cwd=path.parent,
                          env={**os.environ, **COMMAND_ENV})  # a fresh interpreter, as `python train.py` starts


def test_a_script_without_the_main_guard_is_refused_in_one_line_and_with_it_trains(tmp_path):
    """Without ``if __name__ == "__main__":`` the forkserver ran the script's training again and the
    run died with "DataLoader worker (pid(s) ...) exited unexpectedly"; now the script is told, in
    one line naming its line, before any worker starts. The same code under the guard trains."""
    script, run = tmp_path / "train.py", tmp_path / "run"
    proc = run_script(script, SCRIPT.format(run=str(run)))
    assert proc.returncode != 0 and "exited unexpectedly" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert f"{script}:5: this script trains from its top level, outside `if __name__ == \"__main__\":`" in last, \
        proc.stderr[-3000:]
    assert "put the script's code under" in last and not (run / "checkpoints").exists()
    head, *body = SCRIPT.format(run=str(run)).split("\n\n", 1)
    guarded = head + '\n\nif __name__ == "__main__":\n' + "".join(f"    {line}\n" for line in body[0].splitlines())
    proc = run_script(tmp_path / "guarded.py", guarded)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "summary.json").is_file()
