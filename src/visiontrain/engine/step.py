"""The step pipeline: micro-batches in, one (possibly skipped) optimizer update out.

    to device -> autocast -> task losses -> weighted total -> scaled backward (x accum) ->
    unscale -> clip -> after_backward hooks -> optimizer step (masked) -> scaler update -> EMA

Nothing here reads a device value on the host. Whether a step is applied is decided on the device:
``bad`` (loss or gradients non-finite) is handed to the fused optimizer as ``found_inf`` — the
mechanism GradScaler uses — so the kernel leaves weights and state untouched for that step. With a
non-fused optimizer the update is undone with ``torch.where`` on the device instead. The policy
(``raise`` / ``skip``) is acted on by the trainer at the next log point, checkpoint or evaluation:
at most ``trainer.log_every`` steps after the bad one, and always before anything is written.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

from visiontrain.engine.metrics import DeviceMeter
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
    """One optimizer step over ``accum`` micro-batches. Holds the device-side counters the
    non-finite policy needs; see the module docstring."""

    def __init__(self, model: nn.Module, losses_fn: Callable[[nn.Module, Any], dict[str, torch.Tensor]],
                 optimizer: torch.optim.Optimizer, *, device: torch.device, precision: str,
                 scaler: torch.amp.GradScaler | None, clip_grad: float | None, clip_mode: str,
                 channels_last: bool, after_backward: Callable[[], None], meter: DeviceMeter) -> None:
        self.model, self.losses_fn, self.optimizer = model, losses_fn, optimizer
        self.device, self.precision, self.scaler = device, precision, scaler
        self.clip_grad, self.clip_mode, self.channels_last = clip_grad, clip_mode, channels_last
        self.after_backward, self.meter = after_backward, meter
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.fused = is_fused(optimizer)
        # Non-finite bookkeeping, all on the device: [bad steps, fp16 overflow skips, first bad step].
        self.counters = torch.zeros(3, dtype=torch.float64, device=device)
        self.counters[2] = -1
        self.first_bad_losses: torch.Tensor | None = None
        self.loss_names: list[str] = []
        self._no_sync = getattr(model, "no_sync", None)  # DDP: skip all-reduce on non-final micro-steps

    def __call__(self, batches: list[Any], weights: dict[str, float], step: int) -> None:
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
            for k, l in losses.items():
                logged[k] = l.detach() if i == 0 else logged[k] + l.detach()
                if k in weights and weights[k] != 1.0:
                    wk = f"{k}_w"
                    logged[wk] = l.detach() * weights[k] + (logged[wk] if i else 0)
            logged["total"] = total.detach() if i == 0 else logged["total"] + total.detach()
        if n > 1:
            logged = {k: v / n for k, v in logged.items()}

        grad_norm = self._unscale_and_clip()
        self.after_backward()
        bad_loss = ~torch.isfinite(logged["total"])
        bad = bad_loss if grad_norm is None else bad_loss | ~torch.isfinite(grad_norm)
        self._masked_step(bad)
        if self.scaler is not None:
            self.scaler.update()  # device-side scale update from the found_inf that unscale_ recorded
        self.optimizer.zero_grad(set_to_none=True)

        self._track_nonfinite(bad, bad_loss, logged, step)
        if grad_norm is not None:
            logged["grad_norm"] = grad_norm
        self.meter.add(logged)

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

    def _masked_step(self, bad: torch.Tensor) -> None:
        if self.fused:
            self.optimizer.found_inf = bad.to(torch.float32)  # fused kernels skip the update on device
            self.optimizer.step()
            return
        # Non-fused optimizers ignore found_inf: keep a copy and restore it where `bad` is set.
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
            # once here costs one host sync on the optimizer's first step only.
            if bool(bad):  # host sync (first step of a non-fused optimizer only)
                for p in fresh:
                    self.optimizer.state.pop(p, None)

    def _track_nonfinite(self, bad: torch.Tensor, bad_loss: torch.Tensor,
                         logged: dict[str, torch.Tensor], step: int) -> None:
        if self.first_bad_losses is None:
            self.loss_names = [k for k in logged]
            self.first_bad_losses = torch.zeros(len(self.loss_names), device=self.device)
        overflow = bad & ~bad_loss if self.scaler is not None else torch.zeros_like(bad)
        real_bad = bad & ~overflow
        first = real_bad & (self.counters[2] < 0)
        self.counters += torch.stack([real_bad, overflow, first]).to(self.counters.dtype) * \
            torch.tensor([1.0, 1.0, step + 1.0], dtype=self.counters.dtype, device=self.device)
        vals = torch.stack([logged[k].float().reshape(()) for k in self.loss_names])
        torch.where(first, vals, self.first_bad_losses, out=self.first_bad_losses)

    def read_nonfinite(self) -> tuple[int, int, int | None, dict[str, float]]:
        """(bad steps, fp16 overflow skips, first bad step or None, its loss terms). Host sync."""
        host = torch.cat([self.counters, self.first_bad_losses.double()
                          if self.first_bad_losses is not None else self.counters[:0]]).tolist()  # host sync
        first = int(host[2])
        return int(host[0]), int(host[1]), (first if first >= 0 else None), dict(zip(self.loss_names, host[3:]))

    def state_dict(self) -> dict[str, Any]:
        return {"counters": self.counters.clone(), "loss_names": list(self.loss_names),
                "first_bad_losses": self.first_bad_losses}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counters.copy_(state["counters"])
        self.loss_names = list(state["loss_names"])
        fbl = state["first_bad_losses"]
        self.first_bad_losses = fbl.to(self.device) if fbl is not None else None
