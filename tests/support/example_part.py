"""An example of growing the engine by a part: a stateful duty every N optimizer steps, with its own
config section.

Adding it takes this file and one registration, :func:`register` (tests/engine/test_parts.py calls it in a
fixture)::

    register_part(WeightTrail.for_run, section=("weight_trail", WeightTrailConfig, WEIGHT_TRAIL_DOC))

The trainer, the checkpointer and core/config.py stay as they are. Its section is a recipe's
``weight_trail:`` (``weight_trail.every=4`` on the command line), listed by ``show-config --docs``;
its record is in every checkpoint under ``weight_trail`` and continues on resume, and its count is a key
of summary.json.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from visiontrain.core.config import doc
from visiontrain.engine.loop.assembly import PartFactory, register_part
from visiontrain.engine.protocols.cadence import Cadence
from visiontrain.engine.protocols.part import Part

WEIGHT_TRAIL_DOC = "weight trail section: the sum of the model's weights, every N steps"


@dataclass
class WeightTrailConfig:
    """The part's own section: how often it records."""

    every: int = doc("optimizer steps between two records of the weights' sum (and one at the end)", 3, minimum=1)


class WeightTrail(Part):
    """Every ``weight_trail.every`` steps and at the end: the step and the sum of the model's weights (a
    host sync, on a sparse cadence)."""

    name = "weight_trail"

    def __init__(self, settings: WeightTrailConfig, model: torch.nn.Module) -> None:
        self.cadence = Cadence(every=settings.every, unit="steps", at_end=True)
        self.model = model
        self.trail: list[tuple[int, float]] = []

    @classmethod
    def for_run(cls, trainer: Any) -> "WeightTrail":
        return cls(trainer.cfg.weight_trail, trainer.raw_model)

    def run(self, epoch_end: bool = False) -> None:
        total = torch.stack([p.detach().sum() for p in self.model.parameters()]).sum()
        self.trail.append((self.trainer.step, total.item()))  # host sync (every N steps)

    def summary(self) -> dict[str, Any]:
        """Its key of summary.json: the records over the whole run (a resumed run's included)."""
        return {"weight_trail_records": len(self.trail)}

    def state_dict(self) -> dict[str, Any]:
        return {"steps": [s for s, _ in self.trail], "sums": [v for _, v in self.trail]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.trail = list(zip(state["steps"], state["sums"]))


def register() -> PartFactory:
    """The one registration: the part, in every run made from now on, and its section."""
    return register_part(WeightTrail.for_run, section=("weight_trail", WeightTrailConfig, WEIGHT_TRAIL_DOC))
