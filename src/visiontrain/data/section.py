"""The ``data`` section: the keys every data source reads (the loaders' and the run's size), and the
section's registration, typed by ``data.name``. Each source adds the keys its reader reads, in its own
dataclass beside that reader (``data/datasets/sources.py``, ``data/detection/sources.py``) registered
with ``register_kind("data", NAME, ...)``; a key a source does not read is an unknown key there."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from visiontrain.core.config import register_section
from visiontrain.core.typed_config import doc
from visiontrain.data.samplers import GroupedBatchSampler, ResumableBatchSampler


@dataclass
class DataConfig:
    """What the engine reads of the data section, whatever the source: how to batch and load it."""

    #: The source holds its samples in memory, ready (loading is an index): workers would only copy them
    in_memory: ClassVar[bool] = False

    name: str = doc("dataset: fashion-mnist | digits | image-folder (classification); coco | voc | yolo | "
                    "fashion-mosaic | neon-trees (detection); the other data.* keys are the source's own",
                    "fashion-mnist")
    batch_size: int = doc("batch size per process (per micro-step under accumulation)", 256, minimum=1)
    eval_batch_size: int | None = doc("evaluation batch size (default: 2 x batch_size)", None, minimum=1)
    num_workers: int | Literal["auto"] = doc(
        "DataLoader worker processes (0 = load in the main process); auto: from the cores this process may "
        "use (its CPU affinity, shared by torchrun's processes on the machine) and the device: on a GPU all "
        "but one core a process (at most 16), on a CPU a quarter of them (at least 1: the step computes on the "
        "others); 0 for a set held in memory. Said once at start-up", 0, minimum=0)
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

    def batch_sampler(self, num_samples: int, group_ids: list[int] | None, *, seed: int, rank: int,
                      world_size: int) -> ResumableBatchSampler:
        """This process's batches of the training set: in a shuffled order, grouped by aspect ratio
        where the task gives groups. A source whose samples are best read in another order (shards,
        read front to back) gives its own sampler here."""
        if group_ids is not None:
            return GroupedBatchSampler(group_ids, self.batch_size, seed=seed, rank=rank, world_size=world_size)
        return ResumableBatchSampler(num_samples, self.batch_size, seed=seed, rank=rank, world_size=world_size)

    def eval_batch(self) -> int:
        """The evaluation batch per process: ``eval_batch_size``, else twice the training batch
        (no gradients or optimizer state to hold, so twice fits where one trains)."""
        return self.eval_batch_size or 2 * self.batch_size


@dataclass
class SplitKeys:
    """The names of a source's splits (every source but a generated one reads them)."""

    train_split: str = doc("split name of the training set (detection: coco train2017, voc trainval; image-folder: "
                           "the directory under data.root)", "train")
    val_split: str = doc("split name of the validation set (detection; image-folder: the directory under data.root)",
                         "val")
    test_split: str = doc("split name of the test set (detection; image-folder: the directory under data.root), "
                          "evaluated only by `visiontrain validate --split test`, never during training", "test")


@dataclass
class ImageFileKeys:
    """What a source that reads image files adds: uint8 train images for the device, and what an
    unreadable file does."""

    normalize_on_device: bool = doc(
        "train images leave the loader as uint8 and are scaled and normalised on the device (detection, "
        "image-folder): no float pass on the CPU, a quarter of the bytes to collate, pin and copy", False)
    on_bad_image: Literal["error", "skip"] | None = doc(
        "every dataset read from files: an image file that is missing, not an image, or truncated (all are "
        "opened before the first step) is an error naming the files and their count, or is skipped and counted; "
        "null: as data.on_bad_annotation (error unless that is set)", None)
    check_images: Literal["full", "changed", "off"] = doc(
        "the check of every image file before the first step (missing, not an image, truncated): full opens "
        "every file at each start; changed reuses each file's verdict while its size and modification time are "
        "those recorded (in the data cache directory), so a re-run stats instead of opening; off checks nothing "
        "(a detection reader still reads each header for the image's size): a bad file stops the run when it "
        "is loaded", "changed")
    max_skipped_share: float = doc(
        "under skip, the largest share of a split's images (or of its boxes) that may be dropped: above it the "
        "run stops with the count and the likely cause, since a split that loses that much is more often read "
        "wrongly than dirty (COCO boxes written as x1,y1,x2,y2); 1 accepts any share", 0.1, minimum=0)


@dataclass
class DecodedCacheKeys:
    """What a source whose images are decoded per sample adds: ``data.cache=ram`` and its limits
    (``data/image_cache.py``)."""

    cache: Literal["none", "ram"] = doc(
        "ram keeps each image's decoded pixels after its first decode, in one file per split that every "
        "DataLoader worker reads, so later epochs and evaluations decode nothing (3 x H x W bytes an image, "
        "checked against data.cache_gb before training); none decodes every image each time it is loaded", "none")
    cache_gb: float | None = doc(
        "data.cache=ram: the most the decoded images may take, in GiB (2^30 bytes), per training process; "
        "null: half of the memory available at the start, shared by torchrun's processes on a machine", None,
        minimum=0)
    cache_dir: str | None = doc(
        "data.cache=ram: the directory of the cache files; null: /dev/shm (memory) where it exists and has room "
        "for the images, else the temporary directory. On a disk the kernel's page cache keeps the files in "
        "memory while it can", None)


register_section("data", DataConfig, "data section, typed by data.name", typed_by_name="fashion-mnist",
                 noun="dataset")
