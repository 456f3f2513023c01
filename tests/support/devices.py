"""The device of the tests marked ``cuda``: the code paths that differ on a GPU.

In the suite (CI has no GPU) they run on the CPU, as every other test. ``benchmarks/gpu_check.py``
runs them again on a GPU machine (``pytest -m cuda`` with ``VISIONTRAIN_REQUIRE_CUDA=1``, so that a
machine whose CUDA does not come up fails instead of quietly testing the CPU twice). Recipe and toy
runs need no override for this: ``trainer.device=auto`` takes the GPU where there is one. The tests
that make tensors themselves put them on ``TEST_DEVICE``.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

REQUIRE_CUDA_ENV = "VISIONTRAIN_REQUIRE_CUDA"
TEST_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_CUDA = TEST_DEVICE.type == "cuda"


def check_required_device() -> None:
    if os.environ.get(REQUIRE_CUDA_ENV) == "1" and not ON_CUDA:
        raise RuntimeError(f"{REQUIRE_CUDA_ENV}=1 but torch.cuda.is_available() is False "
                           f"(torch {torch.__version__}): the cuda-marked tests would run on the CPU")


@contextlib.contextmanager
def deterministic_kernels() -> Iterator[None]:
    """Bit-exact comparisons on CUDA need deterministic kernels (cuDNN's convolution backward and
    cuBLAS pick non-deterministic ones by default; CUBLAS_WORKSPACE_CONFIG is set in conftest,
    before cuBLAS starts). An op with no deterministic CUDA kernel raises instead of differing.
    On the CPU every kernel the tests use already is: nothing changes."""
    if not ON_CUDA:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)
