"""The ``trainer`` section: how the loop runs (length, precision, accumulation, clipping, device,
compilation) and what it adds to a run (log points, plots, summary, profile, the user's hooks). In
the step's room, the lowest that reads it (the accumulation rules), so that the build, the parts and
the loop above it can read it too."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from visiontrain.core.config import register_section
from visiontrain.core.typed_config import doc


@dataclass
class TrainerConfig:
    epochs: int = doc("number of epochs", 1, minimum=1)
    max_steps: int | None = doc("stop after this many optimizer steps (mid-epoch is fine)", None, minimum=1)
    log_every: int = doc("optimizer steps between log points (the only host syncs)", 50, minimum=1)
    precision: Literal["auto", "fp32", "bf16", "fp16"] = doc(
        "auto: bf16 where the device computes it natively (a CUDA GPU with bf16, a CPU with AVX512-BF16 or AMX), "
        "fp16 with a GradScaler on a CUDA GPU without bf16, fp32 otherwise; said at start-up and recorded in "
        "provenance.json and summary.json. fp32 | bf16 | fp16 force the autocast dtype (fp16 adds a GradScaler)",
        "auto")
    accum_steps: int = doc("micro-batches per optimizer step (gradient accumulation)", 1, minimum=1)
    accum_after_epoch: int = doc("use accum_steps from this epoch on; before it 1", 0, minimum=0)
    clip_grad: float | None = doc("gradient clipping threshold (None = off)", None)
    clip_mode: Literal["norm", "param"] = doc(
        "norm: global L2 norm (DETR, cvnets); param: each parameter's norm (DINO)", "norm")
    nonfinite: Literal["raise", "skip"] = doc(
        "on a non-finite loss: raise at the next log point, or skip the update and go on", "raise")
    device: str = doc("auto | cpu | cuda | cuda:N", "auto")
    channels_last: bool = doc("channels_last memory format for model and images (under FSDP the images only)", False)
    compile: bool = doc("torch.compile the model", False)
    threads: int | None = doc("torch intra-op threads (None = torch default)", None)
    sync_bn: bool = doc("under DDP, convert BatchNorm layers to SyncBatchNorm (batch statistics over all ranks)",
                        False)
    progress: Literal["auto", "bar", "plain"] = doc("rich bar on a terminal, plain lines otherwise", "auto")
    plots: bool = doc("after each evaluation and at the end, draw the curves and the task's figures into "
                      "RUN_DIR/plots/*.png (figures also to TensorBoard); at the start of a run, the first "
                      "training batch (train_batch.png) and the training labels (labels.png, detection)", True)
    summary: bool = doc("at the start of a run, log the parameters per top-level module and the FLOPs per sample "
                        "(also RUN_DIR/model_summary.json)", True)
    profile: bool = doc("write a torch.profiler trace of a few steps to RUN_DIR/profile (trace.json, summary.txt)",
                        False)
    profile_start: int = doc("profile: steps done before the window opens (warm-up)", 5, minimum=0)
    profile_steps: int = doc("profile: optimizer steps in the window", 5, minimum=1)
    hooks: list[str] = doc("hooks of your own, each 'package.module:ClassName': a subclass of visiontrain.Hook "
                           "built without arguments, found on sys.path or in the current directory; one with a "
                           "cadence runs periodically, one with state_dict is in every checkpoint "
                           "(docs/custom-task.md)", factory=list)


register_section("trainer", TrainerConfig, "trainer section")
