"""Semantic segmentation's metrics are MMSeg's IoUMetric: checked on a case computed by hand (ignore
pixels, a class absent from both the ground truth and the predictions, a class predicted but never
true), against MMSeg's own arithmetic (areas by histogram, summed over the dataset) on random maps,
and through the task's evaluation over a padded batch of images of two sizes."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from visiontrain.core import config as C
from visiontrain.engine.step.eval_loop import EvalData
from visiontrain.evaluation.segmentation import accumulate_pixels, semantic_scores
from visiontrain.rundir.metrics_file import PER_CLASS
from visiontrain.tasks.semantic import SemanticTask

NAMES = ["a", "b", "c", "d"]  # c: in neither truth nor predictions; d: predicted, never true
TRUTH = torch.tensor([[0, 0, 0, 1], [1, 255, 255, 0]])
PREDICTED = torch.tensor([[0, 0, 1, 1], [3, 0, 1, 3]])


def counts_of(pairs: list[tuple[torch.Tensor, torch.Tensor]], classes: int = 4) -> torch.Tensor:
    counts = torch.zeros(classes * classes + 1, dtype=torch.int64)
    for truth, predicted in pairs:
        accumulate_pixels(counts, truth, predicted, 255)
    return counts[:-1].view(classes, classes)


def test_the_scores_of_a_case_computed_by_hand():
    """Labelled pixels (the two 255s left out): truth a a a b b a, predicted a a b b d d.
    a: TP 2, 4 true, 2 predicted -> IoU 2 / 4, Acc 2 / 4; b: TP 1, 2 true, 2 predicted -> IoU 1 / 3,
    Acc 1 / 2; c: 0 / 0 both, undefined; d: 2 predicted, none true -> IoU 0, Acc 0 / 0 undefined.
    aAcc 3 / 6; mIoU (1/2 + 1/3 + 0) / 3; mAcc (1/2 + 1/2) / 2."""
    metrics, per_class = semantic_scores(counts_of([(TRUTH, PREDICTED)]), NAMES)
    assert metrics == pytest.approx({"mIoU": (1 / 2 + 1 / 3) / 3, "mAcc": 0.5, "aAcc": 0.5})
    assert per_class["a"] == {"IoU": 0.5, "Acc": 0.5, "pixels": 4}
    assert per_class["b"] == pytest.approx({"IoU": 1 / 3, "Acc": 0.5, "pixels": 2})
    assert math.isnan(per_class["c"]["IoU"]) and math.isnan(per_class["c"]["Acc"]) and per_class["c"]["pixels"] == 0
    assert per_class["d"]["IoU"] == 0.0 and math.isnan(per_class["d"]["Acc"])


def mmseg_iou_metric(pairs: list[tuple[np.ndarray, np.ndarray]], classes: int, ignore: int) -> dict[str, float]:
    """MMSeg's ``IoUMetric`` (intersect_and_union per image, areas summed, total_area_to_metrics, nanmean)."""
    areas = np.zeros((3, classes))
    for truth, predicted in pairs:
        keep = truth != ignore
        t, p = truth[keep], predicted[keep]
        hist = lambda v: np.histogram(v, bins=classes, range=(0, classes - 1))[0]  # noqa: E731  (torch.histc's bins)
        areas += np.stack([hist(p[p == t]), hist(t), hist(p)])
    intersect, label, pred = areas[0], areas[1], areas[2]
    with np.errstate(invalid="ignore", divide="ignore"):
        iou, acc = intersect / (label + pred - intersect), intersect / label
    return {"mIoU": np.nanmean(iou), "mAcc": np.nanmean(acc), "aAcc": intersect.sum() / label.sum()}


def test_the_scores_are_mmsegs_iou_metric_over_a_dataset():
    rng = np.random.default_rng(0)
    pairs = []
    for _ in range(5):
        truth = rng.integers(0, 5, size=(13, 17))
        truth[rng.random(truth.shape) < 0.2] = 255
        guess = rng.integers(0, 5, truth.shape)
        pairs.append((truth, np.where((rng.random(truth.shape) < 0.6) & (truth != 255), truth, guess)))
    counts = counts_of([(torch.from_numpy(t), torch.from_numpy(p)) for t, p in pairs], 5)
    assert semantic_scores(counts, list("abcde"))[0] == pytest.approx(mmseg_iou_metric(pairs, 5, 255))


class Painter(nn.Module):
    """A model whose logits put a high score on a fixed map of classes, at the input's size."""

    def __init__(self, predicted: list[torch.Tensor], classes: int) -> None:
        super().__init__()
        self.predicted, self.classes, self.calls = predicted, classes, 0

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = torch.zeros(images.shape[0], self.classes, *images.shape[-2:])
        for i, p in enumerate(self.predicted):
            logits[i, :, :p.shape[0], :p.shape[1]] = nn.functional.one_hot(p, self.classes).permute(2, 0, 1).float()
        return {"out": logits}


def test_the_tasks_evaluation_counts_each_image_at_its_own_size_and_no_padding():
    """Two images of different sizes in one padded batch: the padding (image 0, labels 255) counts
    nowhere, and the result is the hand case's, whose pixels are split between the images."""
    from visiontrain.data.segmentation.transforms import collate_label_maps

    task = SemanticTask(C.load_config("segment-semantic", []))
    task.info = {"num_classes": 4, "class_names": NAMES}
    first, second = (TRUTH[:, :3], PREDICTED[:, :3]), (TRUTH[:, 3:], PREDICTED[:, 3:])
    batch = collate_label_maps([(torch.zeros(3, *t.shape), t.to(torch.uint8)) for t, _ in (first, second)], 255)
    metrics = task.evaluate(Painter([first[1], second[1]], 4), EvalData.local([batch]))
    assert {k: metrics[k] for k in ("mIoU", "mAcc", "aAcc")} == pytest.approx(
        {"mIoU": (1 / 2 + 1 / 3) / 3, "mAcc": 0.5, "aAcc": 0.5})
    assert math.isnan(metrics[PER_CLASS]["c"]["IoU"]) and metrics[PER_CLASS]["d"]["IoU"] == 0.0
    assert [tuple(t.shape) for _, t, _ in task.shown] == [(2, 3), (2, 1)]
