"""visiontrain.engine.step.ema.ModelEma against the hand formula ema = d * ema + (1 - d) * param."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from visiontrain.engine.state.checkpoint import atomic_save, load_checkpoint
from visiontrain.engine.step.ema import ModelEma


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def perturb(model: nn.Module, scale: float = 1.0) -> None:
    """Move every parameter and, by a train-mode forward, the BN running stats and counter."""
    model.train()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
        model(torch.randn(8, 3) * 2 + 1)


def expected(old: dict[str, torch.Tensor], cur: dict[str, torch.Tensor], d: float) -> dict[str, torch.Tensor]:
    out = {}
    for k, o in old.items():
        if o.is_floating_point():
            out[k] = d * o.double() + (1.0 - d) * cur[k].double()
        else:
            out[k] = cur[k].clone()
    return out


def assert_state(ema: ModelEma, want: dict[str, torch.Tensor]) -> None:
    got = ema.module.state_dict()
    assert set(got) == set(want)
    for k, w in want.items():
        g = got[k]
        if w.is_floating_point():
            assert g.dtype == torch.float32
            torch.testing.assert_close(g.double(), w, rtol=1e-6, atol=1e-6, msg=k)
        else:
            assert g.dtype == w.dtype and torch.equal(g, w), k


def test_update_matches_hand_formula_params_and_buffers() -> None:
    model = make_model()
    ema = ModelEma(model, 0.9)
    e0 = snapshot(ema.module)
    assert all(torch.equal(e0[k], v) for k, v in snapshot(model).items())  # starts as a copy

    perturb(model)
    cur = snapshot(model)
    assert cur["1.num_batches_tracked"].item() == 1
    assert not torch.equal(cur["1.running_mean"], e0["1.running_mean"])
    ema.update(model, step=0)
    want = expected(e0, cur, 0.9)
    assert_state(ema, want)
    assert ema.updates == 1
    # one element by hand: 0.9 * old + 0.1 * new
    k = "1.running_mean"
    assert ema.module.state_dict()[k][0].item() == pytest.approx(
        0.9 * e0[k][0].item() + 0.1 * cur[k][0].item(), rel=1e-6, abs=1e-7)
    assert ema.module.state_dict()["1.num_batches_tracked"].item() == 1

    # the source model is not touched by the update
    assert all(torch.equal(v, cur[k]) for k, v in snapshot(model).items())

    # second update, with an explicit decay overriding the configured one
    prev = snapshot(ema.module)
    perturb(model)
    cur = snapshot(model)
    ema.update(model, step=1, decay=0.5)
    assert_state(ema, expected(prev, cur, 0.5))
    assert ema.module.state_dict()["1.num_batches_tracked"].item() == 2
    assert ema.updates == 2


def test_every_k_updates_only_on_divisible_steps() -> None:
    model = make_model()
    ema = ModelEma(model, 0.8, every=3)
    state = snapshot(ema.module)
    for step in range(8):
        perturb(model, 0.1)
        ema.update(model, step)
        if step % 3 == 0:
            state = expected(state, snapshot(model), 0.8)
        assert_state(ema, state)
    assert ema.updates == 3  # steps 0, 3, 6


def test_warmup_decay_first_two_updates() -> None:
    model = make_model()
    ema = ModelEma(model, 0.99, warmup=True)
    assert ema.current_decay() == 0.0  # n = 0: 1 - 1^(-2/3) = 0
    e0 = snapshot(ema.module)

    perturb(model)
    cur1 = snapshot(model)
    ema.update(model, 0)
    assert_state(ema, expected(e0, cur1, 0.0))  # decay 0: the EMA becomes the model
    for k, v in cur1.items():
        if v.is_floating_point():
            torch.testing.assert_close(ema.module.state_dict()[k], v)

    # n = 1: 1 - 2^(-2/3) = 1 - 1/1.5874011 = 0.3700395
    d1 = ema.current_decay()
    assert d1 == pytest.approx(0.3700395, abs=1e-6)
    perturb(model)
    cur2 = snapshot(model)
    ema.update(model, 1)
    assert_state(ema, expected(cur1, cur2, 0.3700395))

    # n = 2: 1 - 3^(-2/3) = 1 - 1/2.0800838 = 0.5192494; the configured decay caps it later
    assert ema.current_decay() == pytest.approx(0.5192494, abs=1e-6)
    ema.updates = 10_000
    assert ema.current_decay() == 0.99
    ema.updates = 2
    assert ema.current_decay(0.3) == 0.3  # an explicit decay below the ramp wins
    # without warmup, the configured decay from the first update on
    assert ModelEma(model, 0.99).current_decay() == 0.99
    assert 1.0 - 3 ** (-2 / 3) == pytest.approx(0.5192494, abs=1e-6)
    assert math.isclose(1.0 - 2 ** (-2 / 3), 0.3700395, abs_tol=1e-6)


def test_ema_params_do_not_require_grad_and_are_copies() -> None:
    model = make_model()
    ema = ModelEma(model, 0.9)
    assert all(p.requires_grad for p in model.parameters())
    ema_params = list(ema.module.parameters())
    assert ema_params and not any(p.requires_grad for p in ema_params)
    model_ptrs = {t.data_ptr() for t in model.state_dict().values()}
    assert not any(t.data_ptr() in model_ptrs for t in ema.module.state_dict().values())
    assert not any(e is m for e, m in zip(ema.module.parameters(), model.parameters()))
    assert not ema.module.training
    perturb(model)
    ema.update(model, 0)
    assert not any(p.requires_grad for p in ema.module.parameters())
    assert all(p.grad is None for p in ema.module.parameters())
    # changing the model afterwards does not reach into the EMA
    before = snapshot(ema.module)
    with torch.no_grad():
        model[0].weight.add_(100.0)
    assert torch.equal(ema.module[0].weight, before["0.weight"])


def test_state_dict_round_trip(tmp_path) -> None:
    model = make_model()
    ema = ModelEma(model, 0.9)
    for step in range(3):
        perturb(model)
        ema.update(model, step)
    state = ema.state_dict()
    assert state["updates"] == 3

    atomic_save({"ema": state}, tmp_path / "ema.pt")
    loaded = load_checkpoint(tmp_path / "ema.pt")["ema"]

    other = ModelEma(make_model(seed=5), 0.9)
    assert not torch.equal(other.module[0].weight, ema.module[0].weight)
    other.load_state_dict(loaded)
    assert other.updates == 3
    for k, v in ema.module.state_dict().items():
        assert torch.equal(other.module.state_dict()[k], v), k

    # both continue identically
    perturb(model)
    ema.update(model, 3)
    other.update(model, 3)
    assert other.updates == ema.updates == 4
    for k, v in ema.module.state_dict().items():
        assert torch.equal(other.module.state_dict()[k], v), k
