"""Shared set-up of the test suite.

THE RULE for every test that runs a built-in recipe: a user runs `visiontrain fit RECIPE` with the
recipe as written (its DataLoader workers and their start method, precision, transforms, schedules).
A test may change the run's length and size (tests/support/shipped.py: trainer.max_steps, data.limit_*,
batch and image sizes) and nothing else without a comment saying why, next to the override. Three
recipes once crashed at their first batch while the whole suite passed, because every detection
test set data.num_workers=0. tests/app/test_recipes.py runs every recipe as shipped; a test about
something else (a loss, a resume, a reader) may load in-process (data.num_workers=0) for speed, and
says so.
"""
import fcntl
import os
import shutil
import sys
from pathlib import Path
from typing import Callable

# Every test process (and the subprocesses the CLI tests start) uses the same thread count:
# bit-exact comparisons between two runs need identical reduction orders.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# cuBLAS reads this when it starts: with it, deterministic kernels (tests/support/devices.py) can be asked for
# on CUDA. It changes nothing on the CPU.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest
import torch

torch.set_num_threads(1)

from visiontrain.core._tv_compat import ensure_torchvision  # noqa: E402

ensure_torchvision()

sys.path.insert(0, str(Path(__file__).parent / "support"))  # the helpers the tests import by name
import toy_task  # noqa: E402,F401  (registers the "toy" task used by engine tests)
import registries  # noqa: E402

if os.environ.get("VISIONTRAIN_TOLERANCE_LOG"):  # what each float tolerance absorbed here (tests/support/tolerance_log.py)
    import tolerance_log  # noqa: E402

    tolerance_log.install(os.environ["VISIONTRAIN_TOLERANCE_LOG"])
from devices import check_required_device  # noqa: E402

check_required_device()


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "cuda: a code path that differs on a GPU; benchmarks/gpu_check.py runs "
                                       "these on CUDA (tests/support/devices.py)")


@pytest.fixture(autouse=True)
def _registries_as_they_were():
    """A test may register a task, a data kind, a section, a part or a tracker of its own: after it,
    the registries are as they were before it (they are the process's; tests/support/registries.py)."""
    before = registries.snapshot()
    yield
    registries.restore(before)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    """A directory every pytest-xdist worker of this session sees (the parent of each worker's own
    base temp); the main process's base temp when the suite runs in one process."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_once(shared: Path, name: str, build: Callable[[Path], None]) -> Path:
    """``shared/name``, built by ``build(path)`` by the first worker of the session that asks, under a
    file lock; the others wait for it and use the same directory. A fixture trained once per
    session, not once per worker. Its users read it, or copy it before they change it."""
    done, lock = shared / name / ".built", shared / f"{name}.lock"
    shared.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if not done.is_file():
            if (shared / name).exists():
                shutil.rmtree(shared / name)  # a build that failed part-way in another worker
            build(shared / name)
            done.touch()
    return shared / name


@pytest.fixture(scope="session")
def mosaic_coco(shared_dir) -> Callable[..., Path]:
    """``mosaic_coco(train_images, val_images, classes=None)``: a small fashion-mosaic laid out as COCO
    (``annotations/instances_<split>.json``, ``<split>/*.png``; ``classes`` keeps the first N categories),
    built once a session for each size, whichever worker asks first. Its users read it, never write in it."""
    from detection_helpers import mosaic_coco_at

    def tree(train_images: int, val_images: int, classes: int | None = None) -> Path:
        name = f"mosaic-coco-{train_images}-{val_images}" + (f"-{classes}-classes" if classes else "")
        build = lambda out: mosaic_coco_at(out / "mosaic", out / "coco", train_images, val_images, classes)  # noqa: E731
        return build_once(shared_dir, name, build) / "coco"

    return tree


# One tiny trained checkpoint per family, shared by the export and inference tests (built once a
# session, whichever worker asks first). Their subject is what is done with a checkpoint, so the
# runs are as short and small as a checkpoint allows.
@pytest.fixture(scope="session")
def classify_checkpoint(shared_dir) -> Path:
    """A 2-step classify-fashion fit on digits, with an EMA."""
    from procs import cli_here

    def fit(out: Path) -> None:  # in this process: classify-fashion loads in-process (data.num_workers: 0)
        proc = cli_here("fit", "classify-fashion", "data.name=digits", "trainer.max_steps=2", "schedules.lr.warmup=0",
                        "ema.enabled=true", "--run-dir", str(out / "run"))
        assert proc.returncode == 0, proc.stderr[-3000:]

    return build_once(shared_dir, "classify-checkpoint", fit) / "run" / "checkpoints" / "last.pt"


@pytest.fixture(scope="session")
def rcnn_checkpoint(shared_dir, mosaic_coco) -> Path:
    """A 2-step Faster R-CNN fit on a 4/2-image fashion-mosaic laid out as COCO; a smaller network,
    loaded in-process and a one-step burn-in, because the subject is what is done with its checkpoint."""
    from procs import cli_here

    def fit(out: Path) -> None:  # in this process: data.num_workers=0
        root = mosaic_coco(4, 2)
        proc = cli_here("fit", "detect-faster-rcnn", "data.name=coco", f"data.root={root}", "data.batch_size=2",
                        "data.num_workers=0", "task.fpn_channels=32", "task.representation_size=64",
                        "task.train_scales=[96]", "task.val_size=96", "task.max_size=128", "trainer.max_steps=2",
                        "schedules.lr.warmup=1", "--run-dir", str(out / "run"))
        assert proc.returncode == 0, proc.stderr[-3000:]

    return build_once(shared_dir, "rcnn-checkpoint", fit) / "run" / "checkpoints" / "last.pt"
