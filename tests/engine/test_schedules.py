"""Schedules against hand-computed values. Each expected literal is worked out in a comment."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from visiontrain.engine.optim.schedules import Schedule, ScheduleConfig, StepClock, build_schedule, scale_lr_by_batch


def values(sched: Schedule, steps: list[int]) -> list[float]:
    return [sched(s) for s in steps]


def build(total: int = 10, base: float = 1.0, spe: int = 10, **cfg: object) -> Schedule:
    return build_schedule(ScheduleConfig(**cfg), base, StepClock(spe, total), name="lr")


# --- shapes without warmup -------------------------------------------------------------


def test_constant() -> None:
    s = build(shape="constant", base=0.05)
    assert values(s, [0, 5, 10, 99]) == [0.05, 0.05, 0.05, 0.05]


def test_constant_with_warmup() -> None:
    # 0.01 -> 0.05 over 4 steps: step 2 = 0.01 + 0.04 * 2/4 = 0.03
    s = build(shape="constant", base=0.05, warmup=4, warmup_start=0.01)
    assert values(s, [0, 2, 4, 100]) == pytest.approx([0.01, 0.03, 0.05, 0.05])


def test_cosine() -> None:
    # 1.0 -> 0.0 over 10 steps. step 5: t=0.5, (1+cos(pi/2))/2 = 0.5.
    # step 2: t=0.2, cos(0.2*pi) = 0.809017, (1.809017)/2 = 0.9045085.
    s = build(shape="cosine")
    assert values(s, [0, 2, 5, 10]) == pytest.approx([1.0, 0.9045085, 0.5, 0.0])


def test_cosine_end_default_and_explicit() -> None:
    # end 0.2: step 5 = 0.2 + 0.8 * 0.5 = 0.6
    s = build(shape="cosine", end=0.2)
    assert values(s, [0, 5, 10]) == pytest.approx([1.0, 0.6, 0.2])


def test_linear() -> None:
    # 1.0 -> 0.2: step 2 = 1 - 0.8*0.2 = 0.84, step 5 = 1 - 0.8*0.5 = 0.6
    s = build(shape="linear", end=0.2)
    assert values(s, [0, 2, 5, 10]) == pytest.approx([1.0, 0.84, 0.6, 0.2])


def test_poly() -> None:
    # power 2, 1.0 -> 0.0: step 5 = 0.5**2 = 0.25, step 8 = 0.2**2 = 0.04
    s = build(shape="poly", power=2.0)
    assert values(s, [0, 5, 8, 10]) == pytest.approx([1.0, 0.25, 0.04, 0.0])
    # end 0.1: step 5 = 0.1 + 0.9 * 0.25 = 0.325
    s = build(shape="poly", power=2.0, end=0.1)
    assert s(5) == pytest.approx(0.325)


def test_poly_default_power() -> None:
    # power 0.9: step 5 = 0.5**0.9 = 0.535887
    s = build(shape="poly")
    assert values(s, [0, 5, 10]) == pytest.approx([1.0, 0.535887, 0.0], abs=1e-6)


def test_step() -> None:
    # gamma 0.1 every 3 steps: floor(step/3) = 0,0,1,1,2,3 ; clamp at 10 -> floor(10/3) = 3
    s = build(shape="step", step_size=3)
    assert values(s, [0, 2, 3, 5, 6, 9, 20]) == pytest.approx(
        [1.0, 1.0, 0.1, 0.1, 0.01, 0.001, 0.001]
    )


def test_step_counts_from_end_of_warmup() -> None:
    # warmup 2 from 0.0: step 1 = 0.5; then floor((step-2)/3): step 4 -> 0, step 5 -> 1
    s = build(shape="step", step_size=3, warmup=2)
    assert values(s, [0, 1, 2, 4, 5]) == pytest.approx([0.0, 0.5, 1.0, 1.0, 0.1])


def test_multistep() -> None:
    # base 0.1, milestones 3 and 6: <3 -> 0.1, [3,6) -> 0.01, >=6 -> 0.001
    s = build(shape="multistep", base=0.1, milestones=[6, 3])
    assert values(s, [0, 2, 3, 5, 6, 10, 50]) == pytest.approx(
        [0.1, 0.1, 0.01, 0.01, 0.001, 0.001, 0.001]
    )


def test_multistep_milestones_are_absolute_not_shifted_by_warmup() -> None:
    # warmup 2 from 0: step 1 = 0.05. Milestone 3 stays at step 3 (not 5).
    s = build(shape="multistep", base=0.1, milestones=[3, 6], warmup=2)
    assert values(s, [0, 1, 2, 3, 4, 6]) == pytest.approx([0.0, 0.05, 0.1, 0.01, 0.01, 0.001])


def test_multistep_milestone_inside_warmup_ramps_to_decayed_value() -> None:
    # warmup 4, milestone 2: main value at step 4 is 0.1*0.1 = 0.01; step 2 = 0.01 * 2/4 = 0.005
    s = build(shape="multistep", base=0.1, milestones=[2], warmup=4)
    assert values(s, [2, 4, 5]) == pytest.approx([0.005, 0.01, 0.01])


# --- warmup ----------------------------------------------------------------------------


def test_warmup_steps_then_cosine_over_remaining() -> None:
    # 2-step warmup 0.1 -> 1.0: step 1 = 0.1 + 0.9/2 = 0.55.
    # cosine over [2, 10]: step 6 -> t = 4/8 = 0.5 -> 0.5 ; step 10 -> 0.0
    s = build(shape="cosine", warmup=2, warmup_start=0.1)
    assert values(s, [0, 1, 2, 6, 10]) == pytest.approx([0.1, 0.55, 1.0, 0.5, 0.0])


def test_warmup_equal_to_total_is_allowed() -> None:
    # warmup 10 of 10: step 5 = 0.5 (ramp); at the end, clamp to the main end value 0.0
    s = build(shape="cosine", warmup=10)
    assert values(s, [0, 5, 10]) == pytest.approx([0.0, 0.5, 0.0])


def test_warmup_in_epochs() -> None:
    # 5 steps/epoch, 50 steps. warmup 2 epochs = 10 steps: step 5 = 0.5.
    # cosine over [10, 50]: step 30 -> t = 20/40 = 0.5 -> 0.5
    cfg = ScheduleConfig(shape="cosine", warmup=2, unit="epochs")
    s = build_schedule(cfg, 1.0, StepClock(5, 50))
    assert s.warmup_steps == 10
    assert values(s, [0, 5, 10, 30, 50]) == pytest.approx([0.0, 0.5, 1.0, 0.5, 0.0])


def test_fractional_warmup_in_epochs() -> None:
    # 0.5 epochs of 5 steps = 2.5 steps: step 1 = 1/2.5 = 0.4
    cfg = ScheduleConfig(shape="constant", warmup=0.5, unit="epochs")
    s = build_schedule(cfg, 1.0, StepClock(5, 50))
    assert values(s, [0, 1, 2, 3]) == pytest.approx([0.0, 0.4, 0.8, 1.0])


# --- StepClock and epoch units -----------------------------------------------------------


def changing_clock() -> StepClock:
    # 10 steps/epoch for epochs 0,1; 5 steps/epoch from epoch 2 on.
    # epoch starts: 0->0, 1->10, 2->20, 3->25, 4->30, 5->35, 6->40 (= total)
    return StepClock(10, 40, change_epoch=2, steps_per_epoch_after=5)


def test_step_clock_mapping() -> None:
    c = changing_clock()
    assert [c.epoch_start(e) for e in range(7)] == [0, 10, 20, 25, 30, 35, 40]
    assert c.epoch_start(1.5) == 15  # 10 + 0.5*10
    assert c.epoch_start(2.5) == 22.5  # 20 + 0.5*5
    assert (c.steps_in_epoch(1), c.steps_in_epoch(2)) == (10, 5)
    assert (c.to_steps(3, "epochs"), c.to_steps(7, "steps")) == (25, 7)
    assert (c.steps_per_epoch, c.total_steps) == (10, 40)
    plain = StepClock(4, 100)
    assert plain.epoch_start(3) == 12 and plain.steps_in_epoch(50) == 4


def test_multistep_epoch_milestones_across_steps_per_epoch_change() -> None:
    # milestones epochs 1, 3, 5 -> steps 10, 25, 35 ; gamma 0.5
    cfg = ScheduleConfig(shape="multistep", milestones=[1, 3, 5], gamma=0.5, unit="epochs")
    s = build_schedule(cfg, 1.0, changing_clock())
    assert s.milestones == (10, 25, 35)
    assert values(s, [9, 10, 24, 25, 34, 35, 40, 99]) == pytest.approx(
        [1.0, 0.5, 0.5, 0.25, 0.25, 0.125, 0.125, 0.125]
    )


def test_multistep_fractional_epoch_milestone() -> None:
    # epoch 2.5 = 22.5 steps: step 22 undecayed, step 23 decayed
    cfg = ScheduleConfig(shape="multistep", milestones=[2.5], unit="epochs")
    s = build_schedule(cfg, 1.0, changing_clock())
    assert values(s, [22, 23]) == pytest.approx([1.0, 0.1])


def test_step_shape_in_epochs() -> None:
    # 5 steps/epoch, step_size 3 epochs = 15 steps: decays at 15, 30, 45
    cfg = ScheduleConfig(shape="step", step_size=3, unit="epochs")
    s = build_schedule(cfg, 1.0, StepClock(5, 50))
    assert values(s, [14, 15, 29, 30, 45, 50]) == pytest.approx(
        [1.0, 0.1, 0.1, 0.01, 0.001, 0.001]
    )


def test_step_shape_in_epochs_across_steps_per_epoch_change() -> None:
    # every 2 epochs: epoch 2 = step 20, epoch 4 = step 30, epoch 6 = step 40
    cfg = ScheduleConfig(shape="step", step_size=2, unit="epochs")
    s = build_schedule(cfg, 1.0, changing_clock())
    assert values(s, [19, 20, 29, 30, 39, 40]) == pytest.approx(
        [1.0, 0.1, 0.1, 0.01, 0.01, 0.001]
    )


def test_step_shape_in_epochs_first_decay_after_the_run() -> None:
    # 5 steps/epoch in epoch 0, then 10: epoch starts 0, 5, 15. warmup 1 epoch = 5 steps,
    # step_size 1 epoch -> first decay at epoch 2 = step 15, beyond the 12-step run: no decay
    clock = StepClock(5, 12, change_epoch=1, steps_per_epoch_after=10)
    cfg = ScheduleConfig(shape="step", step_size=1, warmup=1, unit="epochs")
    s = build_schedule(cfg, 1.0, clock)
    assert values(s, [5, 10, 11, 12, 30]) == pytest.approx([1.0] * 5)


# --- clamping, increasing schedules, base override ---------------------------------------


def test_clamp_beyond_total() -> None:
    for shape, end in [("cosine", 0.0), ("linear", 0.0), ("poly", 0.0), ("constant", 1.0)]:
        s = build(shape=shape)
        assert values(s, [10, 11, 1000]) == pytest.approx([end] * 3), shape


def test_increasing_cosine_weight_decay() -> None:
    # 0.04 -> 0.4 over 10 steps: step 5 = 0.4 + (0.04-0.4)*0.5 = 0.22
    s = build(shape="cosine", base=0.04, end=0.4)
    assert values(s, [0, 5, 10, 20]) == pytest.approx([0.04, 0.22, 0.4, 0.4])


def test_increasing_cosine_ema() -> None:
    # 0.996 -> 1.0 over 4 steps: step 2 = 0.998
    s = build(shape="cosine", total=4, base=0.996, end=1.0)
    assert values(s, [0, 2, 4]) == pytest.approx([0.996, 0.998, 1.0])


def test_cfg_base_overrides_engine_base() -> None:
    s = build_schedule(ScheduleConfig(shape="linear", base=0.5), 1.0, StepClock(10, 10))
    # 0.5 -> 0.0: step 5 = 0.25
    assert values(s, [0, 5]) == pytest.approx([0.5, 0.25])


# --- purity --------------------------------------------------------------------------------


def test_pure_out_of_order_and_rebuild() -> None:
    cfg = ScheduleConfig(shape="cosine", warmup=7, warmup_start=0.01, end=1e-4)
    s = build_schedule(cfg, 0.1, StepClock(10, 100))
    steps = list(range(0, 120))
    in_order = values(s, steps)
    shuffled = steps[:]
    random.Random(0).shuffle(shuffled)
    by_step = dict(zip(shuffled, values(s, shuffled)))
    assert [by_step[k] for k in steps] == in_order
    assert values(s, steps[::-1])[::-1] == in_order
    # a resumed run builds a fresh schedule: identical object and identical values
    again = build_schedule(cfg, 0.1, StepClock(10, 100))
    assert again == s and values(again, steps) == in_order


def test_schedule_is_frozen() -> None:
    s = build(shape="cosine")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.base = 2.0  # type: ignore[misc]
    assert isinstance(s.milestones, tuple)


# --- scale_lr_by_batch ---------------------------------------------------------------------


def test_scale_lr_by_batch() -> None:
    assert scale_lr_by_batch(0.1, 1024, 256) == pytest.approx(0.4)  # 0.1 * 4
    assert scale_lr_by_batch(0.1, 128, 256) == pytest.approx(0.05)  # 0.1 / 2
    assert scale_lr_by_batch(0.1, 1024, None) == 0.1
    with pytest.raises(ValueError, match="base_batch must be > 0"):
        scale_lr_by_batch(0.1, 1024, 0)
    with pytest.raises(ValueError, match="global_batch must be > 0"):
        scale_lr_by_batch(0.1, 0, 256)


# --- validation ------------------------------------------------------------------------------


def test_unknown_shape_message() -> None:
    with pytest.raises(ValueError) as e:
        build(shape="cosin")
    assert str(e.value) == (
        "schedule 'lr': unknown shape 'cosin'; "
        "expected one of constant, cosine, linear, step, multistep, poly"
    )


def test_unknown_unit_message() -> None:
    msg = r"schedule 'lr': unknown unit 'iters'; expected one of steps, epochs"
    with pytest.raises(ValueError, match=msg):
        build(shape="cosine", unit="iters")


def test_warmup_longer_than_the_run_stays_in_warmup() -> None:
    # W = 25 > T = 20: steps 0..19 follow the ramp 0 -> 1 over 25 steps; past the end, its value at 20
    sched = build(shape="cosine", total=20, warmup=25)
    assert sched.warmup_outlasts_run
    assert values(sched, [0, 5, 19, 20, 100]) == pytest.approx([0.0, 0.2, 0.76, 0.8, 0.8])
    # 5 epochs of 5 steps = 25 steps, with a warmup_factor: 1/3 -> 1 over 25 steps
    cfg = ScheduleConfig(shape="poly", warmup=5, unit="epochs", warmup_factor=1 / 3)
    sched = build_schedule(cfg, 3.0, StepClock(5, 20), name="lr")
    assert sched.warmup_outlasts_run
    assert values(sched, [0, 10]) == pytest.approx([1.0, 1.0 + 2.0 * 10 / 25])
    assert not build(shape="cosine", total=20, warmup=20).warmup_outlasts_run


def test_inclusive_warmup_is_numpy_linspace() -> None:
    # np.linspace(0.1, 1, 4) = 0.1, 0.4, 0.7, 1.0 at steps 0..3; cosine over [4, 10) from 1 to 0
    sched = build(shape="cosine", total=10, warmup=4, warmup_start=0.1, warmup_inclusive=True)
    assert values(sched, [0, 1, 2, 3, 4]) == pytest.approx([0.1, 0.4, 0.7, 1.0, 1.0])
    assert sched(7) == pytest.approx((1 + math.cos(math.pi * 3 / 6)) / 2)
    # a one-step warmup is np.linspace(start, base, 1) = [start]
    assert values(build(total=10, warmup=1, warmup_start=0.5, warmup_inclusive=True), [0, 1]) == [0.5, 1.0]


def test_per_epoch_schedule_holds_one_value_per_epoch() -> None:
    # 4 epochs of 3 steps; warmup 3 epochs inclusive from 0.04 to 0.07: epochs 0, 1, 2 = 0.04, 0.055, 0.07
    cfg = ScheduleConfig(shape="constant", warmup=3, warmup_start=0.04, unit="epochs", per_epoch=True,
                         warmup_inclusive=True)
    sched = build_schedule(cfg, 0.07, StepClock(3, 12), name="task.teacher_temp")
    assert values(sched, list(range(12))) == pytest.approx([0.04] * 3 + [0.055] * 3 + [0.07] * 6)
    # cosine per epoch over 4 epochs: epoch e -> (1 + cos(pi e / 4)) / 2
    sched = build_schedule(ScheduleConfig(shape="cosine", unit="epochs", per_epoch=True), 1.0, StepClock(3, 12))
    assert values(sched, [0, 2, 3, 11]) == pytest.approx([1.0, 1.0, (1 + math.cos(math.pi / 4)) / 2,
                                                          (1 + math.cos(math.pi * 3 / 4)) / 2])
    with pytest.raises(ValueError, match="schedule 'value': per_epoch needs unit: epochs, got unit: steps"):
        build_schedule(ScheduleConfig(shape="cosine", per_epoch=True), 1.0, StepClock(3, 12))


def test_multistep_without_milestones_message() -> None:
    msg = r"schedule 'lr': shape 'multistep' needs non-empty milestones"
    with pytest.raises(ValueError, match=msg):
        build(shape="multistep")


def test_step_without_step_size_message() -> None:
    msg = r"schedule 'lr': shape 'step' needs step_size > 0, got 0.0"
    with pytest.raises(ValueError, match=msg):
        build(shape="step")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"warmup": -1.0}, "schedule 'lr': warmup must be >= 0.0, got -1.0"),
        ({"step_size": -2.0, "shape": "step"}, "schedule 'lr': step_size must be >= 0.0, got -2.0"),
        (
            {"milestones": [3, -1], "shape": "multistep"},
            "schedule 'lr': milestones must be >= 0.0, got -1",
        ),
        ({"gamma": -0.1}, "schedule 'lr': gamma must be >= 0.0, got -0.1"),
        ({"power": -1.0, "shape": "poly"}, "schedule 'lr': power must be >= 0.0, got -1.0"),
        ({"end": math.nan, "shape": "cosine"}, "schedule 'lr': end must be finite, got nan"),
        ({"base": math.inf}, "schedule 'lr': base must be finite, got inf"),
    ],
)
def test_invalid_field_messages(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as e:
        build(**fields)
    assert str(e.value) == message


def test_default_name_in_messages() -> None:
    with pytest.raises(ValueError, match=r"^schedule 'value': unknown shape 'x'"):
        build_schedule(ScheduleConfig(shape="x"), 1.0, StepClock(1, 1))


def test_negative_step_rejected() -> None:
    with pytest.raises(ValueError, match=r"schedule 'lr': step must be >= 0, got -1"):
        build(shape="cosine")(-1)


def test_step_clock_validation() -> None:
    with pytest.raises(ValueError, match="steps_per_epoch must be > 0, got 0"):
        StepClock(0, 10)
    with pytest.raises(ValueError, match="total_steps must be >= 0, got -1"):
        StepClock(10, -1)
    with pytest.raises(ValueError, match="given together, got 2 and None"):
        StepClock(10, 100, change_epoch=2)
    with pytest.raises(ValueError, match="given together, got 2 and 0"):
        StepClock(10, 100, change_epoch=2, steps_per_epoch_after=0)
    with pytest.raises(ValueError, match="given together, got -1 and 5"):
        StepClock(10, 100, change_epoch=-1, steps_per_epoch_after=5)
    with pytest.raises(ValueError, match="given together, got None and 5"):
        StepClock(10, 100, steps_per_epoch_after=5)
    with pytest.raises(ValueError, match="epoch must be finite and >= 0"):
        StepClock(10, 100).epoch_start(-1)
    with pytest.raises(ValueError, match="unknown unit 'iters'"):
        StepClock(10, 100).to_steps(3, "iters")


def test_one_cycle_is_torchs_one_cycle_lr() -> None:
    """``unit: run`` + ``warmup_shape: cosine``: OneCycleLR's lr and Adam beta1 at every step,
    whatever the run's length (positions are fractions of the run)."""
    import torch

    for epochs in (4, 11):
        total = 234 * epochs  # classify-fashion's steps per epoch
        clock = StepClock(234, total)
        lr = build_schedule(ScheduleConfig(shape="cosine", warmup=0.3, unit="run", warmup_shape="cosine",
                                           warmup_start=3e-3 / 25, end=3e-3 / 25e4), 3e-3, clock)
        beta1 = build_schedule(ScheduleConfig(shape="cosine", base=0.85, end=0.95, warmup=0.3, unit="run",
                                              warmup_shape="cosine", warmup_start=0.95), 0.9, clock)
        opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=3e-3)
        ref = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=total)
        for step in range(total):
            group = opt.param_groups[0]
            # OneCycleLR ends its rise one step earlier (at pct_start * total - 1): within one step's change
            one_step = math.pi / (2 * 0.3 * total)  # the steepest change per step, as a share of the range
            assert lr(step) == pytest.approx(group["lr"], abs=3e-3 * one_step)
            assert beta1(step) == pytest.approx(group["betas"][0], abs=0.1 * one_step)
            opt.step()
            ref.step()
        assert lr(0) == 3e-3 / 25 and lr(round(0.3 * total)) == pytest.approx(3e-3)


