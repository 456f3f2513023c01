"""Shared set-up of the test suite.

THE RULE for every test that runs a built-in recipe: a user runs `visiontrain fit RECIPE` with the
recipe as written (its DataLoader workers and their start method, precision, transforms, schedules).
A test may change the run's length and size (tests/shipped.py: trainer.max_steps, data.limit_*,
batch and image sizes) and nothing else without a comment saying why, next to the override. Three
recipes once crashed at their first batch while the whole suite passed, because every detection
test set data.num_workers=0. tests/test_recipes.py runs every recipe as shipped; a test about
something else (a loss, a resume, a reader) may load in-process (data.num_workers=0) for speed, and
says so.
"""
import os
import sys
from pathlib import Path

# Every test process (and the subprocesses the CLI tests start) uses the same thread count:
# bit-exact comparisons between two runs need identical reduction orders.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

torch.set_num_threads(1)

from visiontrain._tv_compat import ensure_torchvision  # noqa: E402

ensure_torchvision()

sys.path.insert(0, str(Path(__file__).parent))
import toy_task  # noqa: E402,F401  (registers the "toy" task used by engine tests)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
