"""Panoptic quality: PQ, SQ and RQ over a data set, overall, for things and for stuff, and per class,
computed as panopticapi's ``pq_compute`` computes them (Kirillov et al., "Panoptic Segmentation").

The format is COCO panoptic's: an image's segmentation is a PNG whose colour is a segment id,
``id = R + 256 G + 256² B`` (``rgb2id``, ``id2rgb``), and a JSON list ``segments_info`` gives each
id its ``category_id``, ``iscrowd`` and ``area`` (``read_panoptic`` reads both). Id 0 (``VOID``) is
no segment: pixels nobody labelled in the gt, pixels the model left out in a prediction.

``PanopticQuality`` follows ``pq_compute_single_core``, image by image:

* A gt segment and a predicted segment of the same category match when their IoU is above 0.5
  (0.5 itself is no match). The union leaves out the predicted segment's pixels on gt VOID: a
  prediction is not punished for covering what nobody labelled. Crowd gt segments match nothing.
  Above 0.5 no segment can match twice, so the matching is unique without any assignment.
* A match is a TP and adds its IoU; an unmatched non-crowd gt segment is an FN; an unmatched
  predicted segment is an FP unless more than half of it lies on gt VOID or on a crowd region of
  its own category (a crowd is many objects in one segment: predicting them one by one is no error).
* Per class, PQ = ΣIoU / (TP + FP/2 + FN/2), SQ = ΣIoU / TP (0 without a TP), RQ = TP / (TP + FP/2 +
  FN/2), so PQ = SQ × RQ. The PQ, SQ and RQ of all classes, of things and of stuff are the plain
  means over the classes counted (``n``): a class with TP + FP + FN = 0, absent from the gt and from
  the predictions, has no value (None in the per-class table) and is left out of the means rather
  than counted as 0. panopticapi leaves it out too, but lists it as 0.

Where this module departs from panopticapi, on purpose:

* Areas are pixel counts of the id maps, never the JSON's ``area``. panopticapi takes the gt's area
  from the JSON; when that disagrees with the PNG (a gt resized without its JSON, areas of another
  mask), the union can fall below the intersection and an IoU rise above 1: the PQ of 669 reported in
  detectron2#5420. With pixel counts the union is never below the intersection, so every IoU and
  every PQ, SQ and RQ lies in [0, 1] by construction, whatever the ids and categories.
* Input that does not hold together is an error, one line naming it: a segment id in the id map that
  its ``segments_info`` does not list (panopticapi skips such a gt id), a listed segment absent from
  the id map (panopticapi counts such a gt segment as an FN nothing can match), a category id that is
  no category (panopticapi counts a gt one in no mean), an id map of another size than the gt's.
* A prediction's crowd overlap sums every crowd region of its category in the image; panopticapi
  keeps one per category (the last listed). The two agree when an image has at most one crowd
  segment per category.

Each image is scored on its own, so segment ids need only be unique within an image: ids reused
across images, in the gt or in the predictions, cannot mix two images' segments.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from visiontrain.core.panoptic_format import (ID_LIMIT, VOID, SegmentsInfo, id_map, parse_segments,
                                              pixel_counts)
from visiontrain.rundir.metrics_file import PER_CLASS

__all__ = ["PanopticQuality", "pq_metrics"]

@dataclass(frozen=True)
class _Seg:
    """A segment of one image, as the matching reads it: area counted in pixels."""

    category_id: int
    iscrowd: bool
    area: int


@dataclass
class _Counts:
    """One class's tallies over the images seen: what PQ, SQ and RQ are computed from."""

    tp: int = 0
    fp: int = 0
    fn: int = 0
    iou: float = 0.0  # the sum of the TPs' IoU


