"""Detection evaluation: COCO box AP (faster-coco-eval or pycocotools: ``eval.coco_backend``) and
Pascal VOC mAP (VOC07 11-point / area), per class too, and the confusion matrices (detection's, with
a background class) with the per-class precision / recall / F1 read from them.

Kept apart from the tasks so a metric can be checked against its reference implementation on its
own, and so the COCO path (which needs faster-coco-eval or pycocotools) is imported only when it is used.

The names below are loaded on first use: the submodules need torch, and the engine's plots import
``evaluation.panels`` from commands (``visiontrain report``, ``compare``) that must start without it.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .coco import COCO_METRICS, CocoEvaluation, coco_evaluate, coco_evaluation, gather_detections, to_coco_results
    from .confusion import classification_per_class, detection_confusion
    from .voc import average_precision, box_iou_np, voc_map

_HOMES = {"COCO_METRICS": "coco", "CocoEvaluation": "coco", "coco_evaluate": "coco", "coco_evaluation": "coco",
          "gather_detections": "coco", "to_coco_results": "coco", "classification_per_class": "confusion",
          "detection_confusion": "confusion", "average_precision": "voc", "box_iou_np": "voc", "voc_map": "voc"}

__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
