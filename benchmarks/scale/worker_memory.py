"""DataLoader workers' memory through an epoch against the size of the index: each worker's unique
(USS) and proportional (PSS) memory at its first batch and after many batches, with the default
start method (forkserver) and with fork, for COCO-sized detection sets.

The set is synthetic with COCO's shapes (``startup.make_coco``: one tiny JPEG under every file name,
7.27 boxes an image); the loader is the project's (``engine.setup.loaders``: its worker context and
``worker_init_fn``), 2 workers, batches of 16 images drawn at random over the whole set, so that
every worker touches records from all of the index. Linux ``/proc/PID/smaps_rollup``.

    python benchmarks/scale/worker_memory.py [--quick]
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from loglog import RESULTS, draw, in_child, main, rss_kib
from startup import make_coco

SIZES = (10_000, 40_000, 118_287)
QUICK = (5_000,)
WORKERS, BATCH, BATCHES = 2, 16, 300


def memory_mib(pid: int) -> dict[str, float]:
    """USS (private clean + dirty) and PSS of a process, MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0])
    return {"uss": (fields["Private_Clean"] + fields["Private_Dirty"]) / 1024, "pss": fields["Pss"] / 1024}


def measure(spec: str) -> dict:
    """``START:ANNOTATION_FILE``: the loader's workers at their first batch and after BATCHES."""
    start, ann_file = spec.split(":", 1)
    from visiontrain._tv_compat import ensure_torchvision

    ensure_torchvision()
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    from visiontrain.data.detection.coco import read_coco
    from visiontrain.engine.setup.loaders import worker_context
    from visiontrain.process_tree import start_worker

    before = rss_kib()
    dataset = read_coco(ann_file, str(Path(ann_file).parents[1] / "train"))
    index_mib = (rss_kib() - before) / 1024  # what the index holds in the main process
    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=WORKERS, collate_fn=list,
                        worker_init_fn=start_worker, multiprocessing_context=worker_context(start))
    batches = iter(loader)
    next(batches)
    pids = [w.pid for w in batches._workers]  # the iterator's worker processes (torch's own attribute)
    first = [memory_mib(p) for p in pids]
    for _ in range(BATCHES):
        next(batches)
    later = [memory_mib(p) for p in pids]
    del batches
    return {"index_in_main_mib": round(index_mib, 1),
            "worker_uss_first_mib": round(sum(m["uss"] for m in first) / WORKERS, 1),
            "worker_uss_later_mib": round(sum(m["uss"] for m in later) / WORKERS, 1),
            "worker_pss_later_mib": round(sum(m["pss"] for m in later) / WORKERS, 1),
            "growth": round(sum(m["uss"] for m in later) / sum(m["uss"] for m in first) - 1, 3)}


def run(quick: bool = False) -> list[dict]:
    """One row per size and start method, each loader in a process of its own."""
    rows = []
    for images in QUICK if quick else SIZES:
        tmp = Path(tempfile.mkdtemp(prefix="scale-workers-"))
        try:
            ann_file = make_coco(tmp, images, 80, 7.27)
            for start in ("forkserver", "fork"):
                rows.append({"images": images, "start": start, **in_child(__file__, f"{start}:{ann_file}")})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        finally:
            shutil.rmtree(tmp)
    if not quick:
        curves = {f"{s}: {k}": ([r["images"] for r in rows if r["start"] == s], [r[k] for r in rows if r["start"] == s])
                  for s in ("forkserver", "fork") for k in ("worker_uss_later_mib", "worker_pss_later_mib")}
        draw([("images in the index", "MiB per worker, after the batches", curves)], RESULTS / "scale-workers.png")
    return rows


if __name__ == "__main__":
    main(__doc__, run, measure, "5,000 images only")
