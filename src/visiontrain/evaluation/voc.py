"""Pascal VOC detection mAP: the VOC2007 11-point AP and the VOC2010+ area-under-PR AP.

Matching follows the official devkit (``VOCevaldet.m``) and GluonCV's ``VOCMApMetric``: per class,
all detections of the data set are ranked by score; each detection is compared with every gt box of
its class in its image and takes the gt of highest IoU (``argmax``, first on ties). If that IoU is
``>= iou_threshold`` and the gt is *difficult*, the detection is ignored (neither TP nor FP); if the
gt is not difficult it is a TP the first time and a FP after that (a duplicate); below the threshold
it is a FP. Recall is TP / (non-difficult gts). A class with no non-difficult gt has AP NaN and is
left out of the mean (its detections count nowhere), as in GluonCV.

IoU convention -- continuous coordinates, no "+1": ``area = (x2 - x1) * (y2 - y1)``. The devkit
and GluonCV (which adds 1 to x2/y2 before its ``bbox_iou``) treat boxes as inclusive integer pixel
indices, ``width = x2 - x1 + 1``. This module defaults to continuous because everything else in
visiontrain (readers, torchvision v2 transforms, models, ``box_iou``) uses continuous XYXY, and
the two agree exactly when a reader maps VOC's 1-based inclusive ``(xmin, ymin, xmax, ymax)`` to
``(xmin - 1, ymin - 1, xmax, ymax)``, as ``data/detection/voc.py`` does: widths, heights and
intersections are then identical to the devkit's, for gts and (continuous) predictions alike. To
reproduce devkit/GluonCV numbers on raw integer-pixel boxes, pass ``box_offset=1.0`` (added to
every width/height and intersection side, as the devkit does; intersections must be > 0).

Ties in score are broken by input order (image order, then box order), a stable sort like the
devkit's MATLAB ``sort``. The 11 recall thresholds are exactly ``k / 10``; GluonCV's
``np.arange(0, 1.1, 0.1)`` makes 0.3, 0.6 and 0.7 slightly larger, which drops a point whenever a
recall lands exactly on one of them (e.g. 3 of 10 gts), an artefact we do not copy.

Labels are contiguous ``0..num_classes-1``; negative labels are padding and are dropped
(GluonCV's convention), labels ``>= num_classes`` are an error.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["voc_map", "average_precision", "box_iou_np", "image_arrays"]

_RECALL_POINTS_07 = np.arange(11) / 10.0  # 0.0, 0.1, ..., 1.0 exactly


def _np(x: Any, dtype: Any) -> np.ndarray:
    """numpy view of a numpy array / torch tensor / list (torch tensors may live on any device)."""
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch here
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype)


def box_iou_np(a: np.ndarray, b: np.ndarray, box_offset: float = 0.0) -> np.ndarray:
    """Pairwise IoU [N, M] of XYXY boxes; ``box_offset`` 1.0 gives the devkit's inclusive pixels."""
    a, b = a.astype(np.float64, copy=False), b.astype(np.float64, copy=False)
    iw = np.minimum(a[:, None, 2], b[None, :, 2]) - np.maximum(a[:, None, 0], b[None, :, 0]) + box_offset
    ih = np.minimum(a[:, None, 3], b[None, :, 3]) - np.maximum(a[:, None, 1], b[None, :, 1]) + box_offset
    inter = np.where((iw > 0) & (ih > 0), iw * ih, 0.0)
    area_a = (a[:, 2] - a[:, 0] + box_offset) * (a[:, 3] - a[:, 1] + box_offset)
    area_b = (b[:, 2] - b[:, 0] + box_offset) * (b[:, 3] - b[:, 1] + box_offset)
    union = area_a[:, None] + area_b[None, :] - inter
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(union > 0, inter / union, 0.0)


def average_precision(recall: np.ndarray, precision: np.ndarray, use_07_metric: bool = True) -> float:
    """AP from a ranked PR curve (``recall``/``precision`` after each detection, in score order).

    VOC07: mean over recall thresholds t in {0, 0.1, ..., 1} of max precision at recall >= t (0 if
    that recall is never reached). VOC2010+: area under the PR curve after making precision
    monotonically non-increasing (each point takes the max precision at any higher recall).
    """
    recall, precision = np.asarray(recall, np.float64), np.asarray(precision, np.float64)
    if use_07_metric:
        reached = recall[None, :] >= _RECALL_POINTS_07[:, None]  # [11, D]
        best = np.where(reached, precision[None, :], 0.0).max(axis=1, initial=0.0)
        return float(best.sum() / 11.0)
    mrec = np.concatenate(([0.0], recall, [1.0]))
    mpre = np.concatenate(([0.0], precision, [0.0]))
    mpre = np.maximum.accumulate(mpre[::-1])[::-1]  # precision envelope
    i = np.flatnonzero(mrec[1:] != mrec[:-1])  # points where recall changes
    return float(np.sum((mrec[i + 1] - mrec[i]) * mpre[i + 1]))


