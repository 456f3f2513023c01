"""The cores a process may use (its affinity) and how tune's jobs share them (core/cores.py)."""
from __future__ import annotations

import os

import pytest

from visiontrain.core.cores import affinity, shares, usable_cores


@pytest.mark.parametrize("count,parts,sizes", [(16, 4, [4, 4, 4, 4]), (10, 4, [3, 3, 2, 2]), (2, 2, [1, 1]),
                                               (7, 1, [7]), (3, 2, [2, 1])])
def test_shares_are_disjoint_runs_covering_every_core(count, parts, sizes):
    cores = [2 * c + 1 for c in range(count)]  # an affinity need not start at 0 nor be contiguous
    cut = shares(cores, parts)
    assert [len(s) for s in cut] == sizes
    assert [c for s in cut for c in s] == cores  # in order, each core once


def test_more_parts_than_cores_take_the_cores_in_turn():
    assert shares([4, 5], 5) == [[4], [5], [4], [5], [4]]


def test_zero_parts_is_refused():
    with pytest.raises(ValueError, match="parts must be at least 1"):
        shares([0, 1], 0)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux: the affinity call")
def test_the_count_is_the_affinity_not_the_machine():
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert affinity() == [min(before)] and usable_cores() == 1
    finally:
        os.sched_setaffinity(0, before)
