"""Scale, the resume position: how long a resumed run's sampler takes to find its first batch.

    python benchmarks/scale/resume_position.py [--quick] [--out benchmarks/results/scale-resume]

A checkpoint holds the epoch and the step in it; a resumed run hands both to its sampler
(``LoaderSource.batches(epoch, start_batch)``), which draws that epoch's permutation and starts at
the batch, replaying nothing. Timed here, on an ImageNet-sized set (1,281,167 samples) over 8
ranks, rank 3, 32 samples a batch on each (a global batch of 256, so an epoch is 5,004 steps):
from ``set_epoch`` to the first batch in hand, at steps 10^4, 10^5, 10^6 and 10^7, for
- ``ResumableBatchSampler`` (classification, DINO),
- ``GroupedBatchSampler`` (detection: batches of one orientation; a third of the images portrait),
  and, side by side, the walk it used before (a Python loop over every sample of the epoch),
- and the epoch's permutation alone (``torch.randperm`` of 1,281,167), the floor of both.
A second axis holds the step at 10^7 and grows the set (1/8, 1/4, 1/2, all of ImageNet): the
positioning is one epoch's work, linear in the set and constant in the step. Each time is the best
of 3. The table is printed, the costs drawn on log-log axes (OUT.png), the rows written to OUT.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from records import RESULTS, slopes  # noqa: E402  (the sibling benchmark's slope fit)

IMAGENET, RANKS, RANK, BATCH = 1_281_167, 8, 3, 32
STEPS = (10_000, 100_000, 1_000_000, 10_000_000)
TARGET_S = 0.1  # the target for positioning at step 10,000,000


def best_of(fn: Callable[[], Any], repeat: int = 3) -> float:
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return min(seconds)


def walked_batches(sampler: Any, epoch: int) -> list[list[int]]:
    """The grouped sampler's batches as it made them before: each sample of the epoch's order joins
    its group's open batch in a Python loop (the old path, kept to measure against)."""
    group_ids = sampler.group_ids.tolist()
    order = torch.randperm(sampler.num_samples, generator=torch.Generator().manual_seed(
        sampler.seed * 1_000_003 + epoch)).tolist()
    open_batches: dict[int, list[int]] = {}
    full: list[list[int]] = []
    for i in order:
        batch = open_batches.setdefault(group_ids[i], [])
        batch.append(i)
        if len(batch) == sampler.batch_size:
            full.append(batch)
            open_batches[group_ids[i]] = []
    return full[sampler.rank::sampler.world_size][: sampler.batches_per_epoch]


def first_batch(sampler: Any, step: int) -> Callable[[], Any]:
    """Position ``sampler`` at optimizer step ``step`` (one batch a step) and take the first batch."""
    def position() -> Any:
        epoch, start_batch = divmod(step, sampler.batches_per_epoch)
        sampler.set_epoch(epoch, start_batch=start_batch)
        return next(iter(sampler))
    return position


def samplers(samples: int) -> dict[str, Any]:
    from visiontrain.data.samplers import GroupedBatchSampler, ResumableBatchSampler

    groups = [int(i % 3 == 0) for i in range(samples)]  # a third portrait, as in COCO
    return {"resumable": ResumableBatchSampler(samples, BATCH, seed=0, rank=RANK, world_size=RANKS),
            "grouped": GroupedBatchSampler(groups, BATCH, seed=0, rank=RANK, world_size=RANKS)}


def measure(samples: int, step: int, axis: str, size: int, walk: bool) -> list[dict[str, Any]]:
    """The positioning costs at one point: both samplers, the permutation, and the old walk when asked."""
    built = samplers(samples)
    costs = {name: best_of(first_batch(s, step)) for name, s in built.items()}
    grouped = built["grouped"]
    if walk:
        costs["grouped, walk (before)"] = best_of(lambda: walked_batches(grouped, step // grouped.batches_per_epoch))
    costs["randperm (one epoch)"] = best_of(lambda: torch.randperm(samples, generator=torch.Generator().manual_seed(1)))
    epoch = step // built["resumable"].batches_per_epoch
    return [{"axis": axis, "size": size, "cost": name, "seconds": round(s, 5), "epoch": epoch}
            for name, s in costs.items()]


def run(quick: bool) -> list[dict[str, Any]]:
    """The rows: against the step (ImageNet), then against the set's size (step 10^7). ``quick``
    leaves out the old walk but at the largest step (it takes seconds a point)."""
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    for step in STEPS:
        rows += measure(IMAGENET, step, "step", step, walk=not quick or step == STEPS[-1])
    for part in (8, 4, 2):
        samples = IMAGENET // part
        rows += measure(samples, STEPS[-1], "samples", samples, walk=not quick)
    rows += [dict(r, axis="samples", size=IMAGENET) for r in rows if r["axis"] == "step" and r["size"] == STEPS[-1]]
    return rows


def table(rows: list[dict[str, Any]], axis: str) -> str:
    costs = list(dict.fromkeys(r["cost"] for r in rows if r["axis"] == axis))
    value = {(r["size"], r["cost"]): r for r in rows if r["axis"] == axis}
    sizes = sorted({size for size, _ in value})
    lines = [f"| {axis} | epoch | " + " | ".join(f"{c} (s)" for c in costs) + " |",
             "|---:|---:|" + "---:|" * len(costs)]
    for size in sizes:
        cells = [f"{value[(size, c)]['seconds']:.4f}" if (size, c) in value else "-" for c in costs]
        epoch = next(r["epoch"] for (s, _), r in value.items() if s == size)
        lines.append(f"| {size:,} | {epoch:,} | " + " | ".join(cells) + " |")
    fitted = slopes([r for r in rows if r["axis"] == axis])
    lines.append("| log-log slope | | " + " | ".join(f"{fitted[c]:.2f}" if c in fitted else "-" for c in costs) + " |")
    return "\n".join(lines)


def draw(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, axis, label in zip(axes, ("step", "samples"), ("the step resumed at (1,281,167 samples)",
                                                           "samples in the set (resumed at step 10^7)")):
        picked = [r for r in rows if r["axis"] == axis]
        for cost, slope in slopes(picked).items():
            points = sorted((r["size"], r["seconds"]) for r in picked if r["cost"] == cost)
            ax.plot(*zip(*points), marker="o", label=f"{cost} (slope {slope:.2f})")
        ax.axhline(TARGET_S, color="gray", linestyle="--", linewidth=0.8, label=f"target {TARGET_S} s")
        ax.set(xscale="log", yscale="log", xlabel=label, ylabel="seconds to the first batch")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"the resume position: rank {RANK} of {RANKS}, {BATCH} samples a batch")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the old walk at the largest step only")
    parser.add_argument("--out", type=Path, default=RESULTS / "scale-resume", help="OUT.png and OUT.json")
    args = parser.parse_args()
    rows = run(args.quick)
    print(table(rows, "step"), table(rows, "samples"), sep="\n\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    draw(rows, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
