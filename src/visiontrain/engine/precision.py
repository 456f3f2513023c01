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
