"""fp32 / bf16 / fp16: the autocast context and, for fp16 only, a GradScaler."""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> ContextManager:
    """Autocast for bf16/fp16; fp32 gets a no-op context (no per-step autocast bookkeeping)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[precision])


def make_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """fp16 needs loss scaling; bf16 has fp32's exponent range and does not."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)


def cpu_has_native_bf16() -> bool:
    """Whether oneDNN runs bf16 convolutions and matmuls natively here (AVX512-BF16 or AMX)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def precision_note(precision: str, device: torch.device) -> str | None:
    """On a CPU without bf16 instructions, bf16 autocast is emulated and slower than fp32: a recipe
    that ships bf16 because it halves the step on CPUs that have them says so at start-up here."""
    if precision == "bf16" and device.type == "cpu" and not cpu_has_native_bf16():
        return ("trainer.precision=bf16: this CPU has no native bf16 (AVX512-BF16 / AMX), so autocast emulates it "
                "and is slower than fp32 here; trainer.precision=fp32 trains faster on this machine")
    return None
