"""COCO and VOC evaluation against the size of the validation set: faster-coco-eval and pycocotools
timed side by side in one run, with the check that they report the same numbers.

    python benchmarks/scale/coco_eval.py            # 500 .. 5,000 images (several minutes)
    python benchmarks/scale/coco_eval.py --quick    # 100 .. 800 images (LVIS to 400; about a minute)

Cases, each a synthetic set with the real counts, cut to the first N images:

- ``coco``: COCO val2017's 5,000 images, 36,781 boxes over 80 classes (a long-tailed class mix,
  41 % small, 34 % medium, 25 % large boxes, 1 % crowd regions), 100 detections per image: every gt
  box jittered (90 %, a tenth of them under a wrong class) plus random boxes, random scores (a hit
  scores higher on average), so AP is far from both 0 and 1.
- ``lvis``: the same images and boxes per image over LVIS's 1,203 classes (the evaluation's cost
  grows with images x classes).
- ``voc``: ``evaluation.voc.voc_map`` (VOC07 11-point) at VOC07 test size: 4,952 images, 20
  classes, 100 detections each, built the same way.

Each COCO row is ``evaluation.coco.coco_evaluation`` with one backend (what a detection run pays at
each evaluation: the ground-truth copy, the result set, evaluate, accumulate, summarize) and the
largest difference between the two backends over the six stats, every per-class cell and the full
precision / recall arrays. ``seconds`` is wall-clock time, ``cpu_seconds`` this process's CPU
time (the same on a quiet machine; on a shared one the wall time also holds the waits for a
core). The figure (log-log, seconds against images) goes to ``benchmarks/results/scale-coco-eval.png``.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from visiontrain.evaluation.coco import COCO_BACKENDS, CocoEvaluation, coco_evaluation
from visiontrain.evaluation.voc import voc_map

COCO_VAL_IMAGES, COCO_VAL_BOXES, VOC07_TEST_IMAGES = 5_000, 36_781, 4_952
CLASSES = {"coco": 80, "lvis": 1_203, "voc": 20}
DETECTIONS_PER_IMAGE = 100
FULL_SIZES, QUICK_SIZES = (500, 1_000, 2_500, 5_000), (100, 200, 400, 800)
FIGURE = Path(__file__).resolve().parents[1] / "results" / "scale-coco-eval.png"


def synthetic_set(n_images: int, n_classes: int, boxes_per_image: float, seed: int = 0
                  ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], list[np.ndarray], list[np.ndarray],
                             list[np.ndarray]]:
    """Per image: gt boxes XYWH, gt labels, crowd flags, detection boxes XYWH, scores, labels
    (0-based labels), as described in the module. 640 x 480 images."""
    rng = np.random.default_rng(seed)
    class_p = 1.0 / np.arange(1, n_classes + 1) ** 0.8  # long-tailed, as COCO's and LVIS's are
    class_p /= class_p.sum()
    counts = rng.poisson(boxes_per_image, size=n_images)
    out: tuple[list, ...] = ([], [], [], [], [], [])
    for n in counts:
        size_range = rng.choice(3, size=n, p=[0.41, 0.34, 0.25])  # small, medium, large
        side = np.exp(rng.uniform(np.log([4, 32, 96])[size_range], np.log([32, 96, 400])[size_range]))[:, None]
        wh = np.clip(side * np.exp(rng.normal(0, 0.3, size=(n, 2))), 2, 470)
        xy = rng.uniform(0, 1, size=(n, 2)) * (np.array([640, 480]) - wh)
        labels = rng.choice(n_classes, size=n, p=class_p)
        crowd = rng.random(n) < 0.01
        hit = rng.random(n) < 0.9
        d_wh = np.maximum(wh[hit] * np.exp(rng.normal(0, 0.15, size=(hit.sum(), 2))), 1)
        d_xy = xy[hit] + rng.normal(0, 0.1, size=(hit.sum(), 2)) * wh[hit]
        d_labels = np.where(rng.random(hit.sum()) < 0.1, rng.choice(n_classes, size=hit.sum(), p=class_p), labels[hit])
        n_random = max(DETECTIONS_PER_IMAGE - int(hit.sum()), 0)
        r_wh = np.exp(rng.uniform(np.log(4), np.log(400), size=(n_random, 2)))
        r_xy = rng.uniform(0, 1, size=(n_random, 2)) * np.maximum(np.array([640, 480]) - r_wh, 1)
        d_boxes = np.concatenate([np.hstack([d_xy, d_wh]), np.hstack([r_xy, r_wh])])[:DETECTIONS_PER_IMAGE]
        scores = np.concatenate([rng.beta(4, 2, hit.sum()), rng.beta(1.2, 4, n_random)])[:DETECTIONS_PER_IMAGE]
        d_all = np.concatenate([d_labels, rng.choice(n_classes, size=n_random, p=class_p)])[:DETECTIONS_PER_IMAGE]
        for part, value in zip(out, (np.hstack([xy, wh]), labels, crowd, d_boxes, scores, d_all)):
            part.append(value)
    return out  # type: ignore[return-value]


def coco_dicts(parts: tuple[list[np.ndarray], ...], n_images: int, n_classes: int) -> tuple[dict, list[dict]]:
    """The first ``n_images`` of a ``synthetic_set`` as a COCO ground-truth dict and results list."""
    gt_boxes, gt_labels, crowd, det_boxes, scores, det_labels = (p[:n_images] for p in parts)
    images = [{"id": i + 1, "width": 640, "height": 480} for i in range(n_images)]
    anns, dets = [], []
    for i in range(n_images):
        for box, label, is_crowd in zip(gt_boxes[i].tolist(), gt_labels[i].tolist(), crowd[i].tolist()):
            anns.append({"id": len(anns) + 1, "image_id": i + 1, "category_id": label + 1, "bbox": box,
                         "area": box[2] * box[3], "iscrowd": int(is_crowd)})
        dets += [{"image_id": i + 1, "category_id": label + 1, "bbox": box, "score": score}
                 for box, score, label in zip(det_boxes[i].tolist(), scores[i].tolist(), det_labels[i].tolist())]
    categories = [{"id": c + 1, "name": f"class {c + 1}"} for c in range(n_classes)]
    return {"images": images, "annotations": anns, "categories": categories}, dets


def largest_difference(a: CocoEvaluation, b: CocoEvaluation) -> float:
    """The largest absolute difference over the six stats, every per-class cell and the precision /
    recall arrays (NaN against NaN counts as equal; NaN against a number as infinite)."""
    def diff(x: float, y: float) -> float:
        if math.isnan(x) or math.isnan(y):
            return 0.0 if math.isnan(x) and math.isnan(y) else math.inf
        return abs(x - y)

    worst = max(diff(a.metrics[k], b.metrics[k]) for k in a.metrics)
    rows_a, rows_b = a.per_class(), b.per_class()
    worst = max([worst, *(diff(float(rows_a[n][c]), float(rows_b[n][c])) for n in rows_a for c in rows_a[n])])
    for x, y in ((a.precision, b.precision), (a.recall, b.recall)):
        worst = max(worst, float(np.abs(x - y).max()) if x.shape == y.shape else math.inf)
    return worst


def time_coco(case: str, sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    """Both backends at each size (the same ground truth and detections), each timed once."""
    boxes_per_image = COCO_VAL_BOXES / COCO_VAL_IMAGES
    parts = synthetic_set(max(sizes), CLASSES[case], boxes_per_image)
    rows = []
    for n in sizes:
        gt, dets = coco_dicts(parts, n, CLASSES[case])
        results, seconds, cpu = {}, {}, {}
        for backend in COCO_BACKENDS:
            start, start_cpu = time.perf_counter(), time.process_time()
            results[backend] = coco_evaluation(gt, dets, backend=backend)
            seconds[backend], cpu[backend] = time.perf_counter() - start, time.process_time() - start_cpu
        gap = largest_difference(*results.values())
        for backend in COCO_BACKENDS:
            rows.append({"case": case, "images": n, "classes": CLASSES[case], "gt_boxes": len(gt["annotations"]),
                         "detections": len(dets), "backend": backend, "seconds": round(seconds[backend], 3),
                         "cpu_seconds": round(cpu[backend], 3),
                         "AP": results[backend].metrics["AP"], "AP50": results[backend].metrics["AP50"],
                         "largest_difference": gap})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def time_voc(sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    """``voc_map`` (VOC07 11-point) at each size, XYXY arrays built beforehand (not timed)."""
    n_max = max(sizes)
    gt_boxes, gt_labels, _, det_boxes, scores, det_labels = synthetic_set(n_max, CLASSES["voc"], 2.4, seed=1)

    def xyxy(b: np.ndarray) -> np.ndarray:
        return np.hstack([b[:, :2], b[:, :2] + b[:, 2:]])

    preds = [{"boxes": xyxy(b), "scores": s, "labels": lab} for b, s, lab in zip(det_boxes, scores, det_labels)]
    gts = [{"boxes": xyxy(b), "labels": lab} for b, lab in zip(gt_boxes, gt_labels)]
    voc_map(preds[:10], gts[:10], CLASSES["voc"])  # the first call's one-off costs, not timed
    rows = []
    for n in sizes:
        start, start_cpu = time.perf_counter(), time.process_time()
        result = voc_map(preds[:n], gts[:n], CLASSES["voc"], use_07_metric=True)
        seconds, cpu = time.perf_counter() - start, time.process_time() - start_cpu
        rows.append({"case": "voc", "images": n, "classes": CLASSES["voc"],
                     "gt_boxes": int(sum(len(g["labels"]) for g in gts[:n])), "detections": n * DETECTIONS_PER_IMAGE,
                     "backend": "visiontrain voc_map", "seconds": round(seconds, 3), "cpu_seconds": round(cpu, 3),
                     "AP": None, "AP50": result["mAP"], "largest_difference": None})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def figure(rows: list[dict[str, Any]], path: Path = FIGURE) -> Path:
    """Seconds against images, log-log, one line per case and backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in dict.fromkeys((r["case"], r["backend"]) for r in rows):
        line = [r for r in rows if (r["case"], r["backend"]) == key]
        ax.loglog([r["images"] for r in line], [r["seconds"] for r in line], "o-",
                  label=f"{key[0]} ({line[0]['classes']} classes), {key[1]}")
    ax.set_xlabel("validation images (100 detections each)")
    ax.set_ylabel("evaluation time (s)")
    ax.set_title("COCO / VOC box evaluation against the validation set's size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Every case at every size (``quick``: the small sizes); draws the figure of a full run (a
    quick one leaves it as it is); returns the rows."""
    sizes = QUICK_SIZES if quick else FULL_SIZES
    rows = time_coco("coco", sizes) + time_coco("lvis", sizes[:-1] if quick else sizes)
    rows += time_voc(sizes[:-1] + (VOC07_TEST_IMAGES,) if not quick else sizes)
    if not quick:
        figure(rows)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a fixed-width table: one line per case, size and backend."""
    head = (f"{'case':5} {'images':>6} {'gt':>7} {'dets':>7} {'backend':20} {'seconds':>8} {'cpu s':>8} "
            f"{'AP':>7} {'AP50':>7} {'diff':>8}")
    lines = [head]
    for r in rows:
        ap = "" if r["AP"] is None else f"{r['AP']:.4f}"
        gap = "" if r["largest_difference"] is None else f"{r['largest_difference']:.1e}"
        lines.append(f"{r['case']:5} {r['images']:>6} {r['gt_boxes']:>7} {r['detections']:>7} {r['backend']:20} "
                     f"{r['seconds']:>8.2f} {r['cpu_seconds']:>8.2f} {ap:>7} {r['AP50']:>7.4f} {gap:>8}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100 to 800 images (about a minute)")
    rows = run(parser.parse_args().quick)
    print(table(rows))
    print(f"figure: {FIGURE}")
    gaps = [r["largest_difference"] for r in rows if r["largest_difference"] is not None]
    print(f"largest difference between the backends: {max(gaps):.1e}")


if __name__ == "__main__":
    main()
