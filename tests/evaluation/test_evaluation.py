"""Detection metrics: COCO AP (and per category) equals pycocotools run on its own from a JSON file;
VOC mAP equals hand-computed values and a loop-by-loop port of the devkit's matching; result
conversion/gather; the detection confusion matrix on a hand-made scene; classification precision /
recall / F1 from a confusion matrix against scikit-learn."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from detection_helpers import coco_detections, coco_truth
from visiontrain.evaluation import (average_precision, classification_per_class, coco_evaluate, coco_evaluation,
                                    detection_confusion, gather_detections, to_coco_results, voc_map)

KEYS = ("AP", "AP50", "AP75", "APs", "APm", "APl")


def _pycocotools_reference(tmp_path, gt: dict, dets: list[dict]) -> dict[str, float]:
    """pycocotools the documented way: annotation JSON file, loadRes on a results JSON file."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    (tmp_path / "gt.json").write_text(json.dumps(gt))
    (tmp_path / "dt.json").write_text(json.dumps(dets))
    coco_gt = COCO(annotation_file=str(tmp_path / "gt.json"))
    ev = COCOeval(coco_gt, coco_gt.loadRes(str(tmp_path / "dt.json")), iouType="bbox")
    ev.evaluate(), ev.accumulate(), ev.summarize()
    return dict(zip(KEYS, ev.stats[:6].tolist()))


def test_coco_evaluate_matches_pycocotools(tmp_path):
    gt, dets = coco_truth(), coco_detections()
    gt_before, dets_before = json.dumps(gt), json.dumps(dets)
    ours, ref = coco_evaluate(gt, dets), _pycocotools_reference(tmp_path, gt, dets)
    assert all(0.0 < ref[k] < 1.0 for k in KEYS)  # non-trivial numbers in every area range
    assert list(ours) == list(KEYS) and all(ours[k] == pytest.approx(ref[k], abs=1e-9) for k in KEYS)
    assert json.dumps(gt) == gt_before and json.dumps(dets) == dets_before  # inputs untouched


def test_coco_evaluate_perfect_and_empty(capsys):
    gt = coco_truth()
    perfect = [{"image_id": a["image_id"], "category_id": a["category_id"], "bbox": list(a["bbox"]),
                "score": 1.0} for a in gt["annotations"] if not a["iscrowd"]]
    assert coco_evaluate(gt, perfect) == {k: pytest.approx(1.0, abs=1e-12) for k in KEYS}
    assert coco_evaluate(gt, []) == {k: 0.0 for k in KEYS}
    assert capsys.readouterr().out == ""  # pycocotools' printing is suppressed ...
    coco_evaluate(gt, perfect, verbose=True)
    assert "Average Precision" in capsys.readouterr().out  # ... unless verbose


def test_coco_evaluate_undefined_is_nan_and_unknown_image_is_an_error():
    gt = coco_truth()
    gt["annotations"] = [a for a in gt["annotations"] if a["area"] >= 32 ** 2]  # no small objects
    assert math.isnan((res := coco_evaluate(gt, coco_detections()))["APs"]) and 0.0 < res["AP"] < 1.0
    with pytest.raises(ValueError, match="not in the ground truth"):
        coco_evaluate(gt, [{"image_id": 99, "category_id": 1, "bbox": [0, 0, 5, 5], "score": 0.5}])


