"""A crash at a chosen step, for the resume tests: a hook that dies as step ``k`` starts (after step
k-1's checkpoint was written), as a kill would, without killing the test's process."""
from __future__ import annotations

from visiontrain import Hook


class Crash(Exception):
    pass


class CrashAt(Hook):
    """Dies at the start of step ``k``."""

    def __init__(self, k: int) -> None:
        self.k = k

    def before_step(self) -> None:
        if self.trainer.step == self.k:
            raise Crash(self.k)
