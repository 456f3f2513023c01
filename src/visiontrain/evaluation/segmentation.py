"""Semantic segmentation's scores and figures, from one dataset-wide confusion matrix of pixels.

The matrix is ``[true, predicted]`` over every labelled pixel of the split (the ignore index's
pixels are never counted), so the numbers are MMSeg's ``IoUMetric``, which sums the same areas over
the dataset before dividing: per class ``IoU = TP / (TP + FP + FN)`` and ``Acc = TP / (TP + FN)``;
``aAcc`` = all TP / all labelled pixels; ``mIoU`` and ``mAcc`` the means over the classes where
they are defined (``nanmean``). A class absent from both the ground truth and the predictions has
IoU 0 / 0: undefined (NaN, shown as a dash), not 0, and left out of the means; a class predicted
but absent from the ground truth has IoU 0 and an undefined Acc. Fractions in [0, 1] (MMSeg
prints them times 100).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch

from visiontrain.evaluation.confusion import BACKGROUND, _ratio
from visiontrain.evaluation.fonts import use_fonts_with_glyphs
from visiontrain.evaluation.panels import panel_grid
from visiontrain.evaluation.previews import paint_masks

#: The metrics ``semantic_scores`` gives, ``mIoU`` first (the semantic task's eval.metric).
SEMANTIC_METRICS = ("mIoU", "mAcc", "aAcc")


def _nanmean(values: np.ndarray) -> float:
    defined = values[~np.isnan(values)]
    return float(defined.mean()) if defined.size else math.nan


def semantic_scores(counts: Any, class_names: Sequence[str]) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """(``{"mIoU", "mAcc", "aAcc"}``, ``{class: {"IoU", "Acc", "pixels"}}``) of a ``[true, predicted]``
    pixel count matrix (CPU tensor or array); NaN where undefined (the module docstring)."""
    c = np.asarray(counts, dtype=np.int64)
    if c.ndim != 2 or c.shape != (len(class_names), len(class_names)):
        raise ValueError(f"pixel counts of shape {c.shape} for {len(class_names)} classes: need a square "
                         f"[true, predicted] matrix, one row per class")
    tp, labelled, predicted = np.diag(c), c.sum(1), c.sum(0)
    iou, acc = _ratio(tp, labelled + predicted - tp), _ratio(tp, labelled)
    total = labelled.sum()
    metrics = {"mIoU": _nanmean(iou), "mAcc": _nanmean(acc), "aAcc": float(tp.sum() / total) if total else math.nan}
    per_class = {str(name): {"IoU": float(iou[k]), "Acc": float(acc[k]), "pixels": int(labelled[k])}
                 for k, name in enumerate(class_names)}
    return metrics, per_class


def accumulate_pixels(counts: torch.Tensor, truth: torch.Tensor, predicted: torch.Tensor, ignore: int) -> None:
    """Adds one image's pixels to ``counts`` (int64 [C * C + 1], ``[true, predicted]`` flattened, the
    last cell collecting the ignored pixels), in place on the device: a scatter-add, which unlike
    ``bincount`` on a GPU reads nothing back to size its output."""
    c2 = counts.numel() - 1
    c = math.isqrt(c2)
    cells = torch.where(truth == ignore, c2, truth * c + predicted).flatten()
    counts.scatter_add_(0, cells, torch.ones_like(cells))


def background_classes(class_names: Sequence[str]) -> list[int]:
    """The classes the figures and overlays leave unpainted, so that the image shows: those named
    background (any case), as fashion-mosaic's class 0 is."""
    return [k for k, name in enumerate(class_names) if str(name).lower() == BACKGROUND]


def painted_classes(pixels: np.ndarray, labels: np.ndarray, unpainted: Sequence[int]) -> np.ndarray:
    """An image ([H, W, 3] in [0, 1]) with each class of a label map filled in its class colour
    (``previews.paint_masks``, the colours of every other figure); the classes in ``unpainted`` (a
    background) and values that are no class are left as the image is."""
    classes = [int(k) for k in np.unique(labels) if int(k) not in unpainted]
    masks = labels[None] == np.asarray(classes, dtype=labels.dtype).reshape(-1, 1, 1)
    return paint_masks(pixels, masks, classes)


def segmentation_figure(shown: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]], class_names: Sequence[str], *,
                        unpainted: Sequence[int] = ()) -> Any:
    """Each shown image (pixels [H, W, 3] in [0, 1], true and predicted label maps [H, W]) twice,
    side by side: its ground truth painted, then the prediction, with the classes each holds."""
    fig, axes = panel_grid(2 * len(shown), title="validation images: ground truth (left), prediction (right), in "
                                                 "class colours", width=3.4, height=3.2)
    for k, (pixels, truth, predicted) in enumerate(shown):
        for ax, labels, what in ((axes[2 * k], truth, "truth"), (axes[2 * k + 1], predicted, "predicted")):
            ax.imshow(painted_classes(pixels, labels, unpainted), interpolation="nearest")
            names = [class_names[v] for v in np.unique(labels) if v < len(class_names) and v not in unpainted]
            ax.set_title(f"{what}: {', '.join(names[:4])}{' ...' if len(names) > 4 else ''}", fontsize=7)
            ax.set_axis_off()
    return use_fonts_with_glyphs(fig)
