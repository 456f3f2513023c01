"""DataLoader workers' memory through an epoch against the size of the index: each worker's own memory
(below), unique (USS), private dirty, anonymous and proportional (PSS) memory at its first batch,
after WARM batches and after BATCHES, with the default start method (forkserver) and with fork, for
COCO-sized detection sets, ImageNet-sized image folders and ImageNet-sized classification shards
(their samples file). Side by side in the same run, the index in three forms: **mapped**, as the
datasets keep it now (packed buffers in one file every worker maps,
``visiontrain.data.shared_arrays``); **memory**, the same packed buffers kept in each process's
memory (``shared_arrays.MIN_BYTES`` raised past the index: the form before the mapping);
**objects**, the Python objects it was before it was packed (a list of records or of (path, label)
tuples; not for shards, which never had that form).

The sets are synthetic with the real shapes (``startup.make_coco``: one tiny JPEG under every file
name, 7.27 boxes an image; ``startup.make_folder``: 1,000 class folders; ``make_shards``: digits'
shards written by ``visiontrain shard``, their samples file then repeated to the size, every row a
real sample); the loader is the project's (``engine.setup.loaders``: its worker context and
``worker_init_fn``), 4 workers, batches of 16 images drawn at random over the whole set, so that
every worker touches records from all of the index. Linux ``/proc/PID/smaps_rollup`` and ``smaps``.

**The worker's own copy** of the index is its *own* memory after the batches less that of a
worker over a 100-image set (the same code, imports and batches), where own memory is
Private_Clean + Private_Dirty summed over the mappings of ``/proc/PID/smaps`` that no file backs
(the heap, anonymous mappings, the stack): pages this worker alone holds, which is where an unpickled
or copied index lies, and which nothing else can use. Three other figures are reported beside it,
each less the baseline, and none is that copy in every case:

- USS (Private_Clean + Private_Dirty, ``smaps_rollup``) counts the pages of the mapped index file
  that only this worker maps, though they are the kernel's page cache, one copy for every process
  that maps the file; and while the file is not yet written back to the disk its pages count as
  *dirty*. A process that alone reads all of a freshly written 38 MiB index file shows +38.6 MiB of
  USS and of Private_Dirty, +0.5 MiB of own memory (checked by hand).
- Private_Dirty alone: the same, for the same reason.
- Anonymous memory (``Anonymous``) leaves the file out but counts, besides the worker's heap, the
  pages it shares copy-on-write with the forkserver or the parent it was forked from: the same at
  every size for a forkserver worker, so its difference from the baseline is the copy there, but a
  forked worker's grows with the parent's heap, the index built in it included.

In the full run of BENCHMARKS.md, 600 batches of 4 workers over the whole set left no page of the
file private to one worker (USS less the baseline is -0.3 to +0.3 MiB in its mapped rows), so USS
did not mislead there; with fewer reads, or one worker, it would. BENCHMARKS.md keeps the objects
form's figures from the run that had it.

The objects form is slow to measure at the large sizes (every worker unpickles 340 MiB of records);
it runs with ``WORKER_MEMORY_OBJECTS=1``. ``WORKER_MEMORY_STARTS=forkserver`` measures one start method,
``WORKER_MEMORY_ENDS=1`` only the baseline and the largest set of each kind (no figure is drawn then).

    python benchmarks/scale/worker_memory.py [--quick]
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from loglog import RESULTS, draw, in_child, main, rss_kib
from startup import make_coco, make_folder

BASE = 100  # images in the set whose worker is the baseline: the worker without an index to speak of
SIZES = {"coco": (BASE, 10_000, 40_000, 118_287), "folder": (BASE, 100_000, 400_000, 1_281_167),
         "shards": (BASE, 100_000, 400_000, 1_281_167)}
QUICK = {"coco": (5_000,), "shards": (60_000,)}
STARTS = tuple(os.environ.get("WORKER_MEMORY_STARTS", "forkserver,fork").split(","))
ENDS_ONLY = os.environ.get("WORKER_MEMORY_ENDS") == "1"  # the baseline and the largest size only
FORMS = ("mapped", "memory", "objects") if os.environ.get("WORKER_MEMORY_OBJECTS") == "1" else ("mapped", "memory")
WORKERS, BATCH, WARM, BATCHES = 4, 16, 100, 600


def memory_mib(pid: int) -> dict[str, float]:
    """USS (private clean + dirty), private dirty, anonymous memory, PSS, and the private pages of
    the mappings that are not a file's ("own": module docstring) of a process, MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0])
    return {"uss": (fields["Private_Clean"] + fields["Private_Dirty"]) / 1024, "dirty": fields["Private_Dirty"] / 1024,
            "anon": fields["Anonymous"] / 1024, "pss": fields["Pss"] / 1024, "own": private_unfiled_kib(pid) / 1024}


