"""The step pipeline: micro-batches in, one (possibly skipped) optimizer update out.

    to device -> autocast -> task losses -> weighted total -> scaled backward (x accum) ->
    unscale -> clip -> after_backward hooks -> optimizer step (masked) -> scaler update -> EMA

Nothing here reads a device value on the host. Whether a step is applied is decided on the device:
``found_inf`` (1.0 when the loss, or the gradient norm where one is computed, is NaN/Inf) is handed
to the fused optimizer — the mechanism GradScaler uses — so the kernel leaves weights and optimizer
state untouched for that step. With a non-fused optimizer the update is undone with ``torch.where``
on the device instead. Each step's scalars go to a ``StepRecorder`` row; the trainer reads the rows
at the next log point, checkpoint or evaluation and applies the policy (``raise`` / ``skip``) then:
at most ``trainer.log_every`` steps after the bad one, and always before anything is written.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

from visiontrain.engine.metrics import StepRecorder
from visiontrain.engine.param_groups import is_fused
from visiontrain.engine.precision import autocast


def to_device(batch: Any, device: torch.device, channels_last: bool = False) -> Any:
    """Recursively move tensors (non_blocking: overlaps with compute when memory is pinned)."""
    if isinstance(batch, torch.Tensor):
        batch = batch.to(device, non_blocking=True)
        if channels_last and batch.ndim == 4:
            batch = batch.contiguous(memory_format=torch.channels_last)
        return batch
    if isinstance(batch, dict):
        return {k: to_device(v, device, channels_last) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, channels_last) for v in batch)
    return batch


class NonFiniteLossError(FloatingPointError):
    """A loss (or gradient) became NaN/Inf under ``trainer.nonfinite=raise``."""


class TrainStep:
    """One optimizer step over ``len(batches)`` micro-batches (gradient accumulation)."""

    def __init__(self, model: nn.Module, losses_fn: Callable[[nn.Module, Any], dict[str, torch.Tensor]],
                 optimizer: torch.optim.Optimizer, *, device: torch.device, precision: str,
                 scaler: torch.amp.GradScaler | None, clip_grad: float | None, clip_mode: str,
                 channels_last: bool, after_backward: Callable[[], None], recorder: StepRecorder) -> None:
        self.model, self.losses_fn, self.optimizer = model, losses_fn, optimizer
        self.device, self.precision, self.scaler = device, precision, scaler
        self.clip_grad, self.clip_mode, self.channels_last = clip_grad, clip_mode, channels_last
        self.after_backward, self.recorder = after_backward, recorder
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.fused = is_fused(optimizer)
        self.found_inf = torch.zeros((), device=device)
        self._one = torch.ones((), device=device)
        self._no_sync = getattr(model, "no_sync", None)  # DDP: skip all-reduce on non-final micro-steps

    def __call__(self, batches: list[Any], weights: dict[str, float]) -> None:
        n = len(batches)
        logged: dict[str, torch.Tensor] = {}
        for i, batch in enumerate(batches):
            batch = to_device(batch, self.device, self.channels_last)
            sync_ctx = self._no_sync() if self._no_sync is not None and i < n - 1 else contextlib.nullcontext()
            with sync_ctx:
                with autocast(self.precision, self.device):
                    losses = self.losses_fn(self.model, batch)
                total = sum(l if weights[k] == 1.0 else l * weights[k] for k, l in losses.items() if k in weights)
                if not isinstance(total, torch.Tensor):
                    raise ValueError(f"no loss term has a weight: terms {sorted(losses)}, "
                                     f"weights {weights} (set task.loss_weights)")
                scaled = total / n if n > 1 else total
                (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
            terms = {k: l.detach() for k, l in losses.items()}
            terms.update({f"{k}_w": terms[k] * weights[k] for k in losses if weights.get(k, 1.0) != 1.0})
            terms["total"] = total.detach()
            logged = terms if i == 0 else {k: logged[k] + v for k, v in terms.items()}
        if n > 1:
            logged = {k: v / n for k, v in logged.items()}

        grad_norm = self._unscale_and_clip()
        self.after_backward()
        # found_inf = 1.0 if the loss (or grad norm) is NaN/Inf: one device kernel, no host read.
        # (GradScaler's own check; "unscaling" by exactly 1.0 leaves the values as they are.)
        checked = [logged["total"]] if grad_norm is None else [logged["total"], grad_norm]
        self.found_inf.zero_()
        torch._amp_foreach_non_finite_check_and_unscale_(checked, self.found_inf, self._one)
        self._masked_step()
        if self.scaler is not None:
            self.scaler.update()  # device-side scale update from the found_inf that unscale_ recorded
        self.optimizer.zero_grad(set_to_none=True)
        if grad_norm is not None:
            logged["grad_norm"] = grad_norm
        self.recorder.record({k: v if v.dtype == torch.float32 else v.float() for k, v in logged.items()})

    def _unscale_and_clip(self) -> torch.Tensor | None:
        """Unscale (fp16), clip, and return the pre-clip global grad norm (None if not needed)."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.clip_grad is None and self.scaler is None:
            return None  # the norm costs a pass over the gradients: only when clipping or fp16
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.device)
        norms = torch._foreach_norm(grads)
        total = torch.linalg.vector_norm(torch.stack(norms))
        if self.clip_grad is not None:
            if self.clip_mode == "norm":  # one coefficient for all (torch.nn.utils.clip_grad_norm_)
                coef = (self.clip_grad / (total + 1e-6)).clamp(max=1.0)
                torch._foreach_mul_(grads, coef)
            else:  # each parameter to its own norm (DINO's clip_gradients)
                coefs = [(self.clip_grad / (nrm + 1e-6)).clamp(max=1.0) for nrm in norms]
                torch._foreach_mul_(grads, coefs)
        return total

    def _masked_step(self) -> None:
        if self.fused:
            self.optimizer.found_inf = self.found_inf  # fused kernels skip the update on the device
            self.optimizer.step()
            return
        # Non-fused optimizers ignore found_inf: keep a copy and restore it where the step is bad.
        bad = self.found_inf.bool()
        old_p = [p.detach().clone() for p in self.params]
        old_s = {id(p): {k: v.clone() for k, v in self.optimizer.state[p].items() if torch.is_tensor(v)}
                 for p in self.params if self.optimizer.state.get(p)}
        fresh = [p for p in self.params if not self.optimizer.state.get(p)]
        self.optimizer.step()
        with torch.no_grad():
            for p, old in zip(self.params, old_p):
                p.copy_(torch.where(bad, old, p))
            for p in self.params:
                for k, old in old_s.get(id(p), {}).items():
                    st = self.optimizer.state[p][k]
                    st.copy_(torch.where(bad, old, st))
        if fresh:
            # State created by this very step cannot be "unmade" on the device; reading the flag
            # here costs one host sync, on the first step of a non-fused optimizer only.
            if bool(bad):  # host sync (first step of a non-fused optimizer only)
                for p in fresh:
                    self.optimizer.state.pop(p, None)