def _match_image(pred_boxes: np.ndarray, gt_boxes: np.ndarray, gt_difficult: np.ndarray,
                 iou_threshold: float, box_offset: float) -> np.ndarray:
    """Outcome per detection (already in descending score order) in one image and class:
    1 = TP, 0 = FP, -1 = ignored (matched a difficult gt)."""
    out = np.zeros(len(pred_boxes), dtype=np.int8)
    if len(pred_boxes) == 0 or len(gt_boxes) == 0:
        return out
    iou = box_iou_np(pred_boxes, gt_boxes, box_offset)
    best = iou.argmax(axis=1)
    hit = iou[np.arange(len(best)), best] >= iou_threshold
    taken = np.zeros(len(gt_boxes), dtype=bool)
    for d in np.flatnonzero(hit):  # greedy in score order: a gt can be claimed once
        g = best[d]
        if gt_difficult[g]:
            out[d] = -1
        else:
            out[d] = 0 if taken[g] else 1
            taken[g] = True
    return out


def image_arrays(i: int, pred: dict, gt: dict, num_classes: int) -> tuple[np.ndarray, ...]:
    """One image's ``(pred boxes [N, 4], scores [N], labels [N], gt boxes [M, 4], labels [M],
    difficult [M])`` as numpy, padding (negative labels) dropped; lengths that differ and labels
    ``>= num_classes`` are errors naming image ``i`` (the input formats are ``voc_map``'s)."""
    p_boxes = _np(pred["boxes"], np.float64).reshape(-1, 4)
    p_scores = _np(pred["scores"], np.float64).reshape(-1)
    p_labels = _np(pred["labels"], np.int64).reshape(-1)
    g_boxes = _np(gt["boxes"], np.float64).reshape(-1, 4)
    g_labels = _np(gt["labels"], np.int64).reshape(-1)
    diff = gt.get("difficult")
    g_diff = np.zeros(len(g_labels), bool) if diff is None else _np(diff, bool).reshape(-1)
    if len({len(p_boxes), len(p_scores), len(p_labels)}) > 1 or len({len(g_boxes), len(g_labels), len(g_diff)}) > 1:
        raise ValueError(f"image {i}: boxes, scores, labels (and difficult) lengths differ")
    for name, lab in (("prediction", p_labels), ("ground-truth", g_labels)):
        if lab.size and lab.max() >= num_classes:
            raise ValueError(f"image {i}: {name} label {int(lab.max())} >= num_classes={num_classes}")
    keep, gkeep = p_labels >= 0, g_labels >= 0
    return p_boxes[keep], p_scores[keep], p_labels[keep], g_boxes[gkeep], g_labels[gkeep], g_diff[gkeep]


def voc_map(predictions: Sequence[dict], ground_truths: Sequence[dict], num_classes: int, *,
            iou_threshold: float = 0.5, use_07_metric: bool = True, box_offset: float = 0.0) -> dict:
    """Pascal VOC mAP over a data set.

    Args:
        predictions: per image ``{"boxes": [N, 4] XYXY, "scores": [N], "labels": [N]}``.
        ground_truths: per image, same order, ``{"boxes": [M, 4], "labels": [M],
            "difficult": bool [M]}`` (``difficult`` optional: none difficult).
        num_classes: classes are ``0..num_classes-1``.
        iou_threshold: a detection matches a gt at IoU ``>=`` this.
        use_07_metric: VOC2007 11-point AP (True) or VOC2010+ area AP (False).
        box_offset: 0.0 continuous coordinates (default), 1.0 devkit inclusive pixels (see module).

    Returns:
        ``{"mAP": float, "per_class": list[float]}``: per-class AP (NaN for a class without
        non-difficult gt) and their mean over classes with gt (NaN if no class has any).
    """
    if len(predictions) != len(ground_truths):
        raise ValueError(f"{len(predictions)} prediction entries for {len(ground_truths)} images")
    scores: list[list[np.ndarray]] = [[] for _ in range(num_classes)]
    matches: list[list[np.ndarray]] = [[] for _ in range(num_classes)]
    n_pos = np.zeros(num_classes, dtype=np.int64)
    for i, (pred, gt) in enumerate(zip(predictions, ground_truths)):
        p_boxes, p_scores, p_labels, g_boxes, g_labels, g_diff = image_arrays(i, pred, gt, num_classes)
        np.add.at(n_pos, g_labels[~g_diff], 1)
        for c in np.union1d(p_labels, g_labels):
            pm, gm = p_labels == c, g_labels == c
            order = np.argsort(-p_scores[pm], kind="stable")
            scores[c].append(p_scores[pm][order])
            matches[c].append(_match_image(p_boxes[pm][order], g_boxes[gm], g_diff[gm],
                                           iou_threshold, box_offset))

    per_class: list[float] = []
    for c in range(num_classes):
        if n_pos[c] == 0:
            per_class.append(float("nan"))
            continue
        s = np.concatenate(scores[c]) if scores[c] else np.zeros(0)
        m = np.concatenate(matches[c]) if matches[c] else np.zeros(0, np.int8)
        m = m[np.argsort(-s, kind="stable")]
        m = m[m >= 0]  # ignored detections change neither TP nor FP: the PR curve skips them
        tp = np.cumsum(m == 1)
        fp = np.cumsum(m == 0)
        recall = tp / n_pos[c]
        precision = tp / np.maximum(tp + fp, 1)
        per_class.append(average_precision(recall, precision, use_07_metric))
    valid = [ap for ap in per_class if not np.isnan(ap)]
    return {"mAP": float(np.mean(valid)) if valid else float("nan"), "per_class": per_class}