def test_cosine_warmup_rises_along_half_a_cosine() -> None:
    sched = build(total=20, warmup=4, warmup_start=0.0, warmup_shape="cosine")
    # (1 - cos(pi * s / 4)) / 2 at s = 1, 2, 3: 0.1464, 0.5, 0.8536
    assert values(sched, [0, 1, 2, 3, 4]) == pytest.approx([0.0, 0.14645, 0.5, 0.85355, 1.0], abs=1e-5)
    with pytest.raises(ValueError, match="warmup_inclusive is a linspace"):
        build(total=20, warmup=4, warmup_shape="cosine", warmup_inclusive=True)


def test_run_unit_is_a_fraction_of_the_run() -> None:
    # warmup 0.25 of 40 steps = 10; milestones at 0.5 and 0.75 = steps 20 and 30
    assert build(total=40, warmup=0.25, unit="run", warmup_start=0.0)(5) == pytest.approx(0.5)
    sched = build(total=40, shape="multistep", milestones=[0.5, 0.75], unit="run", gamma=0.1)
    assert values(sched, [19, 20, 29, 30]) == pytest.approx([1.0, 0.1, 0.1, 0.01])


def test_warmup_min_steps_floors_a_warmup_that_shrinks_with_the_data() -> None:
    # half an epoch on 250 steps per epoch: 125 steps, above the floor of 100: unchanged
    cfg = ScheduleConfig(shape="poly", warmup=0.5, unit="epochs", warmup_factor=1 / 3, warmup_min_steps=100)
    big = build_schedule(cfg, 0.04, StepClock(250, 750), name="lr")
    assert big.warmup_steps == 125 and not big.warmup_floored
    # on 40 images (5 steps per epoch) half an epoch is 2.5 steps: floored at 100, 1/3 -> 1 of the poly's start
    small = build_schedule(cfg, 0.04, StepClock(5, 500), name="lr")
    assert small.warmup_steps == 100 and small.warmup_floored
    target = 0.04 * (1 - 0 / 400) ** 0.9
    assert values(small, [0, 50, 100]) == pytest.approx([target / 3, target / 3 + target * 2 / 3 * 0.5, 0.04])
    # a fraction of the run, and a per-epoch schedule (whole epochs: 100 steps at 30 per epoch = epoch 4)
    run = build_schedule(ScheduleConfig(shape="cosine", warmup=0.01, unit="run", warmup_min_steps=50), 1.0,
                         StepClock(10, 1000), name="lr")
    assert run.warmup_steps == 50 and run.warmup_floored
    per_epoch = build_schedule(ScheduleConfig(shape="constant", warmup=1, unit="epochs", per_epoch=True,
                                              warmup_min_steps=100), 1.0, StepClock(30, 300), name="t")
    assert per_epoch.warmup_steps == 4 and values(per_epoch, [0, 30, 119, 120]) == pytest.approx([0, 0.25, 0.75, 1])


def test_warmup_min_steps_leaves_a_schedule_without_warmup_alone() -> None:
    sched = build(shape="cosine", warmup_min_steps=100)  # warmup 0: no warmup to lengthen
    assert sched.warmup_steps == 0 and not sched.warmup_floored and sched(0) == 1.0
    with pytest.raises(ValueError, match="schedule 'lr': warmup_min_steps must be >= 0, got -1"):
        build(shape="cosine", warmup=1, warmup_min_steps=-1)