def private_unfiled_kib(pid: int) -> int:
    """Private_Clean + Private_Dirty summed over the mappings of ``/proc/PID/smaps`` that are no file
    (the heap, anonymous mappings, the stack): pages this process alone holds and no file backs."""
    total, filed = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if head and not head[0].endswith(":"):  # a mapping: address perms offset dev inode [path]
            filed = len(head) == 6 and head[5].startswith("/")
        elif not filed and head and head[0] in ("Private_Clean:", "Private_Dirty:"):
            total += int(head[1])
    return total


def read_index(kind: str, form: str, path: str):
    """The dataset as ``fit`` reads it; under ``memory`` its packed buffers kept in memory, not mapped;
    under ``objects`` its index turned back into Python objects, the form it had before it was
    packed (the loading code reads both)."""
    if form == "memory":
        from visiontrain.data import shared_arrays

        shared_arrays.MIN_BYTES = 2 ** 63  # no index is that large: every one stays in memory
    if kind == "shards":
        from visiontrain.data.datasets.sources import ClassificationReader
        from visiontrain.data.shards.datasets import build_shards_classification
        from visiontrain.data.shards.reader import ShardSpec

        return build_shards_classification(ClassificationReader(image_size=32, shards=ShardSpec(path)))[0]
    if kind == "coco":
        from visiontrain.data.detection.coco import read_coco

        dataset = read_coco(path, str(Path(path).parents[1] / "train"))
        if form == "objects":
            dataset.records = list(dataset.records)
        return dataset
    from visiontrain.data.datasets.image_folder import build_image_folder
    from visiontrain.data.datasets.sources import ClassificationReader

    dataset = build_image_folder(ClassificationReader(root=path, image_size=32))[0]
    if form == "objects":
        dataset.samples = list(dataset.samples)
    return dataset


def measure(spec: str) -> dict:
    """``START:FORM:KIND:PATH``: the loader's workers at their first batch and after BATCHES."""
    start, form, kind, path = spec.split(":", 3)
    from visiontrain.core._tv_compat import ensure_torchvision

    ensure_torchvision()
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    from visiontrain.engine.setup.loaders import worker_context
    from visiontrain.core.process_tree import start_worker

    before, started = rss_kib(), time.perf_counter()
    dataset = read_index(kind, form, path)
    index_mib = (rss_kib() - before) / 1024  # what the index holds in the main process
    sampler = RandomSampler(dataset, replacement=True, num_samples=BATCH * (BATCHES + 1),  # the baseline's 100 too
                            generator=torch.Generator().manual_seed(0))
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=WORKERS, collate_fn=list,
                        worker_init_fn=start_worker, multiprocessing_context=worker_context(start))
    batches = iter(loader)
    next(batches)
    first_batch_s = time.perf_counter() - started  # reading and checking the data, the workers' start
    pids = [w.pid for w in batches._workers]  # the iterator's worker processes (torch's own attribute)
    first = [memory_mib(p) for p in pids]
    for _ in range(WARM):
        next(batches)
    warm = [memory_mib(p) for p in pids]
    for _ in range(BATCHES - WARM):
        next(batches)
    later = [memory_mib(p) for p in pids]
    del batches
    packed = round(index_bytes(kind, dataset) / 2**20, 1) if form != "objects" else None  # the buffers' own size

    def mean(rows: list[dict[str, float]], key: str) -> float:
        return round(sum(m[key] for m in rows) / WORKERS, 1)

    return {"to_first_batch_s": round(first_batch_s, 1), "index_in_main_mib": round(index_mib, 1),
            "packed_index_mib": packed, "pickle_kib": round(len(pickle.dumps(dataset)) / 1024, 1),
            "worker_uss_first_mib": mean(first, "uss"), "worker_uss_later_mib": mean(later, "uss"),
            "worker_own_first_mib": mean(first, "own"), "worker_own_later_mib": mean(later, "own"),
            "worker_dirty_first_mib": mean(first, "dirty"), "worker_dirty_later_mib": mean(later, "dirty"),
            "worker_anon_first_mib": mean(first, "anon"), "worker_anon_later_mib": mean(later, "anon"),
            "worker_pss_later_mib": mean(later, "pss"),
            "growth": round(sum(m["uss"] for m in later) / sum(m["uss"] for m in first) - 1, 3),
            "growth_after_warm": round(sum(m["uss"] for m in later) / sum(m["uss"] for m in warm) - 1, 3)}


