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
