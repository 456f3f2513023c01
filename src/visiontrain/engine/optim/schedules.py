"""Per-iteration schedules for any named scalar (lr, weight decay, momentum, EMA decay, ...).

Every schedule is a pure function of the global optimizer step. Nothing is stepped or
stored between calls, so resuming from a checkpoint only needs the step counter: a
resumed run cannot drift away from an uninterrupted one.

Semantics (``W`` = warmup in steps, ``T`` = total steps of the run):

* Warmup: linear from ``warmup_start`` (default 0.0) at step 0 to the main schedule's
  starting value at step ``W`` (that is ``base``; for ``multistep`` with a milestone
  inside the warmup it is the already-decayed value, so the curve never jumps).
  ``warmup_factor`` instead starts it at that fraction of the value it ramps to
  (seamseg's burn-in from a third of the lr): relative, so it stays right when the lr
  is overridden or scaled by ``optim.base_batch``. ``warmup_inclusive`` makes the warmup
  ``np.linspace(warmup_start, base, ceil(W))``: its last step, ``ceil(W) - 1``, already has
  the target value (DINO's ``utils.cosine_scheduler``); a one-step warmup is ``warmup_start``.
  ``warmup_shape: cosine`` rises along a half cosine instead of a line, as OneCycleLR's
  ``anneal_strategy='cos'`` does (not with ``warmup_inclusive``).
  ``warmup_min_steps`` floors a warmup (one with ``warmup > 0``) at that many optimizer steps:
  half an epoch is 125 steps on 2,000 images and 2.5 on 40, too few to bring a high lr in
  (detectron2's ``WARMUP_ITERS`` and seamseg's burn-in are counted in iterations for that reason).
  A warmup longer than the run is allowed (a smoke run, a step budget): the run ends still
  in its warmup, and the engine says so once at start-up.
* The main schedule runs over ``[W, T]`` with ``t = (step - W) / (T - W)``, so cosine,
  linear and poly reach ``end`` exactly at ``T``. At ``step >= T`` the value is clamped
  to the value at ``T``.
* ``constant``: ``base``.
* ``cosine``: ``end + (base - end) * (1 + cos(pi * t)) / 2``.
* ``linear``: ``base + (end - base) * t``.
* ``poly``: ``end + (base - end) * (1 - t) ** power``.
* ``step``: ``base * gamma ** floor((step - W) / S)``, ``S`` = ``step_size`` in steps (> 0).
  With ``unit: epochs`` the decays fall at epochs ``warmup + k * step_size`` mapped
  through the clock (the same thing when steps per epoch never change).
* ``multistep``: ``base * gamma ** (number of milestones <= step)``. Milestones are
  absolute, measured from step 0 and not from the end of warmup, like torch's
  ``MultiStepLR`` epochs in published recipes.
* ``end`` defaults to 0.0 and may be above ``base`` (weight decay 0.04 -> 0.4, EMA
  0.996 -> 1.0).
* ``unit: epochs`` converts warmup, milestones and step_size with :class:`StepClock`, so
  epoch 3 means the first optimizer step of epoch 3, also when gradient accumulation
  changes the number of optimizer steps per epoch partway through the run.
* ``unit: run`` reads warmup, milestones and step_size as fractions of the run's optimizer steps
  (``warmup: 0.3`` is OneCycleLR's ``pct_start=0.3``), so a recipe keeps its shape when
  ``trainer.epochs`` is overridden.
* ``per_epoch`` (with ``unit: epochs``): one value per epoch, as schedules indexed by the
  epoch are written (DINO's teacher temperature). Every formula above is evaluated at the
  epoch index ``e`` in place of the step, with ``W``, milestones, ``S`` and ``T`` in epochs.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import Callable, Literal, get_args

from visiontrain.core.config import register_section
from visiontrain.core.typed_config import doc


ScheduleShape = Literal["constant", "cosine", "linear", "step", "multistep", "poly"]
ScheduleUnit = Literal["steps", "epochs", "run"]
#: What ``schedules.<name>`` may name besides ``loss.<term>`` and ``task.<scalar>``: the engine's own scalars.
SCHEDULED_SCALARS: tuple[str, ...] = ("lr", "weight_decay", "momentum", "ema_decay", "bn_momentum")


@dataclass
class ScheduleConfig:
    """One named scalar's schedule, as written in YAML.

    ``schedules.<name>: {shape: cosine, end: 2e-4, warmup: 20000, warmup_start: 2e-4,
    unit: steps}``. Fields a shape does not use are ignored.
    """

    shape: ScheduleShape = doc("constant | cosine | linear | step | multistep | poly", "constant")
    end: float | None = doc("final value of cosine/linear/poly (default 0)", None)
    milestones: list[float] = doc("multistep: where value *= gamma, in `unit`", factory=list)
    step_size: float = doc("step: value *= gamma every step_size units", 0.0)
    gamma: float = doc("decay factor of step / multistep", 0.1)
    power: float = doc("exponent of poly", 0.9)
    warmup: float = doc("warmup length in `unit` (0 = none)", 0.0)
    warmup_min_steps: int = doc(
        "a warmup (warmup > 0) lasts at least this many optimizer steps: one given in epochs or as a fraction of "
        "the run shrinks with the data, and on a few dozen images it is over in a few steps (detectron2 and "
        "seamseg count theirs in iterations)", 0, minimum=0)
    warmup_shape: Literal["linear", "cosine"] = doc(
        "linear, or cosine: the half-cosine rise of OneCycleLR (anneal_strategy='cos')", "linear")
    warmup_start: float | None = doc("value at step 0 of the warmup (default 0)", None)
    warmup_factor: float | None = doc("warmup starts at this fraction of the value it ramps to (instead of "
                                      "warmup_start)", None)
    unit: ScheduleUnit = doc("steps | epochs | run (a fraction of the run's optimizer steps, as OneCycleLR's "
                             "pct_start): unit of warmup, milestones, step_size", "steps")
    base: float | None = doc("start value of the main schedule (default: the configured value, e.g. optim.lr)", None)
    warmup_inclusive: bool = doc("warmup = np.linspace(start, base, W): base at its last step W-1 (DINO), not at "
                                 "step W", False)
    per_epoch: bool = doc("one value per epoch, the formulas taken at the epoch index (needs unit: epochs)", False)


register_section("schedules", dict[str, ScheduleConfig], f"per-step schedules: {', '.join(SCHEDULED_SCALARS)}, "
                 "loss.<term>, task.<scalar>")

SHAPES: tuple[str, ...] = get_args(ScheduleShape)
UNITS: tuple[str, ...] = get_args(ScheduleUnit)


class StepClock:
    """Maps epochs to optimizer steps.

    Optimizer steps, not epochs, are what schedules are evaluated on, but recipes
    talk in epochs. When gradient accumulation switches on at ``change_epoch`` the
    number of optimizer steps per epoch changes, so a plain ``epoch * steps_per_epoch``
    would put every later milestone at the wrong step. ``total_steps`` is the run's
    end (the engine passes min(epochs * steps, max_steps)).
    """

    def __init__(
        self,
        steps_per_epoch: int,
        total_steps: int,
        *,
        change_epoch: int | None = None,
        steps_per_epoch_after: int | None = None,
    ) -> None:
        if steps_per_epoch <= 0:
            raise ValueError(f"StepClock: steps_per_epoch must be > 0, got {steps_per_epoch}")
        if total_steps < 0:
            raise ValueError(f"StepClock: total_steps must be >= 0, got {total_steps}")
        if change_epoch is not None or steps_per_epoch_after is not None:
            if (
                change_epoch is None
                or steps_per_epoch_after is None
                or change_epoch < 0
                or steps_per_epoch_after <= 0
            ):
                raise ValueError(
                    "StepClock: change_epoch (>= 0) and steps_per_epoch_after (> 0) must be "
                    f"given together, got {change_epoch} and {steps_per_epoch_after}"
                )
        self.steps_per_epoch = steps_per_epoch
        self.total_steps = total_steps
        self.change_epoch = change_epoch
        self.steps_per_epoch_after = steps_per_epoch_after
        self._after = steps_per_epoch_after or steps_per_epoch

    def steps_in_epoch(self, epoch: int) -> int:
        """Optimizer steps in (0-based) epoch ``epoch``."""
        if self.change_epoch is not None and epoch >= self.change_epoch:
            return self._after
        return self.steps_per_epoch

    def epoch_start(self, epoch: float) -> float:
        """First step of ``epoch``; epoch 2.5 = start of epoch 2 + half of its steps."""
        if epoch < 0 or not math.isfinite(epoch):
            raise ValueError(f"StepClock: epoch must be finite and >= 0, got {epoch}")
        whole = int(math.floor(epoch))
        before = whole if self.change_epoch is None else min(whole, self.change_epoch)
        start = before * self.steps_per_epoch + (whole - before) * self._after
        return float(start + (epoch - whole) * self.steps_in_epoch(whole))

    def epoch_of(self, step_index: int) -> int:
        """The (0-based) epoch that step index ``step_index`` (0-based) falls in."""
        epoch = 0
        while self.epoch_start(epoch + 1) <= step_index:
            epoch += 1
        return epoch

    def epochs_at(self, step: float) -> float:
        """The epoch position of ``step``: epoch 2.5 is halfway through epoch 2 (``epoch_start``'s inverse)."""
        epoch = self.epoch_of(int(step))
        return epoch + (step - self.epoch_start(epoch)) / self.steps_in_epoch(epoch)

    def epoch_starts(self) -> tuple[float, ...]:
        """The first step of every epoch the run begins (epoch 0 always)."""
        starts, epoch = [0.0], 1
        while (start := self.epoch_start(epoch)) < self.total_steps:
            starts.append(start)
            epoch += 1
        return tuple(starts)

    def to_steps(self, value: float, unit: str) -> float:
        """Convert a position (warmup end, milestone) given in ``unit`` to optimizer steps."""
        if unit == "steps":
            return float(value)
        if unit == "epochs":
            return self.epoch_start(value)
        if unit == "run":
            return float(value) * self.total_steps
        raise ValueError(f"unknown unit {unit!r}; expected one of {', '.join(UNITS)}")


@dataclass(frozen=True)
class Schedule:
    """Built once with everything resolved to steps; ``__call__(step) -> float`` is pure.

    Frozen so that nothing can mutate it mid-run: the value at a step depends on the
    step alone, which is what makes resume exact.
    """

    shape: str
    base: float
    end: float
    total_steps: float  # positions (this, warmup, milestones, step_size) are epochs when per_epoch
    warmup_steps: float = 0.0
    warmup_start: float = 0.0
    step_size: float = 0.0  # `step` in steps; 0 with unit epochs (decays are in milestones)
    milestones: tuple[float, ...] = ()
    gamma: float = 0.1
    power: float = 0.9
    name: str = "value"
    warmup_factor: float | None = None  # if set, the warmup starts at this fraction of its target
    warmup_inclusive: bool = False  # np.linspace(start, target, ceil(W)): the target at step ceil(W) - 1
    warmup_cosine: bool = False  # a half-cosine rise (OneCycleLR) instead of a straight line
    # per-epoch schedules: the first step of each epoch; positions (W, T, milestones) are then epochs
    epoch_starts: tuple[float, ...] = ()

    warmup_floored: bool = False  # the warmup was lengthened to warmup_min_steps

    @property
    def warmup_outlasts_run(self) -> bool:
        return self.warmup_steps > self.total_steps

    def __call__(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"schedule {self.name!r}: step must be >= 0, got {step}")
        w, total = self.warmup_steps, self.total_steps
        pos = float(bisect_right(self.epoch_starts, step) - 1) if self.epoch_starts else float(step)
        pos = min(pos, total)  # past the run's end: the value at its end
        if pos < w:
            target = self._main(w, 0.0)
            start = self.warmup_start if self.warmup_factor is None else self.warmup_factor * target
            if self.warmup_inclusive:
                n = math.ceil(w)
                return start + (target - start) * (pos / (n - 1) if n > 1 else 0.0)
            frac = pos / w
            if self.warmup_cosine:
                frac = (1.0 - math.cos(math.pi * frac)) / 2.0
            return start + (target - start) * frac
        return self._main(pos, 1.0 if total <= w else (pos - w) / (total - w))

    def _main(self, step: float, t: float) -> float:
        """Main schedule at ``step``, ``t`` = progress through ``[W, T]`` in [0, 1]."""
        base, end, w = self.base, self.end, self.warmup_steps
        if self.shape == "constant":
            return base
        if self.shape == "cosine":
            return end + (base - end) * (1.0 + math.cos(math.pi * t)) / 2.0
        if self.shape == "linear":
            return base + (end - base) * t
        if self.shape == "poly":
            return end + (base - end) * (1.0 - t) ** self.power
        if self.shape == "step" and self.step_size > 0:
            return base * self.gamma ** math.floor((step - w) / self.step_size)
        # multistep, or `step` in epochs (its decays precomputed): build_schedule admits no other shape
        return base * self.gamma ** bisect_right(self.milestones, step)


def _finite(name: str, fld: str, value: float, *, min_value: float | None = None) -> float:
    """Reject NaN/inf (and values below ``min_value``) with a message naming the field."""
    if not math.isfinite(value):
        raise ValueError(f"schedule {name!r}: {fld} must be finite, got {value}")
    if min_value is not None and value < min_value:
        raise ValueError(f"schedule {name!r}: {fld} must be >= {min_value}, got {value}")
    return float(value)


def _decay_points(cfg: ScheduleConfig, name: str, step_size: float, warmup: float, total: float,
                  clock: StepClock, position: Callable[[float], float]) -> tuple[float, tuple[float, ...]]:
    """``step`` / ``multistep``: the step size in steps (0: none), or the milestones in steps."""
    step_size_steps = 0.0
    milestones: tuple[float, ...] = ()
    if cfg.shape == "step" and step_size <= 0:
        raise ValueError(f"schedule {name!r}: shape 'step' needs step_size > 0, got {step_size}")
    if cfg.shape == "step" and (cfg.unit != "epochs" or cfg.per_epoch):
        step_size_steps = position(step_size)
    elif cfg.shape == "step":
        # Decay at epochs warmup + k * step_size, each mapped through the clock, so
        # "every 30 epochs" stays epoch-aligned when steps per epoch change mid-run.
        k, pos = 1, clock.to_steps(warmup + step_size, "epochs")
        while pos <= total:
            milestones += (pos,)
            k += 1
            pos = clock.to_steps(warmup + k * step_size, "epochs")
    if cfg.shape == "multistep":
        if not cfg.milestones:
            raise ValueError(f"schedule {name!r}: shape 'multistep' needs non-empty milestones")
        milestones = tuple(sorted(position(m) for m in cfg.milestones))

    return step_size_steps, milestones


def build_schedule(
    cfg: ScheduleConfig, base: float, clock: StepClock, *, name: str = "value"
) -> Schedule:
    """Validate ``cfg`` and resolve it to steps on ``clock``.

    ``base`` is the engine's default starting value (e.g. ``optim.lr``); ``cfg.base``
    overrides it. All mistakes surface here, at startup, rather than as a silent wrong
    value thousands of steps into a run.
    """
    if cfg.shape not in SHAPES:
        raise ValueError(
            f"schedule {name!r}: unknown shape {cfg.shape!r}; expected one of {', '.join(SHAPES)}"
        )
    if cfg.unit not in UNITS:
        raise ValueError(
            f"schedule {name!r}: unknown unit {cfg.unit!r}; expected one of {', '.join(UNITS)}"
        )
    start = _finite(name, "base", cfg.base if cfg.base is not None else base)
    end = _finite(name, "end", cfg.end if cfg.end is not None else 0.0)
    warmup_start = _finite(
        name, "warmup_start", cfg.warmup_start if cfg.warmup_start is not None else 0.0
    )
    if cfg.warmup_factor is not None and cfg.warmup_start is not None:
        raise ValueError(f"schedule {name!r}: give warmup_start (absolute) or warmup_factor (relative), not both")
    warmup_factor = None if cfg.warmup_factor is None else _finite(name, "warmup_factor", cfg.warmup_factor,
                                                                   min_value=0.0)
    if cfg.warmup_shape == "cosine" and cfg.warmup_inclusive:
        raise ValueError(f"schedule {name!r}: warmup_inclusive is a linspace (a straight line); "
                         f"it does not go with warmup_shape: cosine")
    gamma = _finite(name, "gamma", cfg.gamma, min_value=0.0)
    power = _finite(name, "power", cfg.power, min_value=0.0)
    warmup = _finite(name, "warmup", cfg.warmup, min_value=0.0)
    step_size = _finite(name, "step_size", cfg.step_size, min_value=0.0)
    for m in cfg.milestones:
        _finite(name, "milestones", m, min_value=0.0)

    epoch_starts: tuple[float, ...] = ()
    if cfg.per_epoch:  # positions in epochs; each step maps to its epoch's index
        if cfg.unit != "epochs":
            raise ValueError(f"schedule {name!r}: per_epoch needs unit: epochs, got unit: {cfg.unit}")
        epoch_starts, total = clock.epoch_starts(), clock.epochs_at(clock.total_steps)

        def position(value: float) -> float:
            return value
    else:
        total = float(clock.total_steps)

        def position(value: float) -> float:
            return clock.to_steps(value, cfg.unit)
    warmup_steps, floored = _floored_warmup(cfg, name, clock, position(warmup))

    step_size_steps, milestones = _decay_points(cfg, name, step_size, warmup, total, clock, position)
    return Schedule(
        shape=cfg.shape, base=start, end=end, total_steps=total,
        warmup_steps=warmup_steps, warmup_start=warmup_start, step_size=step_size_steps,
        milestones=milestones, gamma=gamma, power=power, name=name, warmup_factor=warmup_factor,
        warmup_inclusive=cfg.warmup_inclusive, epoch_starts=epoch_starts,
        warmup_cosine=cfg.warmup_shape == "cosine", warmup_floored=floored,
    )  # fmt: skip


def _floored_warmup(cfg: ScheduleConfig, name: str, clock: StepClock, warmup: float) -> tuple[float, bool]:
    """(the warmup's length, whether ``warmup_min_steps`` lengthened it), where the warmup is measured:
    in steps, or in epochs for a per-epoch schedule (the floor's epoch counted whole, never cut short).
    A schedule without a warmup keeps none."""
    low = cfg.warmup_min_steps
    if low < 0:
        raise ValueError(f"schedule {name!r}: warmup_min_steps must be >= 0, got {low}")
    if cfg.warmup <= 0 or not low:
        return warmup, False
    floor = float(math.ceil(clock.epochs_at(low))) if cfg.per_epoch else float(low)
    return max(warmup, floor), floor > warmup


def scale_lr_by_batch(lr: float, global_batch: int, base_batch: int | None) -> float:
    """Linear scaling rule: ``lr * global_batch / base_batch``; ``lr`` when base_batch is None.

    Recipes quote lr for a reference batch (e.g. 0.1 per 256); scaling here keeps one
    recipe valid across GPU counts.
    """
    if base_batch is None:
        return lr
    if base_batch <= 0:
        raise ValueError(f"base_batch must be > 0, got {base_batch}")
    if global_batch <= 0:
        raise ValueError(f"global_batch must be > 0, got {global_batch}")
    return lr * global_batch / base_batch