class PanopticQuality:
    """PQ, SQ and RQ over a data set, fed one image at a time (``update``), read with ``compute``.

    ``categories`` are COCO panoptic's: mappings with ``id``, ``isthing`` (1 thing, 0 stuff) and
    ``name``. Tallies add up, so accumulators of parts of a data set (processes, shards) ``merge``."""

    def __init__(self, categories: Iterable[Mapping[str, Any]]) -> None:
        self.categories: dict[int, dict[str, Any]] = {}
        for category in categories:
            self._add_category(category)
        if not self.categories:
            raise ValueError("PanopticQuality needs at least one category")
        self.reset()

    def _add_category(self, category: Mapping[str, Any]) -> None:
        if "id" not in category or "isthing" not in category:
            raise ValueError(f"a category needs an id and isthing (1 thing, 0 stuff): {dict(category)}")
        cid, isthing = int(category["id"]), category["isthing"]
        name = str(category.get("name", cid))
        if cid in self.categories:
            raise ValueError(f"category id {cid} is given twice")
        if isthing not in (0, 1):  # True and False are 1 and 0
            raise ValueError(f"category {cid} ({name}): isthing must be 1 (thing) or 0 (stuff), got {isthing!r}")
        if any(info["name"] == name for info in self.categories.values()):
            raise ValueError(f"category name {name!r} is given twice (the per-class table is keyed by name)")
        self.categories[cid] = {"name": name, "isthing": bool(isthing)}

    def reset(self) -> None:
        """Forget every image seen (a new evaluation)."""
        self.counts = {cid: _Counts() for cid in self.categories}
        self.images = 0

    def update(self, gt_ids: np.ndarray, gt_segments: SegmentsInfo, pred_ids: np.ndarray,
               pred_segments: SegmentsInfo, image: str | int | None = None) -> None:
        """Score one image: its gt id map [H, W] and segments, the prediction's. ``image`` names it in
        errors (default: its index in this accumulator). Everything is checked before any tally
        changes, so an image refused leaves the accumulator as it was."""
        where = f"image {image}" if image is not None else f"image #{self.images}"
        gt_ids = id_map(gt_ids, f"{where}: gt")
        pred_ids = id_map(pred_ids, f"{where}: pred")
        if pred_ids.shape != gt_ids.shape:
            raise ValueError(f"{where}: the prediction is {pred_ids.shape[0]}x{pred_ids.shape[1]} pixels but the gt "
                             f"is {gt_ids.shape[0]}x{gt_ids.shape[1]} (height x width)")
        gt = self._segments(gt_ids, gt_segments, f"{where}: gt")
        pred = self._segments(pred_ids, pred_segments, f"{where}: pred")
        overlap = _overlaps(gt_ids, pred_ids)
        matched_gt, matched_pred = self._count_matches(gt, pred, overlap)
        self._count_misses(gt, pred, overlap, matched_gt, matched_pred)
        self.images += 1

    def _segments(self, ids: np.ndarray, segments: SegmentsInfo, where: str) -> dict[int, _Seg]:
        """The image's segments by id, with their pixel areas, once checked (ids and categories)."""
        listed = parse_segments(segments, where=f"{where} segments_info")
        area = pixel_counts(ids, listed, where)
        for segment in listed:
            if segment.category_id not in self.categories:
                raise ValueError(f"{where}: segment {segment.id} has category_id {segment.category_id}, which is no "
                                 f"category (the categories are {_id_list(self.categories)})")
        return {s.id: _Seg(s.category_id, s.iscrowd, area[s.id]) for s in listed}

    def _count_matches(self, gt: dict[int, _Seg], pred: dict[int, _Seg],
                       overlap: dict[tuple[int, int], int]) -> tuple[set[int], set[int]]:
        """Tally the TPs: gt and predicted segments of one category, the gt not a crowd, IoU > 0.5
        with the prediction's VOID pixels out of the union. Returns the matched ids of each side."""
        matched_gt: set[int] = set()
        matched_pred: set[int] = set()
        for (g, p), intersection in overlap.items():
            if g == VOID or p == VOID or gt[g].iscrowd or gt[g].category_id != pred[p].category_id:
                continue
            union = pred[p].area + gt[g].area - intersection - overlap.get((VOID, p), 0)
            if 2 * intersection > union:  # IoU > 0.5, exactly in integers (0.5 itself is no match)
                counts = self.counts[gt[g].category_id]
                counts.tp += 1
                counts.iou += intersection / union
                matched_gt.add(g)
                matched_pred.add(p)
        return matched_gt, matched_pred

    def _count_misses(self, gt: dict[int, _Seg], pred: dict[int, _Seg], overlap: dict[tuple[int, int], int],
                      matched_gt: set[int], matched_pred: set[int]) -> None:
        """Tally the FNs (unmatched gt, crowds aside) and the FPs (unmatched predictions, but those more
        than half on VOID or on a crowd region of their own category, which are nobody's error)."""
        crowds: dict[int, list[int]] = {}
        for g, segment in gt.items():
            if segment.iscrowd:
                crowds.setdefault(segment.category_id, []).append(g)
            elif g not in matched_gt:
                self.counts[segment.category_id].fn += 1
        for p, segment in pred.items():
            if p in matched_pred:
                continue
            on_crowds = sum(overlap.get((g, p), 0) for g in crowds.get(segment.category_id, ()))
            ignored = overlap.get((VOID, p), 0) + on_crowds
            if 2 * ignored <= segment.area:  # at most half ignored: an FP
                self.counts[segment.category_id].fp += 1

    def merge(self, other: PanopticQuality) -> None:
        """Add another accumulator's tallies (the same categories) to this one's."""
        if other.categories != self.categories:
            raise ValueError("cannot merge PanopticQuality accumulators of different categories")
        for cid, theirs in other.counts.items():
            mine = self.counts[cid]
            mine.tp += theirs.tp
            mine.fp += theirs.fp
            mine.fn += theirs.fn
            mine.iou += theirs.iou
        self.images += other.images

    def compute(self) -> dict[str, Any]:
        """The results: ``all``, ``things`` and ``stuff`` (each ``pq``, ``sq``, ``rq`` in [0, 1], None
        when no class of it is counted, and ``n`` the classes counted), ``per_class`` (by category id:
        name, isthing, pq, sq, rq, None for a class absent everywhere, and tp, fp, fn) and ``images``."""
        per_class = {cid: self._class_row(cid) for cid in self.categories}
        rows = list(per_class.values())
        return {"all": _mean(rows), "things": _mean([r for r in rows if r["isthing"]]),
                "stuff": _mean([r for r in rows if not r["isthing"]]), "per_class": per_class, "images": self.images}

    def _class_row(self, cid: int) -> dict[str, Any]:
        counts, info = self.counts[cid], self.categories[cid]
        row = {"name": info["name"], "isthing": info["isthing"], "tp": counts.tp, "fp": counts.fp, "fn": counts.fn}
        if counts.tp + counts.fp + counts.fn == 0:  # absent from gt and predictions: no value, not 0
            return {**row, "pq": None, "sq": None, "rq": None}
        denominator = counts.tp + 0.5 * counts.fp + 0.5 * counts.fn
        return {**row, "pq": counts.iou / denominator, "sq": counts.iou / counts.tp if counts.tp else 0.0,
                "rq": counts.tp / denominator}


