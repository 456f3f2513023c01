"""Hooks as a user writes them, named by ``trainer.hooks`` in tests/engine/test_user_hooks.py."""
from __future__ import annotations

from typing import Any

from visiontrain import Cadence, Hook


class LossEveryFour(Hook):
    """Every 4 optimizer steps: the step and the learning rate it trained with, kept across resumes."""

    cadence = Cadence(every=4)

    def __init__(self) -> None:
        self.seen: list[list[float]] = []

    def periodic(self) -> None:
        self.seen.append([self.trainer.step, self.trainer.optimizer.param_groups[0]["lr"]])

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seen = [list(row) for row in state["seen"]]


class CountsEvaluations(Hook):
    """A hook with state and no cadence: the evaluations it was told of."""

    def __init__(self) -> None:
        self.evaluations = 0

    def after_eval(self, metrics: dict[str, Any]) -> None:
        self.evaluations += 1

    def state_dict(self) -> dict[str, Any]:
        return {"evaluations": self.evaluations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.evaluations = int(state["evaluations"])


class NotAHook:
    pass


class NeedsArguments(Hook):
    def __init__(self, every: int) -> None:
        self.every = every
