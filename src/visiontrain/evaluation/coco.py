"""COCO box AP through pycocotools, built from in-memory dicts, plus the glue around it.

pycocotools is the reference implementation that published COCO numbers come from, so we run it
rather than re-implement it. It is fed in memory (``COCO()`` + ``.dataset`` + ``createIndex()``,
``loadRes(list)``): no temporary files to clean up or to collide between ranks or runs.

Returned values are pycocotools' ``stats[0:6]`` as fractions. pycocotools writes -1 where a number
is undefined (no non-crowd gt in that area range, e.g. APs on a set without small objects); we
return NaN there, so an undefined value can never be mistaken for (or averaged in as) a score.
"""
from __future__ import annotations

import contextlib
import io
import math
from typing import Any, Sequence

import torch
import torch.distributed as dist

__all__ = ["coco_evaluate", "gather_detections", "to_coco_results", "COCO_METRICS"]

#: Names of pycocotools' ``stats[0:6]``: AP@[.5:.95], AP@.5, AP@.75, AP small / medium / large.
COCO_METRICS = ("AP", "AP50", "AP75", "APs", "APm", "APl")


def _quiet(verbose: bool) -> contextlib.AbstractContextManager:
    """pycocotools prints progress and its summary table; keep it unless asked (``verbose``)."""
    return contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())


def _ground_truth_copy(ground_truth: dict) -> dict:
    """Copy the parts pycocotools writes into (COCOeval adds an ``ignore`` key to every gt
    annotation), and fill ``id`` / ``area`` / ``iscrowd`` where absent so minimal dicts work.
    A missing ``area`` becomes the box area (COCO's own is the segmentation area)."""
    anns = []
    for i, a in enumerate(ground_truth.get("annotations", [])):
        a = dict(a)
        a.setdefault("id", i + 1)
        a.setdefault("iscrowd", 0)
        if "area" not in a:
            a["area"] = float(a["bbox"][2]) * float(a["bbox"][3])
        anns.append(a)
    gt = dict(ground_truth)
    gt["annotations"] = anns
    gt.setdefault("categories", [])
    return gt


def coco_evaluate(ground_truth: dict, detections: Sequence[dict], *,
                  verbose: bool = False) -> dict[str, float]:
    """Box AP of COCO results ``{image_id, category_id, bbox [x, y, w, h], score}`` against a
    COCO-format ground-truth dict (``images``, ``annotations``, ``categories``).

    Returns ``{"AP", "AP50", "AP75", "APs", "APm", "APl"}`` in [0, 1] (NaN where pycocotools reports
    -1, see module). With no detections at all the metrics are 0 (NaN only where undefined): the
    empty result set is built directly, since ``loadRes([])`` fails on an empty list.
    ``verbose=True`` lets pycocotools print its usual progress lines and summary table.
    """
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    gt = _ground_truth_copy(ground_truth)
    image_ids = {img["id"] for img in gt.get("images", [])}
    unknown = {d["image_id"] for d in detections} - image_ids
    if unknown:
        raise ValueError(f"detections for image ids not in the ground truth: {sorted(unknown)[:10]}")
    with _quiet(verbose):
        coco_gt = COCO()
        coco_gt.dataset = gt
        coco_gt.createIndex()
        if detections:
            # loadRes writes area / id / iscrowd / segmentation into each dict: give it copies
            coco_dt = coco_gt.loadRes([dict(d) for d in detections])
        else:
            coco_dt = COCO()
            coco_dt.dataset = {"images": list(gt.get("images", [])), "annotations": [],
                               "categories": list(gt["categories"])}
            coco_dt.createIndex()
        ev = COCOeval(coco_gt, coco_dt, iouType="bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return {k: (float(v) if v >= 0 else math.nan) for k, v in zip(COCO_METRICS, ev.stats[:6])}


def gather_detections(detections: list[dict], dst: int | None = None) -> list[dict]:
    """Every rank's COCO results, concatenated in rank order.

    ``dst=None`` (default): ``all_gather_object``, the full list on every rank, so every rank can
    compute the same metrics with no broadcast (like ``all_reduce`` for classification). ``dst=r``:
    ``gather_object`` to rank ``r`` only (less memory elsewhere); other ranks get ``[]``.

    The eval loader's ``DistributedSampler`` pads the data set by repeating images on some ranks,
    and a repeated image would add duplicate detections (FPs). Each image is evaluated whole on one
    rank, so an image id already reported by a lower rank is dropped from the higher ranks' lists.
    Single process (or no process group): returns ``detections`` itself.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return detections
    world = dist.get_world_size()
    parts: list[Any] = [None] * world
    if dst is None:
        dist.all_gather_object(parts, detections)
    else:
        dist.gather_object(detections, parts if dist.get_rank() == dst else None, dst=dst)
        if dist.get_rank() != dst:
            return []
    out: list[dict] = []
    seen: set[int] = set()
    for part in parts:
        ids = {d["image_id"] for d in part}
        out.extend(d for d in part if d["image_id"] not in seen)
        seen |= ids
    return out


def to_coco_results(boxes_xyxy: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor,
                    image_id: int, category_ids: Sequence[int]) -> list[dict]:
    """One image's predictions (absolute XYXY in original-image pixels, contiguous labels) as
    COCO results: ``bbox`` is ``[x, y, w, h]`` floats, ``category_id = category_ids[label]``.
    One host transfer for the whole image, then plain Python floats (JSON-serialisable)."""
    boxes = boxes_xyxy.detach().reshape(-1, 4).to("cpu", torch.float64)
    xywh = torch.cat([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], dim=1).tolist()
    score_list = scores.detach().reshape(-1).to("cpu", torch.float64).tolist()
    label_list = labels.detach().reshape(-1).to("cpu").tolist()
    if not (len(xywh) == len(score_list) == len(label_list)):
        raise ValueError(f"{len(xywh)} boxes, {len(score_list)} scores, {len(label_list)} labels")
    return [{"image_id": int(image_id), "category_id": int(category_ids[int(lab)]), "bbox": box,
             "score": s} for box, s, lab in zip(xywh, score_list, label_list)]