def _overlaps(gt_ids: np.ndarray, pred_ids: np.ndarray) -> dict[tuple[int, int], int]:
    """Pixels of each (gt id, pred id) pair that meet, VOID included, in one ``np.unique`` pass."""
    pairs = gt_ids.astype(np.uint64) * np.uint64(ID_LIMIT) + pred_ids.astype(np.uint64)
    values, counts = np.unique(pairs, return_counts=True)
    return {(int(v) // ID_LIMIT, int(v) % ID_LIMIT): int(c) for v, c in zip(values, counts)}


def _mean(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The plain mean of pq, sq and rq over the rows that have values, and how many (``n``)."""
    counted = [row for row in rows if row["pq"] is not None]
    if not counted:
        return {"pq": None, "sq": None, "rq": None, "n": 0}
    return {**{key: sum(row[key] for row in counted) / len(counted) for key in ("pq", "sq", "rq")}, "n": len(counted)}


def _id_list(categories: Mapping[int, Any]) -> str:
    """The category ids for an error message, the first 20 of them."""
    ids = sorted(categories)
    return ", ".join(map(str, ids[:20])) + (f", ... ({len(ids)} in all)" if len(ids) > 20 else "")


def pq_metrics(result: Mapping[str, Any]) -> dict[str, Any]:
    """``compute()``'s result as an evaluation's metrics: ``PQ``, ``SQ``, ``RQ``, their ``_th`` (things) and
    ``_st`` (stuff) twins, and the per-class table ``{name: {PQ, SQ, RQ, TP, FP, FN}}`` under
    ``metrics_file.PER_CLASS``. A missing value is NaN there, which the log and report show as a dash."""
    def value(x: float | None) -> float:
        return math.nan if x is None else float(x)

    out: dict[str, Any] = {}
    for group, suffix in (("all", ""), ("things", "_th"), ("stuff", "_st")):
        for key in ("pq", "sq", "rq"):
            out[key.upper() + suffix] = value(result[group][key])
    out[PER_CLASS] = {row["name"]: {"PQ": value(row["pq"]), "SQ": value(row["sq"]), "RQ": value(row["rq"]),
                                    "TP": row["tp"], "FP": row["fp"], "FN": row["fn"]}
                      for row in result["per_class"].values()}
    return out
