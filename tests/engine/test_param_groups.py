"""visiontrain.engine.optim.param_groups: no-decay rules, lr multipliers, coverage, optimizers; and freezing
(visiontrain.models.freezing)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torchvision.ops import FrozenBatchNorm2d

from visiontrain.engine.optim.param_groups import (NormGroups, OptimConfig, ParamGroupError, build_optimizer,
                                                   build_param_groups, check_coverage, is_fused, no_decay_names)
from visiontrain.models.freezing import freeze_parameters


class Net(nn.Module):
    """conv (no bias) + BN nested in a Sequential, Linear with bias, LayerNorm, a 1-D gain."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4))
        self.fc = nn.Linear(4, 5)
        self.ln = nn.LayerNorm(5)
        self.gain = nn.Parameter(torch.ones(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x)).mean(dim=(-2, -1))
        return self.ln(self.fc(x)) * self.gain


ALL = {"stem.0.weight", "stem.1.weight", "stem.1.bias", "fc.weight", "fc.bias", "ln.weight", "ln.bias", "gain"}
DECAY = {"stem.0.weight", "fc.weight"}
NO_DECAY = ALL - DECAY


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    net = Net()
    with torch.no_grad():  # non-trivial norm parameters, so a wrong swap would show
        for p in net.parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.3 + 1.0)
    return net


def names_of(group: dict) -> set[str]:
    return set(group["param_names"])


# --- weight-decay rules ------------------------------------------------------------------

def test_no_decay_names_biases_norms_and_1d_params() -> None:
    net = make_net()
    assert {n for n, _ in net.named_parameters()} == ALL
    assert no_decay_names(net) == NO_DECAY


def test_build_param_groups_split_by_decay() -> None:
    net = make_net()
    groups = build_param_groups(net, 0.05)
    assert len(groups) == 2
    by_decay = {g["decay"]: g for g in groups}
    assert names_of(by_decay[True]) == DECAY
    assert by_decay[True]["weight_decay"] == 0.05
    assert names_of(by_decay[False]) == NO_DECAY
    assert by_decay[False]["weight_decay"] == 0.0
    params = dict(net.named_parameters())
    for g in groups:
        assert g["lr_mult"] == 1.0
        # the group's tensors are the model's own, in the same order as the names
        assert all(p is params[n] for p, n in zip(g["params"], g["param_names"]))
    check_coverage(net, groups)


def test_build_param_groups_rule_off_and_zero_decay() -> None:
    net = make_net()
    (only,) = build_param_groups(net, 0.05, no_decay_bias_norm=False)
    assert names_of(only) == ALL and only["decay"] and only["weight_decay"] == 0.05
    (none,) = build_param_groups(net, 0.0)
    assert names_of(none) == ALL and not none["decay"] and none["weight_decay"] == 0.0


def test_norm_groups_split_norms_and_apply_the_other_rules_on_top() -> None:
    """A task's NormGroups (seamseg's R-CNN): norm layers in ``norm`` groups, the rest in ``other``;
    lr_mult regexes and the no-decay rule still apply, except that frozen norms are at lr 0."""
    net = make_net()
    norms = {"stem.1.weight", "stem.1.bias", "ln.weight", "ln.bias"}
    groups = build_param_groups(net, 0.05, no_decay_bias_norm=False, lr_mult={r"^fc": 0.5}, norms=NormGroups())
    by_name = {g["name"]: (names_of(g), g["weight_decay"], g["lr_mult"]) for g in groups}
    assert by_name == {"other_x1": ({"stem.0.weight", "gain"}, 0.05, 1.0),
                       "other_x0.5": ({"fc.weight", "fc.bias"}, 0.05, 0.5),
                       "norm_no_decay_x1": (norms, 0.0, 1.0)}
    frozen = build_param_groups(net, 0.05, lr_mult={r"^s": 3.0}, norms=NormGroups(frozen=True, weight_decay=True))
    assert {g["name"]: names_of(g) for g in frozen} == {
        "other_x3": {"stem.0.weight"}, "norm_no_decay_x0": norms, "other_x1": {"fc.weight"},
        "other_no_decay_x1": {"fc.bias", "gain"}}  # no_decay_bias_norm still spares norms and 1-D params
    decayed = build_param_groups(net, 0.05, no_decay_bias_norm=False, norms=NormGroups(frozen=True, weight_decay=True))
    assert [(g["name"], g["weight_decay"]) for g in decayed] == [("other_x1", 0.05), ("norm_x0", 0.05)]
    check_coverage(net, decayed)


# --- lr multipliers ----------------------------------------------------------------------

