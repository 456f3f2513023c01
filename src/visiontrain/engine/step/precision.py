"""fp32 / bf16 / fp16: which one a run computes in, the autocast context and, for fp16 only, a GradScaler.

``trainer.precision: auto`` (the default, and what the built-in recipes ship) picks by what the device
computes natively: bf16 on a CUDA GPU that has it and on a CPU with AVX512-BF16 or AMX; fp16 with the
scaler on a CUDA GPU without bf16 (fp32 instead where the model is sharded, which the scaler cannot
handle); fp32 otherwise. A CPU without those instructions emulates bf16: autocast is then slower than
fp32 (2.1x on an AVX-512 Xeon without AVX512-BF16, more on AVX2-only CPUs: pytorch#86270, #146508), so
``auto`` never picks it there. ``fp32``, ``bf16`` and ``fp16`` force a choice; a forced one the device
only emulates is said once at start-up.

This module owns what a precision means: :class:`PrecisionChoice` is the resolved choice, and its
methods give the step its autocast context and fp16's scaler, and the out-of-memory advice whether
a lower precision is left to try. Evaluation and ``validate`` compute in fp32 whatever the run trains
in, unless ``eval.precision: train`` asks for the run's own precision (:func:`evaluation_precision`):
by default a metric must not depend on which precision ``auto`` picked on the machine that measured
it, and bf16 keeps 8 bits of a box coordinate (a 400-pixel coordinate to 2 pixels). ``predict`` and
``export`` always compute in fp32.

Native means the instructions, not that a library has a path: oneDNN's own check
(``torch.ops.mkldnn._is_mkldnn_bf16_supported``) is true on any AVX-512 CPU, where its bf16 path is
emulated and slow. :func:`native_low_precision` is the one place this is decided.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ContextManager, Mapping

import torch

from visiontrain.core.config import ConfigError

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: The CPU capabilities (``torch.cpu.get_capabilities()``'s names) that compute each dtype natively:
#: x86's AVX512-BF16 and AMX (Cooper Lake, Sapphire Rapids and later; AMD Zen 4 and later), Arm's
#: BF16 extension (Graviton 3, Neoverse V1 and later); fp16: AVX512-FP16 and AMX-FP16, Arm's FP16
#: arithmetic.
CPU_NATIVE = {"bf16": ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16"),
              "fp16": ("avx512_fp16", "amx_fp16", "fp16_arith")}


@dataclass(frozen=True)
class PrecisionChoice:
    """What a run computes in (``precision``: fp32, bf16 or fp16), what the config asked for
    (``requested``: auto or one of those) and why, in words for the log and the run's records."""
    precision: str
    requested: str
    why: str

    def line(self) -> str:
        how = "chosen by trainer.precision=auto" if self.requested == "auto" else "as trainer.precision sets"
        return f"precision: {self.precision}, {how}: {self.why}"

    def record(self) -> dict[str, str]:
        return {"precision": self.precision, "requested": self.requested, "why": self.why}

    def autocast(self, device: torch.device) -> ContextManager:
        """Autocast for bf16/fp16; fp32 gets a no-op context (no per-step autocast bookkeeping)."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[self.precision])

    def scaler(self, device: torch.device) -> torch.amp.GradScaler | None:
        """fp16 needs loss scaling; bf16 has fp32's exponent range and does not."""
        return torch.amp.GradScaler(device.type) if self.precision == "fp16" else None

    def lower_to_try(self) -> str | None:
        """For a run out of memory: the ``trainer.precision`` that would halve its activations, when
        it computes in fp32 (None when it already computes in 16 bits)."""
        return "bf16" if self.precision == "fp32" else None


#: Full precision, as ``trainer.precision=fp32`` resolves it (a step built by hand, in a benchmark or test).
FP32 = PrecisionChoice("fp32", "fp32", "full precision")


def cpu_capabilities() -> Mapping[str, Any]:
    """This CPU's instruction sets by name (torch's cpuinfo), the same keys on every torch since 2.9;
    before it, the two x86 checks that torch had."""
    if hasattr(torch.cpu, "get_capabilities"):
        return torch.cpu.get_capabilities()
    return {"avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "amx_bf16": torch.cpu._is_amx_tile_supported()}


def native_low_precision(dtype: str, device: torch.device) -> tuple[bool, str]:
    """Whether ``device`` computes ``dtype`` (bf16 or fp16) natively, and what it is, in words."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if dtype == "fp16":
            return True, f"{name} computes fp16"
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return native, f"{name} {'computes bf16' if native else 'has no bf16'}"
    if device.type != "cpu":
        return False, f"{device.type} is not a device visiontrain knows the {dtype} support of"
    caps = cpu_capabilities()
    found = [name for name in CPU_NATIVE[dtype] if caps.get(name)]
    cpu = caps.get("cpu_name") or "this CPU"
    if found:
        return True, f"{cpu} has {', '.join(n.upper() for n in found)}"
    return False, f"{cpu} has no {' or '.join(n.upper() for n in CPU_NATIVE[dtype][:2])}, so {dtype} is emulated"


def choose_precision(requested: str, device: torch.device, *, sharded: bool = False) -> PrecisionChoice:
    """``trainer.precision`` resolved on ``device``. ``sharded``: the model is sharded (FSDP), which
    fp16's gradient scaler cannot handle, so ``auto`` never picks fp16 there, and a forced fp16 is refused."""
    if requested == "fp16" and sharded:
        raise ConfigError("distributed.strategy=fsdp with trainer.precision=fp16: the gradient scaler does not "
                          "handle sharded gradients; use trainer.precision=bf16 or auto")
    if requested != "auto":
        if requested == "fp32":
            return FP32
        native, what = native_low_precision(requested, device)
        why = what if native else f"{what}: slower than fp32 here; trainer.precision=auto picks fp32 on it"
        return PrecisionChoice(requested, requested, why)
    bf16, what = native_low_precision("bf16", device)
    if bf16:
        return PrecisionChoice("bf16", requested, what)
    if device.type == "cuda" and not sharded:
        return PrecisionChoice("fp16", requested, f"{what}; fp16 with a gradient scaler instead")
    if device.type == "cuda":
        return PrecisionChoice("fp32", requested, f"{what}, and a sharded model cannot use fp16's gradient scaler")
    return PrecisionChoice("fp32", requested, what)


def evaluation_precision(setting: str, trained: PrecisionChoice) -> PrecisionChoice:
    """What an evaluation computes in: fp32 (``eval.precision: fp32``, the default: the metric is the
    same whatever ``auto`` picked on this machine), or ``trained``, the run's resolved
    ``trainer.precision`` (``eval.precision: train``: an evaluation as fast as the training step, for a
    recipe whose metric does not move in 16 bits; a label map's argmax does not, a box's coordinates
    may)."""
    return trained if setting == "train" else FP32
