"""COCO box AP through faster-coco-eval or pycocotools, built from in-memory dicts, plus the glue.

pycocotools is the reference implementation that published COCO numbers come from, so we run it
(or faster-coco-eval, its C++ port: the same ``COCO`` / ``COCOeval`` interface and the same ``eval``
arrays, 5 to 9 times faster at COCO val's sizes; ``backend`` picks one, see ``COCO_BACKENDS``)
rather than re-implement it. It is fed in memory (``COCO()`` + ``.dataset`` + ``createIndex()``,
for the ground truth and the results alike): no temporary files to clean up or to collide between
ranks or runs.

Returned values are pycocotools' ``stats[0:6]`` as fractions. pycocotools writes -1 where a number
is undefined (no non-crowd gt in that area range, e.g. APs on a set without small objects); we
return NaN there, so an undefined value can never be mistaken for (or averaged in as) a score.

Per category (``coco_evaluation(...).per_class()``), the numbers are read from pycocotools' own
``eval['precision']`` [T, R, K, A, M] and ``eval['recall']`` [T, K, A, M] arrays at area ``all``
and the last ``maxDets`` (100), ignoring -1, as detectron2's ``_derive_coco_results`` does: they
are the ``stats`` a ``COCOeval`` restricted to that one category (``params.catIds = [k]``) reports,
without running it K times.
"""
from __future__ import annotations

import contextlib
import io
import math
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import numpy as np
import torch
import torch.distributed as dist

from visiontrain.core.config import ConfigError, doc, extend_section

__all__ = ["coco_api", "coco_evaluate", "coco_evaluation", "CocoEvaluation", "gather_detections", "to_coco_results",
           "COCO_BACKENDS", "COCO_METRICS", "PER_CLASS_COLUMNS"]

#: The implementations ``coco_evaluation`` can run, the default first. faster-coco-eval gives
#: pycocotools' stats, per-class arrays and PR curves to 1e-12 (tests/evaluation/test_coco_backends.py).
COCO_BACKENDS = ("faster-coco-eval", "pycocotools")


@dataclass
class CocoEvalKeys:
    """The ``eval.*`` key of COCO evaluation, added to the engine's ``eval`` section (which knows
    nothing of boxes) with ``config.extend_section``; detection reads it wherever it evaluates."""
    coco_backend: Literal["faster-coco-eval", "pycocotools"] = doc(
        "COCO box AP implementation (fit's evaluations, validate, per-class table, PR curves): faster-coco-eval "
        "(C++, 5-9x faster at COCO val's size) or pycocotools (the reference); both give the same numbers",
        COCO_BACKENDS[0])


extend_section("eval", CocoEvalKeys)

#: Names of pycocotools' ``stats[0:6]``: AP@[.5:.95], AP@.5, AP@.75, AP small / medium / large.
COCO_METRICS = ("AP", "AP50", "AP75", "APs", "APm", "APl")
#: The columns of ``CocoEvaluation.per_class``: AP@[.5:.95], AP@.5, AR@100 over IoU .5:.95 (COCO's
#: ``AR`` at maxDets 100, ``stats[8]`` of that category alone), and the non-crowd ground-truth boxes.
PER_CLASS_COLUMNS = ("AP", "AP50", "recall", "n_gt")


def _silent(*args: Any, **kwargs: Any) -> None:
    """A print function that prints nothing (faster-coco-eval's ``print_function``)."""


def _quiet(verbose: bool) -> contextlib.AbstractContextManager:
    """pycocotools prints progress and its summary table; keep it unless asked (``verbose``)."""
    return contextlib.nullcontext() if verbose else contextlib.redirect_stdout(io.StringIO())


def _segmentation_area(segmentation: Any, image: dict) -> float:
    """Pixels of a COCO ``segmentation`` (polygons, or RLE compressed or not) in its image, as
    pycocotools rasterises it for mask IoU."""
    from pycocotools import mask as coco_mask  # pycocotools' masks are read only where masks are scored

    height, width = int(image["height"]), int(image["width"])
    if isinstance(segmentation, list):
        rle = coco_mask.merge(coco_mask.frPyObjects(segmentation, height, width))
    elif isinstance(segmentation.get("counts"), list):
        rle = coco_mask.frPyObjects(segmentation, height, width)
    else:
        rle = segmentation
    return float(coco_mask.area(rle))


