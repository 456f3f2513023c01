"""An example of growing the engine by a part: a stateful duty every 3 optimizer steps.

Adding it takes this file and one registration, ``register_part(WeightTrail.for_run)``
(tests/test_parts.py does it in a fixture); the trainer, the checkpointer and config.py stay as
they are. Its record is in every checkpoint under ``weight_trail`` and continues on resume.
"""
from __future__ import annotations

from typing import Any

import torch

from visiontrain.engine.protocols.cadence import Cadence
from visiontrain.engine.protocols.part import Part


class WeightTrail(Part):
    """Every 3 steps and at the end: the step and the sum of the model's weights (a host sync, on a
    sparse cadence)."""

    name = "weight_trail"
    cadence = Cadence(every=3, unit="steps", at_end=True)

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.trail: list[tuple[int, float]] = []

    @classmethod
    def for_run(cls, trainer: Any) -> "WeightTrail":
        return cls(trainer.raw_model)

    def run(self, epoch_end: bool = False) -> None:
        total = torch.stack([p.detach().sum() for p in self.model.parameters()]).sum()
        self.trail.append((self.trainer.step, total.item()))  # host sync (every 3 steps)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": [s for s, _ in self.trail], "sums": [v for _, v in self.trail]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trail = list(zip(state["steps"], state["sums"]))