def test_coco_per_class_is_pycocotools_restricted_to_each_category(tmp_path):
    """Per category AP, AP50 and recall (AR@100) equal the stats of a COCOeval run on that category
    alone (``params.catIds = [k]``), the PR curve its precision at IoU 0.5; categories listed out of
    id order, one never detected (AP 0), one without ground truth (NaN, no curve)."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    gt, dets = coco_truth(), coco_detections()
    gt["annotations"] += [{"id": 100 + i, "image_id": im, "category_id": 12, "bbox": b, "area": 400.0, "iscrowd": 0}
                          for i, (im, b) in enumerate([(1, [400, 10, 20, 20]), (5, [500, 300, 20, 20])])]
    gt["categories"] = [{"id": 9, "name": "c"}, {"id": 1, "name": "a"}, {"id": 15, "name": "e"},
                        {"id": 5, "name": "b"}, {"id": 12, "name": "d"}]
    dets.append({"image_id": 2, "category_id": 15, "bbox": [5.0, 5.0, 30.0, 30.0], "score": 0.8})
    result = coco_evaluation(gt, dets)
    assert result.metrics == coco_evaluate(gt, dets)
    ours = result.per_class()
    assert list(ours) == ["c", "a", "e", "b", "d"]  # the ground truth's order
    (tmp_path / "gt.json").write_text(json.dumps(gt))
    (tmp_path / "dt.json").write_text(json.dumps(dets))
    coco_gt = COCO(annotation_file=str(tmp_path / "gt.json"))
    coco_dt = coco_gt.loadRes(str(tmp_path / "dt.json"))
    curves = result.pr_curves(0.5)
    for cat in gt["categories"]:
        ev = COCOeval(coco_gt, coco_dt, iouType="bbox")
        ev.params.catIds = [cat["id"]]
        ev.evaluate(), ev.accumulate(), ev.summarize()
        ref = {"AP": ev.stats[0], "AP50": ev.stats[1], "recall": ev.stats[8]}  # stats[8]: AR maxDets 100
        row = ours[cat["name"]]
        for key, value in ref.items():
            assert (math.isnan(row[key]) if value < 0 else row[key] == pytest.approx(value, abs=1e-9)), (cat, key)
        assert row["n_gt"] == sum(a["category_id"] == cat["id"] and not a["iscrowd"] for a in gt["annotations"])
        if ref["AP"] < 0:  # no ground truth
            assert cat["name"] not in curves
        else:
            np.testing.assert_allclose(curves[cat["name"]], ev.eval["precision"][0, :, 0, 0, -1], atol=1e-12)
    assert ours["d"]["AP"] == 0.0 and ours["d"]["n_gt"] == 2 and math.isnan(ours["e"]["AP"])
    assert 0.0 < min(ours[n]["AP"] for n in "abc") and max(ours[n]["AP"] for n in "abc") < 1.0


def test_detection_confusion_on_a_hand_made_scene():
    """Rows true, columns predicted, index 3 background; same-class pairs are matched first."""
    scene = [  # (gt boxes, gt labels, difficult), (pred boxes, labels, scores)
        (([[0, 0, 10, 10], [20, 20, 40, 40], [50, 50, 60, 60]], [0, 1, 2], None),
         ([[0, 0, 10, 9],    # class 0 over gt 0 at IoU 0.9: the true positive
           [0, 0, 10, 10],   # class 1 over gt 0 at IoU 1.0, higher score: a duplicate, background
           [20, 20, 40, 38],  # class 2 over gt 1 (class 1) at IoU 0.9: a confusion
           [80, 80, 90, 90],  # class 1 over nothing: background
           [50, 50, 60, 54],  # class 2 over gt 2 at IoU 0.4: background, and gt 2 missed
           [20, 20, 40, 40]],  # class 1 over gt 1, score below 0.25: not counted at all
          [0, 1, 2, 1, 2, 1], [0.9, 0.95, 0.8, 0.7, 0.6, 0.1])),
        (([], [], None), ([[0, 0, 5, 5]], [2], [0.5])),  # an image without gt: a false positive
        (([[0, 0, 10, 10], [30, 30, 40, 40]], [0, 1], [True, False]),  # a difficult box counts nowhere,
         ([[0, 0, 10, 10]], [0], [0.9])),                               # nor the prediction on it
    ]
    preds = [{"boxes": np.array(b, float).reshape(-1, 4), "labels": np.array(lab), "scores": np.array(s)}
             for _, (b, lab, s) in scene]
    gts = [{"boxes": np.array(b, float).reshape(-1, 4), "labels": np.array(lab, np.int64),
            **({"difficult": np.array(d)} if d is not None else {})} for (b, lab, d), _ in scene]
    expected = [[1, 0, 0, 0],
                [0, 0, 1, 1],
                [0, 0, 0, 1],
                [0, 2, 2, 0]]
    assert detection_confusion(preds, gts, 3).tolist() == expected
    # a threshold below the last prediction's score takes it in: of its class, it takes gt 1 from the
    # class 2 box (same class first, whatever the IoU), which becomes a false positive
    low = detection_confusion(preds, gts, 3, score_threshold=0.05).tolist()
    assert low[1] == [0, 1, 0, 1] and low[3] == [0, 2, 3, 0]
    with pytest.raises(ValueError, match="image 0: prediction label 3 >= num_classes=3"):
        detection_confusion([{**preds[0], "labels": np.array([0, 1, 2, 1, 2, 3])}], gts[:1], 3)


def test_classification_precision_recall_f1_against_sklearn():
    from sklearn.metrics import precision_recall_fscore_support

    counts = np.array([[5, 1, 0, 0, 1],   # [true, predicted]
                       [2, 3, 0, 1, 0],
                       [1, 0, 0, 1, 0],   # class 2: never predicted -> precision undefined
                       [1, 0, 0, 4, 0],
                       [0, 0, 0, 0, 0]])  # class 4: no image of it -> recall undefined
    names = ["w", "x", "y", "z", "v"]
    ours = classification_per_class(torch.from_numpy(counts), names)
    assert list(ours) == names
    assert ours["w"] == {"precision": 5 / 9, "recall": 5 / 7, "F1": 10 / 16, "support": 7}
    assert math.isnan(ours["y"]["precision"]) and ours["y"]["recall"] == 0.0 and ours["y"]["F1"] == 0.0
    assert math.isnan(ours["v"]["recall"]) and ours["v"]["precision"] == 0.0 and ours["v"]["support"] == 0
    y_true = np.repeat(np.arange(5), counts.sum(1))
    y_pred = np.concatenate([np.repeat(np.arange(5), row) for row in counts])
    ref = precision_recall_fscore_support(y_true, y_pred, labels=range(5), zero_division=np.nan)
    for column, values in zip(("precision", "recall", "F1", "support"), ref):
        np.testing.assert_allclose([ours[n][column] for n in names], values, rtol=1e-12, equal_nan=True)
    with pytest.raises(ValueError, match="shape \\(5, 5\\) for 4 classes"):
        classification_per_class(counts, names[:4])


def test_to_coco_results():
    boxes = torch.tensor([[10.0, 20.0, 50.0, 80.0], [0.5, 1.5, 2.0, 3.0]])
    out = to_coco_results(boxes, torch.tensor([0.9, 0.25]), torch.tensor([2, 0]), image_id=42,
                          category_ids=[1, 5, 9])
    assert out == [{"image_id": 42, "category_id": 9, "bbox": [10.0, 20.0, 40.0, 60.0],
                    "score": pytest.approx(0.9)},
                   {"image_id": 42, "category_id": 1, "bbox": [0.5, 1.5, 1.5, 1.5], "score": 0.25}]
    assert all(type(v) is float for d in out for v in d["bbox"]) and type(out[0]["category_id"]) is int
    json.dumps(out)  # plain Python types
    assert to_coco_results(torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, dtype=torch.long), 1, [1]) == []


def test_gather_detections_single_process_is_identity():
    assert gather_detections(dets := coco_detections()) is dets


def _gather_worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    # rank 1 also got image 1 again (DistributedSampler padding): its copy must be dropped
    mine = [{"image_id": 1, "score": 0.9}, {"image_id": 2, "score": 0.8}] if rank == 0 else \
        [{"image_id": 3, "score": 0.7}, {"image_id": 1, "score": 0.9}]
    out = {"all": gather_detections(mine), "dst0": gather_detections(mine, dst=0)}
    (Path(out_dir) / f"{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def test_gather_detections_two_ranks(tmp_path):
    mp.spawn(_gather_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    expected = [{"image_id": 1, "score": 0.9}, {"image_id": 2, "score": 0.8}, {"image_id": 3, "score": 0.7}]
    assert r0["all"] == r1["all"] == expected
    assert r0["dst0"] == expected and r1["dst0"] == []


# ----------------------------------------------------------------------------------------- VOC
def _img(boxes, labels, scores=None, difficult=None) -> dict:
    d = {"boxes": np.asarray(boxes, np.float32).reshape(-1, 4), "labels": np.asarray(labels, np.int64),
         "scores": scores, "difficult": difficult}
    return {k: np.asarray(v) for k, v in d.items() if v is not None}


A, B, FAR = [0, 0, 10, 10], [20, 20, 30, 30], [50, 50, 60, 60]


def test_voc_hand_computed_tp_fp_tp():
    # 2 gts; detections by score 0.9 (hits A: TP), 0.8 (nothing: FP), 0.7 (hits B: TP)
    # precision after each = [1/1, 1/2, 2/3], recall = [1/2, 1/2, 2/2]
    gt = [_img([A, B], [0, 0])]
    pred = [_img([A, FAR, B], [0, 0, 0], [0.9, 0.8, 0.7])]
    # 11-point: thresholds 0.0..0.5 (6 of them) reach precision 1 (the first detection, recall .5);
    # 0.6..1.0 (5 of them) only the last point, precision 2/3: (6 * 1 + 5 * 2/3) / 11 = 9.3333 / 11
    ap07 = (6 * 1 + 5 * (2 / 3)) / 11
    assert ap07 == pytest.approx(0.848485, abs=1e-6)
    assert voc_map(pred, gt, 1)["mAP"] == pytest.approx(ap07, abs=1e-12)
    # area: recall 0 -> .5 at envelope precision 1, .5 -> 1 at 2/3: 0.5 * 1 + 0.5 * 2/3 = 0.8333
    area = pytest.approx(0.5 + 0.5 * 2 / 3, abs=1e-12)
    assert voc_map(pred, gt, 1, use_07_metric=False) == {"mAP": area, "per_class": [area]}
    tensors = [[{k: torch.as_tensor(v) for k, v in d[0].items()}] for d in (pred, gt)]  # torch in: same
    assert voc_map(*tensors, 1, use_07_metric=False)["mAP"] == area


def test_voc_difficult_duplicate_and_class_without_gt():
    # B is difficult: the 0.95 detection on it is ignored (neither TP nor FP), A at 0.5 is a TP
    # -> the curve is the single point P = 1, R = 1 (1 non-difficult gt): AP 1
    gt = [_img([A, B], [0, 0], difficult=[False, True])]
    assert voc_map([_img([B, A], [0, 0], [0.95, 0.5])], gt, 1)["per_class"] == [pytest.approx(1.0)]
    # whereas a detection on nothing is a FP: FP then TP, P = [0, 1/2], R = [0, 1] -> area AP 0.5
    assert voc_map([_img([FAR, A], [0, 0], [0.95, 0.5])], gt, 1, use_07_metric=False)["mAP"] == \
        pytest.approx(0.5)
    # a duplicate of an already matched gt is a FP: A found at 0.9 (TP) and again at 0.8 (IoU 0.95,
    # FP), then B in a second image at 0.7 (TP) -> TP, FP, TP: the hand case, over two images
    gt3 = [_img([A], [0]), _img([B], [0])]
    pred3 = [_img([A, [0.5, 0, 10, 10]], [0, 0], [0.9, 0.8]), _img([B], [0], [0.7])]
    assert voc_map(pred3, gt3, 1)["mAP"] == pytest.approx((6 + 5 * 2 / 3) / 11, abs=1e-12)
    # detections of another image never match: B predicted in image 0 only is a FP
    assert voc_map([_img([B], [0], [0.9]), _img(np.zeros((0, 4)), [], [])], gt3, 1)["mAP"] == 0.0
    # class 1 has no gt (only a detection): NaN, left out of the mean; class 2 is missed: AP 0
    res = voc_map([_img([A, FAR], [0, 1], [0.9, 0.8])], [_img([A, B], [0, 2])], 3)
    assert res["per_class"][0] == pytest.approx(1.0) and math.isnan(res["per_class"][1])
    assert res["per_class"][2] == 0.0 and res["mAP"] == pytest.approx(0.5)
    # no gt at all: mAP NaN; negative labels are padding and dropped
    assert math.isnan(voc_map([_img([A], [0], [0.9])], [_img(np.zeros((0, 4)), [])], 2)["mAP"])
    assert voc_map([_img([A, B], [0, -1], [0.9, 0.99])], [_img([A], [0])], 1)["mAP"] == 1.0
    with pytest.raises(ValueError, match="num_classes"):
        voc_map([_img([A], [3], [0.9])], [_img([A], [0])], 2)


def test_voc_threshold_offset_and_multi_image():
    # IoU([0,0,10,10], [0,0,10,20]) = 100/200 = 0.5 exactly: matched at >= 0.5
    pred = [_img([A], [0], [0.9])]
    assert voc_map(pred, [_img([[0, 0, 10, 20]], [0])], 1)["mAP"] == 1.0
    assert voc_map(pred, [_img([[0, 0, 10, 20]], [0])], 1, iou_threshold=0.51)["mAP"] == 0.0
    # gt [0,0,10,21]: continuous 100/210 = 0.476, a miss; devkit inclusive pixels (box_offset=1)
    # (11*11) / (11*22) = 0.5, a match
    assert voc_map(pred, [_img([[0, 0, 10, 21]], [0])], 1)["mAP"] == 0.0
    assert voc_map(pred, [_img([[0, 0, 10, 21]], [0])], 1, box_offset=1.0)["mAP"] == 1.0
    # 10 gts over 5 images, 3 found first: recall exactly 0.3 must count for the 0.3 threshold
    gt10 = [_img([A, B], [0, 0]) for _ in range(5)]
    pred10 = [_img([A], [0], [0.9 - 0.1 * i]) if i < 3 else _img(np.zeros((0, 4)), [], [])
              for i in range(5)]
    assert voc_map(pred10, gt10, 1)["mAP"] == pytest.approx(4 / 11)  # t = 0, .1, .2, .3: precision 1
    assert average_precision(np.array([]), np.array([]), True) == 0.0


def _devkit_reference(preds, gts, c, thr):
    """VOCevaldet.m / py-faster-rcnn voc_eval, loop by loop: global sort, then match in order."""
    dets = sorted(((s, i, b) for i, p in enumerate(preds)
                   for b, s, lab in zip(p["boxes"], p["scores"], p["labels"]) if lab == c),
                  key=lambda t: -t[0])
    recs = [(g["boxes"][g["labels"] == c], g["difficult"][g["labels"] == c]) for g in gts]
    used = [np.zeros(len(r[0]), bool) for r in recs]
    ok = []  # TP (True) / FP (False) per non-ignored detection, in score order
    for _, i, bb in dets:
        best, jmax = -1.0, -1
        for j, g in enumerate(recs[i][0]):
            iw, ih = min(bb[2], g[2]) - max(bb[0], g[0]), min(bb[3], g[3]) - max(bb[1], g[1])
            union = (bb[2] - bb[0]) * (bb[3] - bb[1]) + (g[2] - g[0]) * (g[3] - g[1]) - iw * ih
            if iw > 0 and ih > 0 and iw * ih / union > best:
                best, jmax = iw * ih / union, j
        if best >= thr and recs[i][1][jmax]:
            continue
        ok.append(bool(best >= thr and not used[i][jmax]))
        if ok[-1]:
            used[i][jmax] = True
    tp = np.cumsum(ok)
    npos = sum(int((~d).sum()) for _, d in recs)
    assert npos > 0
    return tp / npos, tp / np.arange(1, len(ok) + 1)


def _ap_reference(rec, prec, use07):
    """The devkit's two AP definitions, written as loops."""
    if use07:
        return sum(max([p for r, p in zip(rec, prec) if r >= k / 10], default=0.0) for k in range(11)) / 11
    mrec, mpre = [0.0, *rec, 1.0], [0.0, *prec, 0.0]
    for i in range(len(mpre) - 2, -1, -1):
        mpre[i] = max(mpre[i], mpre[i + 1])
    return sum((mrec[i + 1] - mrec[i]) * mpre[i + 1] for i in range(len(mrec) - 1))  # 0 where flat


