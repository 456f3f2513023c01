"""The CPU cores a process may use, and how several processes on one machine share them.

A count from ``os.cpu_count()`` is the machine's, which a container's or SLURM's cpuset, a
``taskset``, or a tuner running several trials at once narrows: every choice made from "the cores"
(DataLoader workers, threads, a pool) reads this process's affinity instead."""
from __future__ import annotations

import os


def affinity() -> list[int]:
    """The cores this process may run on, in order (its affinity), or ``range(os.cpu_count())`` where
    the platform has no affinity call (macOS, Windows)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))


def usable_cores() -> int:
    """How many cores this process may run on: its affinity's, not the machine's count."""
    return len(affinity())


def shares(cores: list[int], parts: int) -> list[list[int]]:
    """``cores`` cut into ``parts`` disjoint runs of consecutive cores, the first ones one longer where
    they do not divide evenly (10 cores, 4 parts: 3, 3, 2, 2). With fewer cores than parts, each part
    gets one core, taken in turn (parts share a core only then)."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    if len(cores) < parts:
        return [[cores[i % len(cores)]] for i in range(parts)]
    size, extra = divmod(len(cores), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        out.append(cores[start:end])
        start = end
    return out