def test_lr_mult_first_match_wins_and_optimizer_lr() -> None:
    net = make_net()
    # fc.weight / fc.bias match "^fc" first (0.1), not "fc|stem" (10); stem.0.weight only the second;
    # "stem\.1" (BN) is never reached for BN params because "fc|stem" matches them first.
    rules = {r"^fc": 0.1, r"fc|stem": 10.0, r"stem\.1": 0.5, r"gain": 2.0}
    groups = build_param_groups(net, 0.01, lr_mult=rules)
    mult_of = {n: g["lr_mult"] for g in groups for n in g["param_names"]}
    assert mult_of == {"fc.weight": 0.1, "fc.bias": 0.1, "stem.0.weight": 10.0, "stem.1.weight": 10.0,
                       "stem.1.bias": 10.0, "gain": 2.0, "ln.weight": 1.0, "ln.bias": 1.0}
    keys = {(g["decay"], g["lr_mult"]) for g in groups}
    assert keys == {(True, 0.1), (False, 0.1), (True, 10.0), (False, 10.0), (False, 2.0), (False, 1.0)}
    assert len(groups) == len(keys)
    check_coverage(net, groups)

    opt = build_optimizer(groups, OptimConfig(name="adamw"), lr=0.2)
    params = dict(net.named_parameters())
    seen = set()
    for g in opt.param_groups:
        assert g["lr"] == pytest.approx(0.2 * g["lr_mult"], rel=1e-12)
        for n in g["param_names"]:
            assert g["lr"] == pytest.approx(0.2 * mult_of[n], rel=1e-12)
            seen.add(n)
        assert all(any(p is q for q in g["params"]) for p in (params[n] for n in g["param_names"]))
    assert seen == ALL


# --- freezing ----------------------------------------------------------------------------

def trained_stats_net() -> Net:
    net = make_net(1)
    net.train()
    with torch.no_grad():
        for _ in range(3):  # running stats away from (0, 1); num_batches_tracked = 3
            net(torch.randn(4, 3, 6, 6) * 2 + 0.5)
    return net


def test_freeze_parameters_regex_and_frozen_batchnorm_swap() -> None:
    net = trained_stats_net()
    bn = net.stem[1]
    stats = {k: getattr(bn, k).detach().clone() for k in ("weight", "bias", "running_mean", "running_var")}
    assert not torch.allclose(stats["running_mean"], torch.zeros(4))
    net.eval()
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        before = net(x)

    frozen = freeze_parameters(net, [r"^stem\."])
    assert sorted(frozen) == ["stem.0.weight", "stem.1.bias", "stem.1.weight"]
    # the BN is now a FrozenBatchNorm2d with the same statistics and affine parameters
    swapped = net.stem[1]
    assert isinstance(swapped, FrozenBatchNorm2d)
    assert swapped.eps == bn.eps
    for k, v in stats.items():
        assert torch.equal(getattr(swapped, k), v), k
    # conv weight frozen, the rest still trainable
    assert not net.stem[0].weight.requires_grad
    trainable = {n for n, p in net.named_parameters() if p.requires_grad}
    assert trainable == {"fc.weight", "fc.bias", "ln.weight", "ln.bias", "gain"}
    with torch.no_grad():
        after = net(x)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)
    # frozen statistics: a train-mode forward no longer moves them
    net.train()
    with torch.no_grad():
        net(torch.randn(4, 3, 6, 6) + 3.0)
    assert torch.equal(net.stem[1].running_mean, stats["running_mean"])

    groups = build_param_groups(net, 0.05)
    assert {n for g in groups for n in g["param_names"]} == trainable
    check_coverage(net, groups)


def test_freeze_partial_bn_or_frozen_bn_off_keeps_batchnorm() -> None:
    net = make_net()
    assert freeze_parameters(net, [r"stem\.1\.weight"]) == ["stem.1.weight"]
    assert type(net.stem[1]) is nn.BatchNorm2d  # its bias still trains: not frozen
    assert not net.stem[1].weight.requires_grad and net.stem[1].bias.requires_grad

    net = make_net()
    assert sorted(freeze_parameters(net, [r"stem\.1\."], frozen_bn=False)) == ["stem.1.bias", "stem.1.weight"]
    assert type(net.stem[1]) is nn.BatchNorm2d
    assert freeze_parameters(net, []) == []
    assert all(p.requires_grad for n, p in net.named_parameters() if not n.startswith("stem.1."))


# --- coverage ----------------------------------------------------------------------------

def test_check_coverage_names_missing_parameter() -> None:
    net = make_net()
    groups = build_param_groups(net, 0.05)
    decay = next(g for g in groups if g["decay"])
    i = decay["param_names"].index("fc.weight")
    decay["params"].pop(i)
    with pytest.raises(ParamGroupError) as info:
        check_coverage(net, groups)
    msg = str(info.value)
    assert "fc.weight" in msg and "not in any parameter group" in msg
    assert "stem.0.weight" not in msg and "more than one" not in msg


def test_check_coverage_names_parameter_in_two_groups() -> None:
    net = make_net()
    groups = build_param_groups(net, 0.05)
    decay = next(g for g in groups if g["decay"])
    decay["params"].append(net.ln.weight)
    with pytest.raises(ParamGroupError) as info:
        check_coverage(net, groups)
    msg = str(info.value)
    assert "ln.weight" in msg and "more than one group" in msg
    assert "not in any" not in msg and "ln.bias" not in msg
    assert isinstance(info.value, ValueError)


