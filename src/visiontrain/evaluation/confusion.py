"""Confusion matrices and the per-class numbers read from them.

Both matrices are ``[true, predicted]``: row ``i`` counts where the objects (images) of true class
``i`` went, as the classification figure draws it.

Classification (``classification_per_class``): from the counts the task accumulates, per class
``precision = TP / predicted as the class``, ``recall = TP / support`` (the images of the class)
and ``F1 = 2 TP / (2 TP + FP + FN)``, the harmonic mean of the two; a ratio whose denominator is 0
(a class never predicted, or absent from the validation set) is NaN, not 0: undefined, never a score.

Detection (``detection_confusion``), Ultralytics' convention for ``yolo val``'s confusion matrix
with one addition: predictions scoring at least ``score_threshold`` (0.25) are matched one-to-one
to ground-truth boxes at IoU >= ``iou_threshold`` (0.5) in each image, first pairs of the same class
(greedy by IoU, highest first: the true positives AP counts), then, among the boxes and predictions
left, pairs of different classes (an object found under the wrong class). The extra row and column
are *background*: a ground-truth box left unmatched adds to ``[its class, background]`` (missed),
a prediction left unmatched to ``[background, its class]`` (a false positive, duplicates
included); ``[background, background]`` is always 0. Matching the same class first means a wrong
duplicate over an object already found is a false positive, as AP counts it, not a confusion.
VOC *difficult* boxes count nowhere, and neither does a prediction matched to one.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from visiontrain.evaluation.voc import box_iou_np, image_arrays

__all__ = ["classification_per_class", "detection_confusion", "CONFUSION_SCORE", "CONFUSION_IOU", "BACKGROUND"]

#: A detection takes part in the confusion matrix from this score up (Ultralytics' ``conf`` default).
CONFUSION_SCORE = 0.25
#: A prediction and a ground-truth box are a pair from this IoU up.
CONFUSION_IOU = 0.5
#: The name of the extra row and column of a detection confusion matrix.
BACKGROUND = "background"


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den, NaN where den is 0."""
    out = np.full(num.shape, np.nan)
    np.divide(num, den, out=out, where=den > 0)
    return out


def classification_per_class(counts: Any, class_names: Sequence[Any]) -> dict[str, dict[str, float]]:
    """``{name: {"precision", "recall", "F1", "support"}}`` from a ``[true, predicted]`` count matrix
    (a CPU tensor or array), in the order of ``class_names``; fractions in [0, 1], NaN where
    undefined (see module), support an int."""
    c = np.asarray(counts, dtype=np.int64)
    if c.ndim != 2 or c.shape[0] != c.shape[1] or c.shape[0] != len(class_names):
        raise ValueError(f"confusion counts of shape {tuple(c.shape)} for {len(class_names)} classes: "
                         f"need a square [true, predicted] matrix, one row per class")
    tp, predicted, support = np.diag(c), c.sum(0), c.sum(1)
    precision, recall = _ratio(tp, predicted), _ratio(tp, support)
    f1 = _ratio(2 * tp, predicted + support)  # 2TP + FP + FN
    return {str(name): {"precision": float(precision[k]), "recall": float(recall[k]), "F1": float(f1[k]),
                        "support": int(support[k])} for k, name in enumerate(class_names)}


def _greedy(iou: np.ndarray, allowed: np.ndarray, free_p: np.ndarray, free_g: np.ndarray,
            threshold: float) -> list[tuple[int, int]]:
    """Pairs (prediction, gt) among the free ones with ``allowed`` and IoU >= threshold, highest IoU
    first (ties: the earlier prediction, i.e. the higher score); each taken pair frees neither again."""
    cand = np.argwhere(allowed & (iou >= threshold) & free_p[:, None] & free_g[None, :])
    order = np.argsort(-iou[cand[:, 0], cand[:, 1]], kind="stable")
    pairs = []
    for p, g in cand[order]:
        if free_p[p] and free_g[g]:
            free_p[p] = free_g[g] = False
            pairs.append((int(p), int(g)))
    return pairs


def detection_confusion(predictions: Sequence[dict], ground_truths: Sequence[dict], num_classes: int, *,
                        score_threshold: float = CONFUSION_SCORE, iou_threshold: float = CONFUSION_IOU
                        ) -> np.ndarray:
    """Counts ``[num_classes + 1, num_classes + 1]``, ``[true, predicted]``, index ``num_classes``
    the background (the matching convention is the module's).

    Args:
        predictions: per image ``{"boxes": [N, 4] XYXY, "scores": [N], "labels": [N]}``.
        ground_truths: per image, same order, ``{"boxes": [M, 4], "labels": [M]}`` and optionally
            ``"difficult"`` [M] (as ``voc_map`` takes them; negative labels are padding).
    """
    if len(predictions) != len(ground_truths):
        raise ValueError(f"{len(predictions)} prediction entries for {len(ground_truths)} images")
    bg = num_classes
    counts = np.zeros((num_classes + 1, num_classes + 1), dtype=np.int64)
    for i, (pred, gt) in enumerate(zip(predictions, ground_truths)):
        p_boxes, p_scores, p_labels, g_boxes, g_labels, g_diff = image_arrays(i, pred, gt, num_classes)
        order = np.argsort(-p_scores, kind="stable")
        order = order[p_scores[order] >= score_threshold]
        p_boxes, p_labels = p_boxes[order], p_labels[order]
        iou = box_iou_np(p_boxes, g_boxes)
        free_p, free_g = np.ones(len(p_labels), bool), np.ones(len(g_labels), bool)
        same = p_labels[:, None] == g_labels[None, :]
        pairs = _greedy(iou, same, free_p, free_g, iou_threshold) + _greedy(iou, ~same, free_p, free_g, iou_threshold)
        for p, g in pairs:
            if not g_diff[g]:
                counts[g_labels[g], p_labels[p]] += 1
        np.add.at(counts, (g_labels[free_g & ~g_diff], bg), 1)
        np.add.at(counts, (bg, p_labels[free_p]), 1)
    return counts