def test_voc_random_scenes_match_devkit_loop():
    rng = np.random.default_rng(0)
    preds, gts = [], []
    for _ in range(12):
        m, xy = int(rng.integers(0, 6)), rng.uniform(0, 80, (6, 2))
        g = np.concatenate([xy, xy + rng.uniform(5, 40, (6, 2))], 1)[:m]
        gts.append({"boxes": g, "labels": rng.integers(0, 3, m), "difficult": rng.random(m) < 0.2})
        jitter = g + rng.normal(0, 3, g.shape)  # near-hits, some duplicated, plus random boxes
        extra = np.concatenate([rng.uniform(0, 80, (3, 2)), rng.uniform(85, 120, (3, 2))], 1)
        boxes = np.concatenate([jitter, jitter[: m // 2] + 1, extra])
        labels = np.concatenate([gts[-1]["labels"], gts[-1]["labels"][: m // 2], rng.integers(0, 3, 3)])
        preds.append({"boxes": boxes, "labels": labels, "scores": rng.random(len(boxes))})
    for use07 in (True, False):
        res = voc_map(preds, gts, 3, use_07_metric=use07)
        refs = [_ap_reference(*_devkit_reference(preds, gts, c, 0.5), use07) for c in range(3)]
        assert res["per_class"] == pytest.approx(refs, abs=1e-12) and 0.0 < res["mAP"] < 1.0
