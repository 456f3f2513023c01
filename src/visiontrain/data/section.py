"""The ``data`` section: the keys every data source reads (the loaders' and the run's size), and the
section's registration, typed by ``data.name``. Each source adds the keys its reader reads, in its own
dataclass beside that reader (``data/datasets/sources.py``, ``data/detection/sources.py``) registered
with ``register_kind("data", NAME, ...)``; a key a source does not read is an unknown key there."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from visiontrain.config import register_section
from visiontrain.typed_config import doc


@dataclass
class DataConfig:
    """What the engine reads of the data section, whatever the source: how to batch and load it."""

    name: str = doc("dataset: fashion-mnist | digits | image-folder (classification); coco | voc | yolo | "
                    "fashion-mosaic | neon-trees (detection); the other data.* keys are the source's own",
                    "fashion-mnist")
    batch_size: int = doc("batch size per process (per micro-step under accumulation)", 256, minimum=1)
    eval_batch_size: int | None = doc("evaluation batch size (default: 2 x batch_size)", None, minimum=1)
    num_workers: int = doc("DataLoader worker processes (0 = load in the main process)", 0, minimum=0)
    pin_memory: bool = doc("pin host memory for faster copies to the GPU", True)
    prefetch_to_device: bool = doc("copy the next batch to the GPU on a side stream while the current step "
                                   "computes (CUDA; nothing to do on the CPU)", True)
    persistent_workers: bool = doc("keep workers alive across epochs", True)
    worker_start: Literal["forkserver", "fork", "spawn"] = doc(
        "how workers start. forkserver: forked from a single-threaded server process, so no worker "
        "inherits a lock held by another thread of the training process (a collective's, the "
        "pin-memory thread's): such a fork can hang a worker forever. fork: faster start, and the "
        "dataset need not be picklable", "forkserver")
    limit_train: int | None = doc("use only the first N training samples (quick runs)", None, minimum=1)
    limit_val: int | None = doc("use only the first N validation samples", None, minimum=1)

    def eval_batch(self) -> int:
        """The evaluation batch per process: ``eval_batch_size``, else twice the training batch
        (no gradients or optimizer state to hold, so twice fits where one trains)."""
        return self.eval_batch_size or 2 * self.batch_size


register_section("data", DataConfig, "data section, typed by data.name", typed_by_name="fashion-mnist",
                 noun="dataset")