def test_check_coverage_ignores_frozen_parameters() -> None:
    net = make_net()
    net.fc.weight.requires_grad_(False)
    groups = build_param_groups(net, 0.05)
    assert "fc.weight" not in {n for g in groups for n in g["param_names"]}
    check_coverage(net, groups)  # no error: a frozen parameter needs no group


# --- optimizers --------------------------------------------------------------------------

@pytest.mark.parametrize("name,cls", [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam),
                                      ("adamw", torch.optim.AdamW)])
def test_build_optimizer_fused_by_default_and_foreach(name: str, cls: type) -> None:
    net = make_net()
    opt = build_optimizer(build_param_groups(net, 0.05), OptimConfig(name=name), lr=0.01)
    assert type(opt) is cls
    assert opt.defaults["fused"] is True and is_fused(opt)

    opt = build_optimizer(build_param_groups(net, 0.05), OptimConfig(name=name, impl="foreach"), lr=0.01)
    assert type(opt) is cls
    assert opt.defaults["foreach"] is True
    assert not opt.defaults.get("fused") and not is_fused(opt)

    opt = build_optimizer(build_param_groups(net, 0.05), OptimConfig(name=name, impl="loop"), lr=0.01)
    assert opt.defaults["foreach"] is False and not is_fused(opt)


def test_build_optimizer_adam_hyperparameters() -> None:
    net = make_net()
    adam = OptimConfig(name="adam", momentum=0.8, beta2=0.95, eps=1e-6)
    opt = build_optimizer(build_param_groups(net, 0.05), adam, lr=0.01)
    assert opt.defaults["betas"] == (0.8, 0.95) and opt.defaults["eps"] == 1e-6
    opt = build_optimizer(build_param_groups(net, 0.0), OptimConfig(name="sgd", momentum=0.7, nesterov=True),
                          lr=0.01)
    assert opt.defaults["momentum"] == 0.7 and opt.defaults["nesterov"] is True


def test_build_optimizer_unknown_name() -> None:
    with pytest.raises(ValueError, match="rmsprop"):
        build_optimizer(build_param_groups(make_net(), 0.05), OptimConfig(name="rmsprop"), lr=0.01)


def test_fused_adamw_step_matches_reference_with_group_decay_and_lr_mult() -> None:
    """One fused AdamW step over the rule-built groups == the plain loop AdamW with hand groups."""
    net, ref = make_net(3), make_net(3)
    groups = build_param_groups(net, 0.1, lr_mult={r"^fc": 0.5})
    opt = build_optimizer(groups, OptimConfig(name="adamw"), lr=0.01)
    rp = dict(ref.named_parameters())
    hand = [
        {"params": [rp["stem.0.weight"]], "weight_decay": 0.1, "lr": 0.01},
        {"params": [rp["fc.weight"]], "weight_decay": 0.1, "lr": 0.005},
        {"params": [rp["fc.bias"]], "weight_decay": 0.0, "lr": 0.005},
        {"params": [rp[n] for n in ("stem.1.weight", "stem.1.bias", "ln.weight", "ln.bias", "gain")],
         "weight_decay": 0.0, "lr": 0.01},
    ]
    ref_opt = torch.optim.AdamW(hand, lr=0.01, foreach=False)
    x = torch.randn(3, 3, 6, 6)
    for _ in range(2):
        for model, o in ((net, opt), (ref, ref_opt)):
            o.zero_grad()
            model(x).square().sum().backward()
            o.step()
    for n, p in net.named_parameters():
        torch.testing.assert_close(p, rp[n], rtol=1e-5, atol=1e-6, msg=n)


def test_fused_sgd_skipped_first_step_then_matches_plain_sgd() -> None:
    """Regression: fused SGD whose first step is skipped via found_inf must not leave the momentum
    buffer uninitialised (torch creates it with empty_like and only fills it in a taken step)."""
    torch.manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    junk = [torch.full(s, 123.0) for s in shapes for _ in range(20)]  # leave non-zero bytes for reuse
    del junk
    params = [nn.Parameter(torch.randn(s)) for s in shapes]
    start = [p.detach().clone() for p in params]
    opt = build_optimizer([{"params": params, "lr_mult": 1.0}], OptimConfig(name="sgd", momentum=0.9), lr=0.1)
    assert is_fused(opt)

    opt.found_inf = torch.tensor(1.0)
    for p in params:
        p.grad = torch.full_like(p, 1000.0)
    opt.step()
    for p, s in zip(params, start):
        assert torch.equal(p.detach(), s)

    grads = [[torch.randn(s) for s in shapes] for _ in range(2)]
    opt.found_inf = torch.tensor(0.0)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()

    ref = [nn.Parameter(s.clone()) for s in start]
    ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9, foreach=False)
    for gs in grads:
        for p, g in zip(ref, gs):
            p.grad = g.clone()
        ref_opt.step()
    for p, r, s in zip(params, ref, start):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)
        assert not torch.equal(p.detach(), s)  # the two steps did move it
