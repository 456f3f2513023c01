"""The classification task: losses, mixing on the device, the switch-off hook, top-k evaluation."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from visiontrain.core import config as C
from visiontrain.engine.step.eval_loop import EvalData
from visiontrain.tasks import build_task
from visiontrain.tasks.classification import MixSwitchOff, mix_batch


def task_for(*overrides: str):
    cfg = C.load_config("classify-fashion", ["data.name=digits", *overrides])
    task = build_task(cfg)
    task.num_classes = 10
    return task


def test_mixup_is_a_convex_combination_with_matching_targets():
    x = torch.randn(4, 1, 8, 8)
    y = F.one_hot(torch.tensor([0, 1, 2, 3]), 10).float()
    random.seed(3)
    lam = random.betavariate(0.4, 0.4)
    random.seed(3)
    mx, my = mix_batch(x, y, mixup_alpha=0.4, cutmix_alpha=0.0, cutmix_prob=0.5)
    assert torch.allclose(mx, lam * x + (1 - lam) * x.flip(0))
    assert torch.allclose(my, lam * y + (1 - lam) * y.flip(0))
    assert torch.allclose(my.sum(-1), torch.ones(4))


def test_cutmix_pastes_a_box_and_weights_targets_by_its_area():
    x = torch.zeros(2, 1, 16, 16)
    x[1] = 1.0
    y = F.one_hot(torch.tensor([0, 1]), 10).float()
    random.seed(0)
    mx, my = mix_batch(x, y, mixup_alpha=0.0, cutmix_alpha=1.0, cutmix_prob=1.0)
    pasted = mx[0].mean().item()  # image 0 is 0 except where image 1 was pasted
    assert 0 < pasted < 1
    assert my[0, 1].item() == pytest.approx(pasted)  # target weight of class 1 = pasted area
    assert my[0, 0].item() == pytest.approx(1 - pasted)


def test_label_smoothing_and_accuracy_term():
    task = task_for("task.label_smoothing=0.1")
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    out = task.losses(model, (x, y))
    assert set(out) == {"ce", "acc"} and task.loss_weights == {"ce": 1.0}  # acc is logged only
    logits = model(x)
    assert out["ce"].item() == pytest.approx(F.cross_entropy(logits, y, label_smoothing=0.1).item(), rel=1e-6)
    assert out["acc"].item() == pytest.approx(100 * (logits.argmax(-1) == y).float().mean().item())  # percent


def test_mix_switch_off_in_last_epochs():
    task = task_for("task.mixup_alpha=0.2", "task.mix_off_epochs=2", "trainer.epochs=5")
    hooks = task.hooks()
    assert len(hooks) == 1 and isinstance(hooks[0], MixSwitchOff)

    class FakeTrainer:
        progress = type("P", (), {"epochs": 5})()  # the loop's Progress: the run's length

    hooks[0].trainer = FakeTrainer()
    hooks[0].trainer.task = task
    states = []
    for epoch in range(5):
        hooks[0].trainer.epoch = epoch
        hooks[0].before_epoch()
        states.append(task.mixing)
    assert states == [True, True, True, False, False]


def test_evaluate_top1_top5_and_loss():
    task = task_for()

    class Fixed(nn.Module):
        def forward(self, x):  # class scores = the input row itself
            return x

    logits = torch.tensor([[9.0, 8, 7, 6, 5, 4, 0, 0, 0, 0],   # label 0: top-1 hit
                           [9.0, 8, 7, 6, 5, 4, 0, 0, 0, 0],   # label 4: top-5 hit only
                           [9.0, 8, 7, 6, 5, 4, 0, 0, 0, 0]])  # label 9: miss
    labels = torch.tensor([0, 4, 9])
    loader = [(logits[:2], labels[:2]), (logits[2:], labels[2:])]
    m = task.evaluate(Fixed(), EvalData.local(loader))
    assert m["top1"] == pytest.approx(100 / 3) and m["top5"] == pytest.approx(200 / 3)
    assert m["loss"] == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-6)


def test_class_count_comes_from_the_data():
    cfg = C.load_config("classify-fashion", ["data.name=digits"])
    task = build_task(cfg)
    data = task.build_data()
    model = task.build_model(data.info)
    assert data.info["num_classes"] == 10 and model.head.out_features == 10
