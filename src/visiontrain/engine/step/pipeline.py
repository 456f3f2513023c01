"""The step pipeline: micro-batches in, one (possibly skipped) optimizer update out.

    to device -> the task's device transform -> autocast -> task losses -> weighted total ->
    scaled backward (x accum) -> unscale -> clip -> after_backward hooks -> optimizer step (masked) ->
    scaler update
(the trainer sets the step's schedule values before and updates the EMA after)

Nothing here reads a device value on the host. Each step's scalars go to a ``StepRecorder`` row;
the trainer reads the rows at the next log point, checkpoint or evaluation and applies the
non-finite policy then: at most ``trainer.log_every`` steps after the bad step, and always before
anything is written. Under ``skip`` (and fp16, whose overflow steps must be skipped) whether a
step is applied is decided on the device: ``found_inf`` (1.0 when the loss, or the gradient norm
where one is computed, else any gradient, is NaN/Inf) is handed to the fused optimizer — the mechanism GradScaler
uses — so the kernel leaves weights and optimizer state untouched. A non-fused optimizer's update
is undone with ``torch.where`` on the device instead. Under ``raise`` no mask is needed: the run
stops at the next read and never writes weights from after the bad step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from visiontrain.data.batch_ops import channels_last as to_channels_last
from visiontrain.engine.optim.param_groups import is_fused
from visiontrain.engine.parallel.distributed import grad_sync_paused
from visiontrain.engine.parallel.fsdp import is_sharded, local
from visiontrain.engine.step.metrics import StepRecorder
from visiontrain.engine.step.precision import FP32, PrecisionChoice


def to_device(batch: Any, device: torch.device, channels_last: bool = False) -> Any:
    """Recursively move tensors (non_blocking: overlaps with compute when memory is pinned)."""
    if isinstance(batch, torch.Tensor):
        batch = batch.to(device, non_blocking=True)
        if channels_last and batch.ndim == 4:
            batch = to_channels_last(batch)
        return batch
    if isinstance(batch, dict):
        return {k: to_device(v, device, channels_last) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, channels_last) for v in batch)
    return batch


def weighted_total(losses: dict[str, torch.Tensor], weights: dict[str, float]) -> torch.Tensor:
    """Σ weight[k]·loss[k] over the weighted terms (a weight of 1.0 costs no multiply)."""
    total = None
    for k, l in losses.items():
        w = weights.get(k)
        if w is None:
            continue
        term = l if w == 1.0 else l * w
        total = term if total is None else total + term
    if total is None:
        raise ValueError(f"no loss term has a weight: terms {sorted(losses)}, weights {weights} "
                         f"(set task.loss_weights)")
    return total


@dataclass
class StepOptions:
    """How the step runs: where, in what precision, and the ``trainer`` settings it reads."""
    device: torch.device
    precision: PrecisionChoice = FP32                  # trainer.precision resolved on the device
    scaler: torch.amp.GradScaler | None = None         # fp16's (precision.scaler), else None
    clip_grad: float | None = None
    clip_mode: str = "norm"
    channels_last: bool = False
    mask_nonfinite: bool = True                        # trainer.nonfinite=skip: a bad step is not applied
    fixed_weights: bool = False                        # no schedule changes a loss weight
    placed: bool = False                               # the prefetcher hands batches over on the device
    after_backward: list[Callable[[], None]] = field(default_factory=list)  # gradient hooks, in order


class TrainStep:
    """One optimizer step over ``len(batches)`` micro-batches (gradient accumulation)."""

    def __init__(self, model: nn.Module, losses_fn: Callable[[nn.Module, Any], dict[str, torch.Tensor]],
                 optimizer: torch.optim.Optimizer, options: StepOptions, *, recorder: StepRecorder,
                 on_device: Callable[[Any], Any] | None = None) -> None:
        o, scaler, clip_grad, device = options, options.scaler, options.clip_grad, options.device
        self.model, self.losses_fn, self.optimizer = model, losses_fn, optimizer
        self.on_device = on_device  # the task's batch transform on the device (Task.device_transform)
        self.device, self.precision, self.scaler = device, o.precision, scaler
        self.clip_grad, self.clip_mode, self.channels_last = clip_grad, o.clip_mode, o.channels_last
        self.after_backward, self.recorder = o.after_backward, recorder
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.sharded = is_sharded(self.params)  # FSDP: DTensor parameters and gradients
        self.fused = is_fused(optimizer)
        # Masking costs a device-side check and, in fused Adam, a pass over the step counters: paid
        # under `skip` and fp16 (overflow steps must be skipped); `raise` stops before any write.
        self.mask_nonfinite = o.mask_nonfinite or scaler is not None
        self.needs_norm = clip_grad is not None or scaler is not None  # clipping, or fp16's overflow check
        self._one = torch.ones((), device=device)
        # On the CPU with the default memory format the batch is already where it must be; so is
        # a batch the prefetcher placed (``placed``: on the device, channels_last): moved once.
        self.needs_copy = not o.placed and (device.type != "cpu" or o.channels_last)
        self._no_sync = grad_sync_paused(model)  # DDP/FSDP: no reduction on non-final micro-steps
        self._keys: tuple[str, ...] | None = None
        self._weighted: list[str] = []
        # With weights no schedule changes, a single term of weight 1 *is* the total (weighted_total
        # returns it): its column is logged twice from one recorded value.
        self._fixed_weights = o.fixed_weights
        self._total_is: str | None = None
        self._total_at = 0  # the total's index among a step's recorded values (set with the layout)
        self.names: list[str] = []
        self.columns: list[int] = []

    def __call__(self, batches: list[Any], weights: dict[str, float]) -> None:
        n = len(batches)
        values: list[torch.Tensor] | None = None
        for i, batch in enumerate(batches):
            if self.needs_copy:
                batch = to_device(batch, self.device, self.channels_last)
            if self.on_device is not None:
                batch = self.on_device(batch)
            if self._no_sync is not None and i < n - 1:
                with self._no_sync():
                    losses, total = self._forward_backward(batch, weights, n)
            else:
                losses, total = self._forward_backward(batch, weights, n)
            step_values = self._logged_values(losses, total, weights)
            values = step_values if values is None else [a + b for a, b in zip(values, step_values)]
        if n > 1:
            values = [v / n for v in values]

        grad_norm = self._unscale_and_clip() if self.needs_norm else None
        for fn in self.after_backward:  # gradient hooks (e.g. cancel the last layer's gradients)
            fn()
        # The loss and, where there is one, the gradient norm (else the gradients themselves: a
        # finite loss can still give Inf gradients, and under DDP a NaN loss on one rank reaches the
        # others only through them) are what decide whether a step is skipped.
        total = values[self._total_at]
        if grad_norm is not None:
            values.append(grad_norm)
        self.recorder.record(self.names, values, self.columns)  # this step's row
        if self.mask_nonfinite:
            found_inf = self.recorder.flag()  # 0.0 on the device until the check below sets it
            self._flag_nonfinite([total, grad_norm] if grad_norm is not None else [total, *self._grads()], found_inf)
            self._masked_step(found_inf)
        else:  # `raise`: the trainer stops at the next read, before anything is written
            self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update()  # device-side scale update from the found_inf that unscale_ recorded
        self.optimizer.zero_grad(set_to_none=True)

    def _forward_backward(self, batch: Any, weights: dict[str, float], n: int) -> tuple[dict, torch.Tensor]:
        if self.precision.precision == "fp32":
            losses = self.losses_fn(self.model, batch)
        else:
            with self.precision.autocast(self.device):
                losses = self.losses_fn(self.model, batch)
        total = weighted_total(losses, weights)
        scaled = total / n if n > 1 else total
        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
        return losses, total

    def _logged_values(self, losses: dict[str, torch.Tensor], total: torch.Tensor,
                       weights: dict[str, float]) -> list[torch.Tensor]:
        """Every term, each term whose weight is not 1 times its weight (``<term>_w``), the total
        (unless it is a term: see ``_total_is``); ``self.columns`` maps ``self.names`` to them."""
        keys = tuple(losses)
        if keys != self._keys:
            if self._keys is not None:
                raise ValueError(f"the task's loss terms changed from {list(self._keys)} to {list(keys)}: "
                                 f"losses() must return the same terms every step")
            self._set_layout(keys, weights)
        out = list(map(torch.Tensor.detach, losses.values()))  # (map: no comprehension frame per step)
        for k in self._weighted:
            out.append(losses[k].detach() * weights[k])
        if self._total_is is None:
            out.append(total.detach())
        return out

    def _set_layout(self, keys: tuple[str, ...], weights: dict[str, float]) -> None:
        self._keys = keys
        self._weighted = [k for k in keys if weights.get(k, 1.0) != 1.0]
        self.names = [*keys, *(f"{k}_w" for k in self._weighted), "total"]
        weighted = [k for k in keys if k in weights]
        single = self._fixed_weights and len(weighted) == 1 and weights[weighted[0]] == 1.0
        self._total_is = weighted[0] if single else None
        width = len(keys) + len(self._weighted)
        self._total_at = keys.index(self._total_is) if single else width
        self.columns = list(range(width)) + [self._total_at]
        if self.needs_norm:
            self.names.append("grad_norm")
            self.columns.append(width if single else width + 1)  # recorded after the total

    def _grads(self) -> list[torch.Tensor]:
        """The gradients (under FSDP each rank's local shards of them)."""
        if self.sharded:
            return [local(p.grad) for p in self.params if p.grad is not None]
        return [p.grad for p in self.params if p.grad is not None]

    @torch.no_grad()
    def _flag_nonfinite(self, tensors: list[torch.Tensor], found_inf: torch.Tensor) -> None:
        """found_inf = 1.0 if any tensor holds NaN/Inf: GradScaler's own check kernel ("unscaling"
        by exactly 1.0 leaves the values as they are), one per dtype; no host read. Under FSDP each
        rank checked its shards, so the flag is all-reduced (a collective, not a host read)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, self._one)
        if self.sharded:
            torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX)

    @torch.no_grad()  # (writes through DTensors' local views, which autograd forbids otherwise)
    def _unscale_and_clip(self) -> torch.Tensor:
        """Unscale (fp16), clip, and return the pre-clip global grad norm."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grads = self._grads()
        if not grads:
            return torch.zeros((), device=self.device)
        norms = torch._foreach_norm(grads)
        if self.sharded:  # FSDP: each rank holds a shard of each gradient; one all-reduce, no host read
            squares = torch.stack(norms).square()
            torch.distributed.all_reduce(squares)
            norms = list(squares.sqrt().unbind())
        total = torch.linalg.vector_norm(torch.stack(norms))
        if self.clip_grad is not None:
            if self.clip_mode == "norm":  # one coefficient for all (torch.nn.utils.clip_grad_norm_)
                coef = (self.clip_grad / (total + 1e-6)).clamp(max=1.0)
                torch._foreach_mul_(grads, coef)
            else:  # each parameter to its own norm (DINO's clip_gradients)
                coefs = [(self.clip_grad / (nrm + 1e-6)).clamp(max=1.0) for nrm in norms]
                torch._foreach_mul_(grads, coefs)
        return total

    def _masked_step(self, found_inf: torch.Tensor) -> None:
        if self.fused:
            self.optimizer.found_inf = found_inf  # fused kernels skip the update on the device
            self.optimizer.step()
            return
        # Non-fused optimizers ignore found_inf: keep a copy and restore it where the step is bad.
        # (On local tensors: under FSDP parameters and state are DTensors, and each rank restores its shard.)
        bad = found_inf.bool()
        with torch.no_grad():
            old_p = [local(p).clone() for p in self.params]
            old_s = {id(p): {k: local(v).clone() for k, v in self.optimizer.state[p].items() if torch.is_tensor(v)}
                     for p in self.params if self.optimizer.state.get(p)}
        fresh = [p for p in self.params if not self.optimizer.state.get(p)]
        self.optimizer.step()
        with torch.no_grad():
            for p, old in zip(self.params, old_p):
                local(p).copy_(torch.where(bad, old, local(p)))
            for p in self.params:
                for k, old in old_s.get(id(p), {}).items():
                    st = local(self.optimizer.state[p][k])
                    st.copy_(torch.where(bad, old, st))
        if fresh:
            # State created by this very step cannot be "unmade" on the device; reading the flag
            # here costs one host sync, on the first step of a non-fused optimizer only.
            if bool(bad):  # host sync (first step of a non-fused optimizer only)
                for p in fresh:
                    self.optimizer.state.pop(p, None)