def index_bytes(kind: str, dataset) -> int:
    """The bytes of the dataset's packed index: its records, samples, or samples file and keys."""
    if kind == "shards":
        s = dataset.split.samples
        return sum(a.nbytes for a in (s.shard, s.start, s.end, dataset.split.positions, *s.labels.values()))
    return (dataset.records if kind == "coco" else dataset.samples).nbytes


def make_shards(root: Path, images: int) -> str:
    """Digits' shards (``visiontrain shard``: 1,437 training images in 76 shards) with the training
    split's samples file repeated to ``images`` rows, each a real sample of the shards: a samples
    file of ImageNet's size without writing ImageNet's shards. The directory."""
    out = root / "shards"
    subprocess.run([sys.executable, "-m", "visiontrain", "shard", "classify-fashion", "data.name=digits",
                    "--out", str(out), "--shard-size", "64KB"], check=True, capture_output=True)
    index = json.loads((out / "index.json").read_text())
    entry = index["splits"]["train"]
    with np.load(out / entry["samples_file"]) as npz:
        arrays = {k: npz[k] for k in npz.files}
    rows = np.arange(images) % len(arrays["shard"])
    np.savez(out / entry["samples_file"], **{k: v[rows] for k, v in arrays.items()})
    entry["samples"] = images
    (out / "index.json").write_text(json.dumps(index, indent=1))
    return str(out)


def make(kind: str, root: Path, images: int) -> str:
    """The synthetic set; what ``read_index`` takes."""
    if kind == "coco":
        return str(make_coco(root, images, 80, 7.27))
    if kind == "shards":
        return make_shards(root, images)
    make_folder(root, images, classes=min(images, 1000))  # no empty class folder in the baseline
    return str(root)


def with_shares(rows: list[dict]) -> list[dict]:
    """Each row's worker copy of the index: its own memory after the batches less the baseline
    worker's (same kind, start and form, BASE images), and the same for its USS, private dirty and
    anonymous memory (module docstring), against the index in the main process."""
    keys = {"worker_index_mib": "worker_own_later_mib", "worker_index_uss_mib": "worker_uss_later_mib",
            "worker_index_dirty_mib": "worker_dirty_later_mib", "worker_index_anon_mib": "worker_anon_later_mib"}
    base = {(r["data"], r["start"], r["form"]): r for r in rows if r["images"] == BASE}
    for r in rows:
        if base and r["images"] > BASE:  # --quick has no baseline
            for out, key in keys.items():
                r[out] = round(r[key] - base[r["data"], r["start"], r["form"]][key], 1)
            r["share_of_main_index"] = round(r["worker_index_mib"] / max(r["index_in_main_mib"], 0.1), 3)
    return rows


def run(quick: bool = False) -> list[dict]:
    """One row per data set, size, start method and form, each loader in a process of its own."""
    rows = []
    for kind, sizes in (QUICK if quick else SIZES).items():
        for images in (sizes[0], sizes[-1]) if ENDS_ONLY and not quick else sizes:
            tmp = Path(tempfile.mkdtemp(prefix="scale-workers-"))
            try:
                path = make(kind, tmp, images)
                for start in STARTS:
                    for form in forms(kind):
                        row = {"data": kind, "images": images, "start": start, "form": form,
                               **in_child(__file__, f"{start}:{form}:{kind}:{path}")}
                        rows.append(row)
                        print(json.dumps(row), file=sys.stderr, flush=True)
            finally:
                shutil.rmtree(tmp)
    rows = with_shares(rows)
    if not quick and not ENDS_ONLY and STARTS == ("forkserver", "fork"):
        draw_rows(rows)
    return rows


def forms(kind: str) -> tuple[str, ...]:
    """The forms of ``kind``'s index measured: shards' samples file was never Python objects."""
    return tuple(f for f in FORMS if not (kind == "shards" and f == "objects"))


def draw_rows(rows: list[dict]) -> None:
    """Per data set: a worker's own memory after the batches against the images, one curve per start
    and form."""
    panels = []
    for kind in SIZES:
        curves = {}
        for start in STARTS:
            for form in forms(kind):
                mine = [r for r in rows if (r["data"], r["start"], r["form"]) == (kind, start, form)]
                curves[f"{start}, {form}"] = ([r["images"] for r in mine], [r["worker_own_later_mib"] for r in mine])
        panels.append((f"images in the {kind} index", "own memory per worker after the batches (MiB)", curves))
    draw(panels, RESULTS / "scale-workers.png",
         "DataLoader workers' memory: the index mapped, packed in memory, and as Python objects")


if __name__ == "__main__":
    main(__doc__, run, measure, "COCO-shaped, 5,000 images, and shards, 60,000 samples, only (no baseline, so no shares)")