def _ground_truth_copy(ground_truth: dict, iou_type: str = "bbox") -> dict:
    """Copy the parts pycocotools writes into (COCOeval adds an ``ignore`` key to every gt
    annotation), and fill ``id`` / ``area`` / ``iscrowd`` where absent so minimal dicts work.
    A missing ``area`` becomes the box area for box AP, and the mask's pixels for mask AP (COCO's
    own area is the segmentation's: it decides which of APs / APm / APl an object counts in)."""
    images = {img["id"]: img for img in ground_truth.get("images", [])}
    anns = []
    for i, a in enumerate(ground_truth.get("annotations", [])):
        a = dict(a)
        a.setdefault("id", i + 1)
        a.setdefault("iscrowd", 0)
        if iou_type == "segm" and "segmentation" not in a:
            raise ValueError(f"mask AP: ground-truth annotation id {a['id']} has no 'segmentation'")
        if "area" not in a:
            a["area"] = (_segmentation_area(a["segmentation"], images[a["image_id"]]) if iou_type == "segm"
                         else float(a["bbox"][2]) * float(a["bbox"][3]))
        anns.append(a)
    gt = dict(ground_truth)
    gt["annotations"] = anns
    gt.setdefault("categories", [])
    return gt


def coco_api(backend: str) -> tuple[type, type]:
    """The ``COCO`` and ``COCOeval`` classes of ``backend`` (one of ``COCO_BACKENDS``), imported on
    use; a package not installed is a ``ConfigError`` naming the key, which a detection task raises
    when it builds its data, before any training (not at its first evaluation)."""
    if backend not in COCO_BACKENDS:
        raise ValueError(f"COCO backend {backend!r}: expected one of {', '.join(COCO_BACKENDS)}")
    try:
        if backend == "faster-coco-eval":
            from faster_coco_eval import COCO
            from faster_coco_eval import COCOeval_faster as COCOeval
        else:
            from pycocotools.coco import COCO
            from pycocotools.cocoeval import COCOeval
    except ImportError as err:
        raise ConfigError(f"eval.coco_backend={backend}: the {backend} package cannot be imported ({err}); install "
                          f"it (pip install {backend}, or bash scripts/setup.sh) or choose another backend") from None
    return COCO, COCOeval


def _mean_defined(values: np.ndarray) -> float:
    """Mean over the entries pycocotools did not mark -1 (undefined); NaN if there is none."""
    defined = values[values > -1]
    return float(np.mean(defined)) if defined.size else math.nan


@dataclass
class CocoEvaluation:
    """One COCO evaluation: the summary metrics and the arrays behind them, per category.

    ``precision`` [T, R, K] and ``recall`` [T, K] are pycocotools' ``eval['precision']`` and
    ``eval['recall']`` at area ``all`` and maxDets 100 (the slice every summary number of those
    settings averages), -1 where undefined; K runs over ``category_ids`` (pycocotools sorts them),
    T over ``iou_thresholds`` (0.5:0.05:0.95), R over ``recall_thresholds`` (0:0.01:1).
    """
    metrics: dict[str, float]         # COCO_METRICS, NaN where undefined
    category_ids: list[int]           # K, in pycocotools' (sorted) order
    names: dict[int, str]             # category id -> name, in the ground truth's order
    n_gt: dict[int, int]              # category id -> non-crowd ground-truth boxes
    precision: np.ndarray             # [T, R, K]
    recall: np.ndarray                # [T, K]
    iou_thresholds: np.ndarray        # [T]
    recall_thresholds: np.ndarray     # [R]

    def _index(self, iou: float) -> int:
        hits = np.flatnonzero(np.isclose(self.iou_thresholds, iou))
        if not hits.size:
            raise ValueError(f"IoU {iou} is not one of COCO's thresholds {self.iou_thresholds.tolist()}")
        return int(hits[0])

    def per_class(self) -> dict[str, dict[str, float]]:
        """``{name: {"AP", "AP50", "recall", "n_gt"}}`` in the ground truth's category order (see
        ``PER_CLASS_COLUMNS``); NaN for a category without ground truth, 0 for one never detected."""
        t50 = self._index(0.5)
        out = {}
        for cat, name in self.names.items():
            k = self.category_ids.index(cat)
            out[name] = {"AP": _mean_defined(self.precision[:, :, k]), "AP50": _mean_defined(self.precision[t50, :, k]),
                         "recall": _mean_defined(self.recall[:, k]), "n_gt": self.n_gt[cat]}
        return out

    def pr_curves(self, iou: float = 0.5) -> dict[str, np.ndarray]:
        """``{name: precision [R]}`` at ``iou`` over ``recall_thresholds``, for categories with
        ground truth (pycocotools' interpolated precision: 0 past the highest recall reached)."""
        t = self._index(iou)
        curves = {}
        for cat, name in self.names.items():
            p = self.precision[t, :, self.category_ids.index(cat)]
            if (p > -1).all():
                curves[name] = p.astype(np.float64)
        return curves


def _class_names(categories: list[dict]) -> dict[int, str]:
    """Category id -> a name for the tables: the ground truth's ``name`` (the id when there is
    none), with the id added where two categories share a name, so each is its own row."""
    names = {int(c["id"]): str(c.get("name", c["id"])) for c in categories}
    taken = list(names.values())
    return {cat: f"{name} ({cat})" if taken.count(name) > 1 else name for cat, name in names.items()}


