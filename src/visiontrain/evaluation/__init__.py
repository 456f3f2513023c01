"""Detection evaluation: COCO box AP (pycocotools) and Pascal VOC mAP (VOC07 11-point / area).

Kept apart from the tasks so a metric can be checked against its reference implementation on its
own, and so the COCO path (which needs pycocotools) is imported only when it is used.
"""
from __future__ import annotations

from .coco import COCO_METRICS, coco_evaluate, gather_detections, to_coco_results
from .voc import average_precision, box_iou_np, voc_map

__all__ = ["COCO_METRICS", "coco_evaluate", "gather_detections", "to_coco_results",
           "average_precision", "box_iou_np", "voc_map"]
