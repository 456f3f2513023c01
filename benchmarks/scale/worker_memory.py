"""DataLoader workers' memory through an epoch against the size of the index: each worker's unique
(USS) and proportional (PSS) memory at its first batch, after WARM batches and after BATCHES, with the default
start method (forkserver) and with fork, for COCO-sized detection sets and ImageNet-sized image
folders; the index packed as the datasets keep it (``visiontrain.data.packed``) and, side by side
in the same run, as the Python objects it was before (a list of records or of (path, label) tuples).

The sets are synthetic with the real shapes (``startup.make_coco``: one tiny JPEG under every file
name, 7.27 boxes an image; ``startup.make_folder``: 1,000 class folders); the loader is the
project's (``engine.setup.loaders``: its worker context and ``worker_init_fn``), 4 workers, batches
of 16 images drawn at random over the whole set, so that every worker touches records from all of
the index. A worker's share of the index is its USS after the batches less that of a worker over a
100-image set (the same code, imports and batches). Linux ``/proc/PID/smaps_rollup``.

    python benchmarks/scale/worker_memory.py [--quick]
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

from loglog import RESULTS, draw, in_child, main, rss_kib
from startup import make_coco, make_folder

BASE = 100  # images in the set whose worker is the baseline: the worker without an index to speak of
SIZES = {"coco": (BASE, 10_000, 40_000, 118_287), "folder": (BASE, 100_000, 400_000, 1_281_167)}
QUICK = {"coco": (5_000,)}
STARTS, FORMS = ("forkserver", "fork"), ("packed", "objects")
WORKERS, BATCH, WARM, BATCHES = 4, 16, 100, 600


def memory_mib(pid: int) -> dict[str, float]:
    """USS (private clean + dirty) and PSS of a process, MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0])
    return {"uss": (fields["Private_Clean"] + fields["Private_Dirty"]) / 1024, "pss": fields["Pss"] / 1024}


def read_index(kind: str, form: str, path: str):
    """The dataset as ``fit`` reads it; under ``objects`` its index turned back into Python objects,
    the form it had before it was packed (the loading code reads both)."""
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
    index = dataset.records if kind == "coco" else dataset.samples
    packed = round(index.nbytes / 2**20, 1) if form == "packed" else None  # the packed buffers' own size
    return {"to_first_batch_s": round(first_batch_s, 1), "index_in_main_mib": round(index_mib, 1),
            "packed_index_mib": packed,
            "worker_uss_first_mib": round(sum(m["uss"] for m in first) / WORKERS, 1),
            "worker_uss_later_mib": round(sum(m["uss"] for m in later) / WORKERS, 1),
            "worker_pss_later_mib": round(sum(m["pss"] for m in later) / WORKERS, 1),
            "growth": round(sum(m["uss"] for m in later) / sum(m["uss"] for m in first) - 1, 3),
            "growth_after_warm": round(sum(m["uss"] for m in later) / sum(m["uss"] for m in warm) - 1, 3)}


def make(kind: str, root: Path, images: int) -> str:
    """The synthetic set; what ``read_index`` takes."""
    if kind == "coco":
        return str(make_coco(root, images, 80, 7.27))
    make_folder(root, images, classes=min(images, 1000))  # no empty class folder in the baseline
    return str(root)


def with_shares(rows: list[dict]) -> list[dict]:
    """Each row's worker share of the index: its USS after the batches less the baseline worker's
    (same kind, start and form, BASE images), against the index in the main process."""
    base = {(r["data"], r["start"], r["form"]): r["worker_uss_later_mib"] for r in rows if r["images"] == BASE}
    for r in rows:
        if base and r["images"] > BASE:  # --quick has no baseline
            extra = r["worker_uss_later_mib"] - base[r["data"], r["start"], r["form"]]
            r["worker_index_mib"] = round(extra, 1)
            r["share_of_main_index"] = round(extra / r["index_in_main_mib"], 3)
    return rows


def run(quick: bool = False) -> list[dict]:
    """One row per data set, size, start method and form, each loader in a process of its own."""
    rows = []
    for kind, sizes in (QUICK if quick else SIZES).items():
        for images in sizes:
            tmp = Path(tempfile.mkdtemp(prefix="scale-workers-"))
            try:
                path = make(kind, tmp, images)
                for start in STARTS:
                    for form in FORMS:
                        row = {"data": kind, "images": images, "start": start, "form": form,
                               **in_child(__file__, f"{start}:{form}:{kind}:{path}")}
                        rows.append(row)
                        print(json.dumps(row), file=sys.stderr, flush=True)
            finally:
                shutil.rmtree(tmp)
    rows = with_shares(rows)
    if not quick:
        draw_rows(rows)
    return rows


def draw_rows(rows: list[dict]) -> None:
    """Per data set: a worker's USS after the batches against the images, one curve per start and form."""
    panels = []
    for kind in SIZES:
        curves = {}
        for start in STARTS:
            for form in FORMS:
                mine = [r for r in rows if (r["data"], r["start"], r["form"]) == (kind, start, form)]
                curves[f"{start}, {form}"] = ([r["images"] for r in mine], [r["worker_uss_later_mib"] for r in mine])
        panels.append((f"images in the {kind} index", "USS per worker after the batches (MiB)", curves))
    draw(panels, RESULTS / "scale-workers.png", "DataLoader workers' memory: the packed index against Python objects")


if __name__ == "__main__":
    main(__doc__, run, measure, "COCO-shaped, 5,000 images only (no baseline, so no shares)")