def _result_annotations(detections: Sequence[dict], iou_type: str = "bbox") -> list[dict]:
    """Results as ``loadRes`` makes them (``id`` from 1, ``iscrowd`` 0, ``area`` w * h for boxes and
    the mask's pixels for ``segm``), on copies: the same annotations for either backend, without the
    polygon ``loadRes`` adds to each box (box AP never reads it, and at 100 results per image it is a
    share of the time one can see) and without the masks where boxes are scored."""
    if iou_type == "segm":
        from pycocotools import mask as coco_mask  # as in _segmentation_area

        missing = sum("segmentation" not in d for d in detections)
        if missing:
            raise ValueError(f"mask AP: {missing} of {len(detections)} detections have no 'segmentation'")
        # one mask at a time: pycocotools' area() of a list of more than 255 fails under NumPy 2
        areas = [float(coco_mask.area(d["segmentation"])) for d in detections]
        return [{**d, "area": a, "id": i + 1, "iscrowd": 0} for i, (d, a) in enumerate(zip(detections, areas))]
    return [{**{k: v for k, v in d.items() if k != "segmentation"}, "area": float(d["bbox"][2]) * float(d["bbox"][3]),
             "id": i + 1, "iscrowd": 0} for i, d in enumerate(detections)]


def coco_evaluation(ground_truth: dict, detections: Sequence[dict], *, verbose: bool = False,
                    backend: str = COCO_BACKENDS[0], iou_type: Literal["bbox", "segm"] = "bbox") -> CocoEvaluation:
    """Box AP of COCO results ``{image_id, category_id, bbox [x, y, w, h], score}`` against a
    COCO-format ground-truth dict (``images``, ``annotations``, ``categories``), with the
    per-category arrays (``CocoEvaluation``); ``coco_evaluate`` returns its ``metrics``.
    ``iou_type="segm"``: mask AP instead, from each result's and ground truth's ``segmentation``
    (compressed RLE ``{size, counts}``, or polygons in the ground truth), the same metric names.

    With no detections at all the metrics are 0 (NaN only where undefined). The result set is
    built directly (``_result_annotations``; pycocotools' ``loadRes([])`` fails on an empty list).
    ``verbose=True`` prints the backend's progress and summary table; ``backend``: see ``COCO_BACKENDS``.
    """
    COCO, COCOeval = coco_api(backend)

    gt = _ground_truth_copy(ground_truth, iou_type)
    image_ids = {img["id"] for img in gt.get("images", [])}
    unknown = {d["image_id"] for d in detections} - image_ids
    if unknown:
        raise ValueError(f"detections for image ids not in the ground truth: {sorted(unknown)[:10]}")
    with _quiet(verbose):
        coco_gt = COCO()
        coco_gt.dataset = gt
        coco_gt.createIndex()
        coco_dt = COCO()
        coco_dt.dataset = {"images": list(gt.get("images", [])),
                           "annotations": _result_annotations(detections, iou_type),
                           "categories": list(gt["categories"])}
        coco_dt.createIndex()
        # faster-coco-eval logs its progress and table at INFO (into a run's log at every evaluation):
        # verbose sends them to stdout, as pycocotools prints, and otherwise nowhere
        extra = {"print_function": print if verbose else _silent} if backend == "faster-coco-eval" else {}
        ev = COCOeval(coco_gt, coco_dt, iouType=iou_type, **extra)
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    area = ev.params.areaRngLbl.index("all")
    n_gt = {int(c["id"]): 0 for c in gt["categories"]}
    for a in gt["annotations"]:
        if not a["iscrowd"] and a["category_id"] in n_gt:
            n_gt[a["category_id"]] += 1
    return CocoEvaluation(
        metrics={k: (float(v) if v >= 0 else math.nan) for k, v in zip(COCO_METRICS, ev.stats[:6])},
        category_ids=[int(c) for c in ev.params.catIds], names=_class_names(gt["categories"]), n_gt=n_gt,
        precision=np.asarray(ev.eval["precision"][:, :, :, area, -1]),
        recall=np.asarray(ev.eval["recall"][:, :, area, -1]),
        iou_thresholds=np.asarray(ev.params.iouThrs), recall_thresholds=np.asarray(ev.params.recThrs))


def coco_evaluate(ground_truth: dict, detections: Sequence[dict], *, verbose: bool = False,
                  backend: str = COCO_BACKENDS[0]) -> dict[str, float]:
    """Box AP of COCO results against a COCO-format ground-truth dict (``coco_evaluation``).

    Returns ``{"AP", "AP50", "AP75", "APs", "APm", "APl"}`` in [0, 1] (NaN where pycocotools reports
    -1, see module).
    """
    return coco_evaluation(ground_truth, detections, verbose=verbose, backend=backend).metrics


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
