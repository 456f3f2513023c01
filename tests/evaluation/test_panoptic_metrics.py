"""Panoptic quality (evaluation/panoptic.py): hand-computed fixtures with every rule in sight (things,
stuff, a crowd region, VOID pixels, a prediction half on VOID, an IoU of exactly 0.5, a class absent
everywhere), then equality with panopticapi's pq_compute on random fixtures.

The reference is panopticapi's own evaluation code, from the ``panopticapi-lite`` package (import name
``panopticapi``). ``bash scripts/setup.sh test`` installs it, with ``--no-deps``: its wheel asks for
numpy<2, which the evaluation code does not need (it uses numpy and PIL only) and which would clash
with the project's numpy. The reference tests call ``pq_compute_single_core`` and ``PQStat.pq_average``,
which is all ``pq_compute`` does once it has read its JSON files and split the images over processes
(a pool of every core, which a test has no use for)."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from visiontrain.core.panoptic_format import (VOID, Segment, id2rgb, parse_segments, read_panoptic, rgb2id,
                                              write_panoptic_png)
from visiontrain.evaluation.panoptic import PanopticQuality, pq_metrics
from visiontrain.rundir.metrics_file import PER_CLASS

try:
    from panopticapi import evaluation as panopticapi_eval
    from panopticapi import utils as panopticapi_utils
except ImportError:  # the reference tests fail below, saying how to install it; the others run
    panopticapi_eval = panopticapi_utils = None

CATEGORIES = [{"id": 1, "name": "person", "isthing": 1}, {"id": 2, "name": "car", "isthing": 1},
              {"id": 3, "name": "sky", "isthing": 0}, {"id": 4, "name": "grass", "isthing": 0},
              {"id": 5, "name": "boat", "isthing": 1}]  # boat: in no image, gt or predicted


@pytest.fixture
def reference():
    """panopticapi's evaluation module, required: setup.sh test installs it."""
    if panopticapi_eval is None:
        pytest.fail("the reference panopticapi is not installed: bash scripts/setup.sh test installs it "
                    "(pip install --no-deps panopticapi-lite==0.2.0)", pytrace=False)
    return panopticapi_eval


def grid(rows: list[str], legend: dict[str, int]) -> np.ndarray:
    """An id map drawn as text: one character a pixel, '.' VOID, the others ids by ``legend``."""
    return np.array([[VOID if ch == "." else legend[ch] for ch in row] for row in rows], dtype=np.int64)


def segments(ids: np.ndarray, info: dict[int, tuple[int, bool]]) -> list[dict]:
    """COCO segments_info of an id map: {id: (category_id, iscrowd)}, areas counted (panopticapi reads them)."""
    return [{"id": sid, "category_id": cat, "iscrowd": int(crowd), "area": int((ids == sid).sum())}
            for sid, (cat, crowd) in info.items()]


def hand_images() -> list[tuple[np.ndarray, list[dict], np.ndarray, list[dict]]]:
    """Three small images (gt ids, gt segments, pred ids, pred segments); what each scores is in the comments."""
    # Image 1: sky (stuff) over a person (thing) and grass (stuff), two gt VOID pixels.
    gt1 = grid(["SSSSSS",
                "SSSSSS",
                "PPP.GG",
                "PPP.GG"], {"S": 1, "P": 2, "G": 3})
    pred1 = grid(["ssssss",
                  "sssspp",
                  "ppppgg",
                  "ppp.gg"], {"s": 10, "p": 11, "g": 12})
    # person: pred 9 px, 1 of them on gt VOID, intersection 6, gt 6: union 9 + 6 - 6 - 1 = 8, IoU 6/8 = 0.75
    #         (without VOID out of the union: 6/9). A TP.
    # sky: pred 10 px, all on gt sky (12 px): IoU 10/12 = 5/6, a TP. grass: 4 px on 4 px, IoU 1, a TP.
    # Image 2: a crowd of persons, a car, grass, and 8 VOID pixels.
    gt2 = grid(["CCCC....",
                "AAAA....",
                "GGGGGGGG",
                "GGGGGGGG"], {"C": 5, "A": 6, "G": 7})
    pred2 = grid(["ppp.xxyy",
                  "aaxx..y.",
                  "gggggggy",
                  "gggggggg"], {"p": 1, "x": 2, "y": 3, "a": 4, "g": 5})
    # p (person, 3 px) lies on the person crowd: a crowd matches nothing, and p is 3/3 on it: not an FP.
    # x (person, 4 px): 2 px on VOID, 2 on the car: exactly half ignored, not more than half: an FP.
    # y (car, 4 px): 3 on VOID, 1 on grass: 3/4 ignored: not an FP.
    # a (car, 2 px) on the car (4 px): union 2 + 4 - 2 = 4, IoU 2/4 = 0.5 exactly: no match.
    #   So the car is an FN and a an FP.
    # grass: 15 px on 16: IoU 15/16, a TP. The crowd is no FN.
    gt3 = grid(["PPQQGG",
                "PPQQGG"], {"P": 1, "Q": 2, "G": 3})
    pred3 = grid(["ppp.ss",
                  "pp..ss"], {"p": 1, "s": 7})
    # p (person, 5 px): 4 on P, 1 on Q. P: union 5 + 4 - 4 = 5, IoU 4/5 = 0.8, a TP; Q (IoU 1/8): an FN.
    # s (sky) on grass: sky FP, grass FN.
    return [(gt1, segments(gt1, {1: (3, False), 2: (1, False), 3: (4, False)}),
             pred1, segments(pred1, {10: (3, False), 11: (1, False), 12: (4, False)})),
            (gt2, segments(gt2, {5: (1, True), 6: (2, False), 7: (4, False)}),
             pred2, segments(pred2, {1: (1, False), 2: (1, False), 3: (2, False), 4: (2, False), 5: (4, False)})),
            (gt3, segments(gt3, {1: (1, False), 2: (1, False), 3: (4, False)}),
             pred3, segments(pred3, {1: (1, False), 7: (3, False)}))]


# The tallies over the three images, and PQ = ΣIoU / (TP + FP/2 + FN/2), SQ = ΣIoU / TP, RQ = TP / (same):
#   person TP 2 (0.75 + 0.8 = 1.55), FP 1, FN 1: PQ 1.55/3 = 31/60, SQ 1.55/2 = 31/40, RQ 2/3
#   car    TP 0, FP 1, FN 1:                     PQ 0, SQ 0, RQ 0
#   sky    TP 1 (5/6), FP 1, FN 0:               PQ (5/6)/1.5 = 5/9, SQ 5/6, RQ 1/1.5 = 2/3
#   grass  TP 2 (1 + 15/16 = 31/16), FN 1:       PQ (31/16)/2.5 = 31/40, SQ 31/32, RQ 2/2.5 = 4/5
#   boat   nothing anywhere:                     no value (None), left out of the means
# things (person, car; n 2): PQ (31/60)/2 = 31/120, SQ (31/40)/2 = 31/80, RQ (2/3)/2 = 1/3
# stuff (sky, grass; n 2):   PQ (5/9 + 31/40)/2 = 479/720, SQ (5/6 + 31/32)/2 = 173/192, RQ (2/3 + 4/5)/2 = 11/15
# all (n 4): PQ (31/60 + 0 + 5/9 + 31/40)/4 = 665/1440, SQ (31/40 + 0 + 5/6 + 31/32)/4 = 1237/1920,
#            RQ (2/3 + 0 + 2/3 + 4/5)/4 = 8/15
EXPECTED_CLASSES = {1: (31 / 60, 31 / 40, 2 / 3, 2, 1, 1), 2: (0.0, 0.0, 0.0, 0, 1, 1),
                    3: (5 / 9, 5 / 6, 2 / 3, 1, 1, 0), 4: (31 / 40, 31 / 32, 4 / 5, 2, 0, 1),
                    5: (None, None, None, 0, 0, 0)}  # (PQ, SQ, RQ, TP, FP, FN) by category id
EXPECTED_GROUPS = {"things": (31 / 120, 31 / 80, 1 / 3, 2), "stuff": (479 / 720, 173 / 192, 11 / 15, 2),
                   "all": (665 / 1440, 1237 / 1920, 8 / 15, 4)}


def evaluate(images, categories=CATEGORIES) -> dict:
    metric = PanopticQuality(categories)
    for i, (gt, gt_segments, pred, pred_segments) in enumerate(images):
        metric.update(gt, gt_segments, pred, pred_segments, image=i)
    return metric.compute()


def test_hand_computed_fixtures():
    result = evaluate(hand_images())
    for cid, (pq, sq, rq, tp, fp, fn) in EXPECTED_CLASSES.items():
        row = result["per_class"][cid]
        assert (row["tp"], row["fp"], row["fn"]) == (tp, fp, fn), row["name"]
        assert (row["pq"], row["sq"], row["rq"]) == pytest.approx((pq, sq, rq), abs=1e-12), row["name"]
    for group, (pq, sq, rq, n) in EXPECTED_GROUPS.items():
        got = result[group]
        assert (got["pq"], got["sq"], got["rq"], got["n"]) == pytest.approx((pq, sq, rq, n), abs=1e-12), group
    assert result["images"] == 3


def test_pq_metrics_names_the_values_and_the_table():
    metrics = pq_metrics(evaluate(hand_images()))
    assert metrics["PQ"] == pytest.approx(665 / 1440) and metrics["RQ_th"] == pytest.approx(1 / 3)
    assert metrics["SQ_st"] == pytest.approx(173 / 192)
    table = metrics[PER_CLASS]
    assert list(table) == ["person", "car", "sky", "grass", "boat"]
    assert table["grass"] == {"PQ": pytest.approx(31 / 40), "SQ": pytest.approx(31 / 32), "RQ": pytest.approx(0.8),
                              "TP": 2, "FP": 0, "FN": 1}
    assert all(np.isnan(table["boat"][key]) for key in ("PQ", "SQ", "RQ"))  # absent: a dash in the log, not a 0


def test_a_group_without_counted_classes_has_no_value():
    stuff_only = [c for c in CATEGORIES if not c["isthing"]] + [{"id": 5, "name": "boat", "isthing": 1}]
    gt = grid(["SS", "GG"], {"S": 1, "G": 2})
    info = segments(gt, {1: (3, False), 2: (4, False)})
    result = evaluate([(gt, info, gt, info)], stuff_only)
    assert result["things"] == {"pq": None, "sq": None, "rq": None, "n": 0}
    assert result["stuff"] == {"pq": 1.0, "sq": 1.0, "rq": 1.0, "n": 2} and result["all"]["n"] == 2


def test_void_in_the_union_can_make_a_match():
    """A prediction twice the gt's size, half of it on VOID: IoU 4/8 = 0.5 counted naively (no match),
    4/(8 + 4 - 4 - 4) = 1 once the VOID half leaves the union: a TP of IoU 1."""
    gt = grid(["PP..", "PP.."], {"P": 1})
    pred = grid(["pppp", "pppp"], {"p": 1})
    result = evaluate([(gt, segments(gt, {1: (1, False)}), pred, segments(pred, {1: (1, False)}))])
    assert result["per_class"][1] == {"name": "person", "isthing": True, "tp": 1, "fp": 0, "fn": 0,
                                   "pq": 1.0, "sq": 1.0, "rq": 1.0}


def test_a_crowd_excuses_predictions_of_its_own_category_only():
    gt = grid(["CCCC", "CCCC"], {"C": 1})  # a crowd of persons
    pred = grid(["ppcc", "ppcc"], {"p": 1, "c": 2})  # a person and a car on it
    result = evaluate([(gt, segments(gt, {1: (1, True)}), pred, segments(pred, {1: (1, False), 2: (2, False)}))])
    person, car = result["per_class"][1], result["per_class"][2]
    assert (person["tp"], person["fp"], person["fn"]) == (0, 0, 0) and person["pq"] is None
    assert (car["tp"], car["fp"], car["fn"]) == (0, 1, 0) and car["pq"] == 0.0


def test_two_crowds_of_one_category_both_count():
    """panopticapi keeps one crowd a category (the last listed); here a person prediction all on two
    person crowds (2 px on each) is excused, where panopticapi would count an FP (2/4 on the last crowd)."""
    gt = grid(["CCDD", "...."], {"C": 1, "D": 2})
    pred = grid(["pppp", "...."], {"p": 1})
    result = evaluate([(gt, segments(gt, {1: (1, True), 2: (1, True)}), pred, segments(pred, {1: (1, False)}))])
    assert result["per_class"][1]["fp"] == 0


# ---------------------------------------------------------------- PQ above 1 (detectron2#5420)
def test_segment_ids_reused_across_images_cannot_mix_them():
    """Every image uses ids 1 and 2, gt and pred, with other categories and sizes each time."""
    a = grid(["1111", "1122"], {"1": 1, "2": 2})
    b = grid(["1222", "1222"], {"1": 1, "2": 2})
    images = [(a, segments(a, {1: (3, False), 2: (1, False)}), a, segments(a, {1: (3, False), 2: (1, False)})),
              (b, segments(b, {1: (4, False), 2: (2, False)}), b, segments(b, {1: (4, False), 2: (2, False)})),
              (b, segments(b, {1: (1, False), 2: (3, False)}), a, segments(a, {1: (1, False), 2: (3, False)}))]
    result = evaluate(images)
    # Image 3: person gt 2 px vs pred 6 px, IoU 2/6: FN + FP; sky gt 6 px vs pred 2 px, IoU 2/6: FN + FP.
    # person: TP 1 (IoU 1) FP 1 FN 1: PQ 1/2; sky likewise 1/2; car and grass TP 1: PQ 1.
    assert [result["per_class"][c]["pq"] for c in (1, 2, 3, 4)] == [0.5, 1.0, 0.5, 1.0]
    assert result["all"]["pq"] == 0.75


def test_an_area_in_the_json_that_the_png_contradicts_cannot_lift_pq_above_1(tmp_path, reference):
    """The gt JSON says 4 px (a 2x2 image's area), the PNG has 16: panopticapi's union is then
    16 + 4 - 16 = 4 and its IoU 16/4 = 4, a PQ of 400 %; pixel counts give IoU 1."""
    gt = np.ones((4, 4), np.int64)
    gt_segments = [{"id": 1, "category_id": 3, "iscrowd": 0, "area": 4}]
    pred_segments = [{"id": 1, "category_id": 3}]
    theirs = reference_results(tmp_path, [(gt, gt_segments, gt, pred_segments)], CATEGORIES)
    assert theirs["per_class"][3]["pq"] == pytest.approx(4.0)
    ours = evaluate([(gt, gt_segments, gt, pred_segments)])
    assert ours["per_class"][3]["pq"] == 1.0 and ours["all"]["pq"] == 1.0


# ---------------------------------------------------------------- errors: one line naming the fault
ONE = grid(["11", "1."], {"1": 1})


@pytest.mark.parametrize("gt_segments,pred,pred_segments,message", [
    ([{"id": 1, "category_id": 3}], ONE * 2, [{"id": 1, "category_id": 3}],
     r"image 7: pred: segment id 2 is in the id map but not in segments_info"),
    ([{"id": 1, "category_id": 3}], ONE, [{"id": 1, "category_id": 3}, {"id": 9, "category_id": 3}],
     r"image 7: pred: segment id 9 is in segments_info but not in the id map"),
    ([{"id": 1, "category_id": 3}], ONE, [{"id": 1, "category_id": 0}],
     r"image 7: pred: segment 1 has category_id 0, which is no category \(the categories are 1, 2, 3, 4, 5\)"),
    ([{"id": 1, "category_id": 30}], ONE, [{"id": 1, "category_id": 3}],
     r"image 7: gt: segment 1 has category_id 30, which is no category"),
    ([{"id": 1, "category_id": 3}], np.zeros((2, 3), np.int64), [],
     r"image 7: the prediction is 2x3 pixels but the gt is 2x2 \(height x width\)"),
    ([{"id": 1, "category_id": 3}], ONE, [{"id": 1, "category_id": 3}, {"id": 1, "category_id": 4}],
     r"image 7: pred: segments_info lists segment id 1 twice"),
    ([{"id": 1, "category_id": 3}, {"id": 0, "category_id": 3}], ONE, [{"id": 1, "category_id": 3}],
     r"image 7: gt: segments_info lists id 0, which is VOID"),
    ([{"id": 1}], ONE, [{"id": 1, "category_id": 3}], r"image 7: gt segments_info: an entry has no category_id"),
    ([{"id": 1, "category_id": 3}], ONE.astype(float), [{"id": 1, "category_id": 3}],
     r"image 7: pred: an id map is a 2-D array of integers, got float64"),
    ([{"id": 1, "category_id": 3}], ONE * 256 ** 3, [{"id": 256 ** 3, "category_id": 3}],
     r"image 7: pred: segment id 16777216 is outside \[0, 256³\)"),
])
def test_bad_input_is_one_line_naming_it(gt_segments, pred, pred_segments, message):
    metric = PanopticQuality(CATEGORIES)
    with pytest.raises(ValueError, match=message) as caught:
        metric.update(ONE, gt_segments, pred, pred_segments, image=7)
    assert "\n" not in str(caught.value)
    assert metric.images == 0 and all(c.tp + c.fp + c.fn == 0 for c in metric.counts.values())  # nothing counted


@pytest.mark.parametrize("categories,message", [
    ([{"id": 1, "isthing": 2}], r"category 1 \(1\): isthing must be 1 \(thing\) or 0 \(stuff\), got 2"),
    ([{"id": 1, "name": "a", "isthing": 1}, {"id": 1, "name": "b", "isthing": 0}], r"category id 1 is given twice"),
    ([{"id": 1, "name": "a", "isthing": 1}, {"id": 2, "name": "a", "isthing": 0}], r"category name 'a' is given twice"),
    ([{"id": 1, "name": "a"}], r"a category needs an id and isthing"),
    ([], r"needs at least one category"),
])
def test_bad_categories_are_named(categories, message):
    with pytest.raises(ValueError, match=message):
        PanopticQuality(categories)


# ---------------------------------------------------------------- the PNG format
def test_rgb2id_and_id2rgb_are_inverse_and_coco_s():
    rgb = np.array([[[1, 2, 3], [255, 255, 255]]], dtype=np.uint8)
    assert rgb2id(rgb).tolist() == [[1 + 2 * 256 + 3 * 256 ** 2, 256 ** 3 - 1]]  # no uint8 wrap-around
    ids = np.random.default_rng(0).integers(0, 256 ** 3, size=(5, 7))
    assert (rgb2id(id2rgb(ids)) == ids).all()
    if panopticapi_utils is not None:  # the same encoding as panopticapi's
        assert (panopticapi_utils.rgb2id(id2rgb(ids)) == ids).all()
        assert (panopticapi_utils.id2rgb(ids.copy()) == id2rgb(ids)).all()


def test_read_panoptic_reads_the_png_and_checks_its_segments(tmp_path):
    gt, gt_segments, _, _ = hand_images()[1]
    write_panoptic_png(tmp_path / "a.png", gt * 70001)  # ids that need all three channels
    ids, read = read_panoptic(tmp_path / "a.png", [dict(s, id=s["id"] * 70001) for s in gt_segments])
    assert (ids == gt * 70001).all()
    assert read[0] == Segment(id=5 * 70001, category_id=1, iscrowd=True, area=4)
    with pytest.raises(ValueError, match=r"a\.png: segment id 490007 is in the id map but not in segments_info$"):
        read_panoptic(tmp_path / "a.png", [dict(s, id=s["id"] * 70001) for s in gt_segments[:-1]])
    Image.fromarray(np.zeros((2, 2), np.uint8)).save(tmp_path / "gray.png")
    with pytest.raises(ValueError, match=r"gray\.png: a panoptic PNG holds colours \(RGB\), this one is mode L"):
        read_panoptic(tmp_path / "gray.png", [])


def test_parse_segments_keeps_the_json_area_but_pq_counts_pixels():
    assert parse_segments([{"id": 3, "category_id": 4, "area": 99}]) == [Segment(3, 4, False, 99)]


# ---------------------------------------------------------------- against panopticapi
def reference_results(tmp_path: Path, images, categories) -> dict:
    """panopticapi's results on ``images``, through PNG files as pq_compute reads them: its per-image
    tallies (pq_compute_single_core) and means (PQStat.pq_average), in this module's layout."""
    gt_dir, pred_dir = tmp_path / "gt", tmp_path / "pred"
    gt_dir.mkdir(exist_ok=True)
    pred_dir.mkdir(exist_ok=True)
    pairs = []
    for i, (gt, gt_segments, pred, pred_segments) in enumerate(images):
        write_panoptic_png(gt_dir / f"{i}.png", gt)
        write_panoptic_png(pred_dir / f"{i}.png", pred)
        pairs.append(({"image_id": i, "file_name": f"{i}.png", "segments_info": [dict(s) for s in gt_segments]},
                      {"image_id": i, "file_name": f"{i}.png", "segments_info": [dict(s) for s in pred_segments]}))
    cats = {c["id"]: c for c in categories}
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its progress
        stat = panopticapi_eval.pq_compute_single_core(0, pairs, str(gt_dir), str(pred_dir), cats)
    out = {}
    for group, isthing in (("all", None), ("things", True), ("stuff", False)):
        try:
            out[group], per_class = stat.pq_average(cats, isthing=isthing)
        except ZeroDivisionError:  # no class counted: panopticapi divides by n = 0
            out[group], per_class = {"pq": None, "sq": None, "rq": None, "n": 0}, {}
        if group == "all":
            out["per_class"] = {cid: {**row, "tp": stat[cid].tp, "fp": stat[cid].fp, "fn": stat[cid].fn}
                                for cid, row in per_class.items()}
    return out


RANDOM_CATEGORIES = [{"id": cid, "name": f"c{cid}", "isthing": int(cid < 20)} for cid in (3, 7, 11, 24, 25, 40)] + \
    [{"id": 99, "name": "never", "isthing": 1}]
USED = [c["id"] for c in RANDOM_CATEGORIES[:-1]]


def random_image(rng: np.random.Generator, h: int = 12, w: int = 16):
    """A gt of overlapping rectangles with scattered VOID and at most one crowd a thing category, and a
    prediction that shifts it by a pixel, merges some segments, changes some categories, adds a segment
    and VOID of its own. Prediction ids come from 1-9 in every image (reused across images)."""
    gt = np.zeros((h, w), np.int64)
    for sid in range(1, int(rng.integers(3, 9))):
        y, x = rng.integers(0, h - 1), rng.integers(0, w - 1)
        gt[y:y + rng.integers(2, h), x:x + rng.integers(2, w)] = sid
    gt[rng.random((h, w)) < 0.08] = VOID
    present = [int(s) for s in np.unique(gt) if s != VOID]
    big = dict(zip(present, (rng.choice(256 ** 3 - 1, size=len(present), replace=False) + 1).tolist()))
    gt_cat = {s: int(rng.choice(USED)) for s in present}
    crowded: set[int] = set()
    gt_info = {}
    for s in present:
        crowd = gt_cat[s] < 20 and gt_cat[s] not in crowded and rng.random() < 0.25
        crowded |= {gt_cat[s]} if crowd else set()
        gt_info[big[s]] = (gt_cat[s], crowd)
    pred = np.roll(gt, (int(rng.integers(-1, 2)), int(rng.integers(-1, 2))), axis=(0, 1))
    relabel = {s: int(rng.integers(1, 9)) for s in present}  # two gt ids may share one pred id: a merge
    pred = np.vectorize(lambda s: relabel.get(int(s), VOID), otypes=[np.int64])(pred)
    y, x = rng.integers(0, h - 2), rng.integers(0, w - 2)
    pred[y:y + rng.integers(1, 6), x:x + rng.integers(1, 6)] = 9
    pred[rng.random((h, w)) < 0.05] = VOID
    pred_cat = {p: gt_cat[s] if rng.random() < 0.8 else int(rng.choice(USED)) for s, p in reversed(relabel.items())}
    pred_cat[9] = int(rng.choice(USED))
    gt_ids = np.vectorize(lambda s: big.get(int(s), VOID), otypes=[np.int64])(gt)
    pred_info = {int(p): (pred_cat[int(p)], False) for p in np.unique(pred) if p != VOID}
    return gt_ids, segments(gt_ids, gt_info), pred, [{"id": p, "category_id": c} for p, (c, _) in pred_info.items()]


def assert_same(ours: dict, theirs: dict) -> None:
    for group in ("all", "things", "stuff"):
        assert ours[group]["n"] == theirs[group]["n"], group
        for key in ("pq", "sq", "rq"):
            assert ours[group][key] == pytest.approx(theirs[group][key], abs=1e-12), (group, key)
    for cid, row in theirs["per_class"].items():
        mine = ours["per_class"][cid]
        assert (mine["tp"], mine["fp"], mine["fn"]) == (row["tp"], row["fp"], row["fn"]), cid
        if mine["tp"] + mine["fp"] + mine["fn"] == 0:  # panopticapi lists an absent class as 0
            assert mine["pq"] is None and (row["pq"], row["sq"], row["rq"]) == (0.0, 0.0, 0.0)
        else:
            assert (mine["pq"], mine["sq"], mine["rq"]) == pytest.approx((row["pq"], row["sq"], row["rq"]), abs=1e-12)


def test_the_hand_fixtures_agree_with_panopticapi(tmp_path, reference):
    assert_same(evaluate(hand_images()), reference_results(tmp_path, hand_images(), CATEGORIES))


@pytest.mark.parametrize("seed", range(4))
def test_random_fixtures_agree_with_panopticapi(tmp_path, reference, seed):
    rng = np.random.default_rng(seed)
    images = [random_image(rng) for _ in range(12)]
    theirs = reference_results(tmp_path, images, RANDOM_CATEGORIES)
    metric = PanopticQuality(RANDOM_CATEGORIES)
    for i, (_, gt_segments, _, pred_segments) in enumerate(images):  # through the PNGs, as panopticapi reads them
        gt, gt_read = read_panoptic(tmp_path / "gt" / f"{i}.png", gt_segments)
        pred, pred_read = read_panoptic(tmp_path / "pred" / f"{i}.png", pred_segments)
        metric.update(gt, gt_read, pred, pred_read, image=i)
    ours = metric.compute()
    assert_same(ours, theirs)
    tallies = [(r["tp"], r["fp"], r["fn"]) for r in ours["per_class"].values()]
    assert all(min(t) >= 0 for t in tallies) and sum(t[0] for t in tallies) >= 5  # the fixtures do match
    assert ours["per_class"][99]["pq"] is None
    values = [v for g in ("all", "things", "stuff") for k, v in ours[g].items() if k != "n"]
    values += [r[k] for r in ours["per_class"].values() for k in ("pq", "sq", "rq") if r[k] is not None]
    assert all(0.0 <= v <= 1.0 for v in values)


def test_merged_accumulators_equal_one(tmp_path):
    rng = np.random.default_rng(5)
    images = [random_image(rng) for _ in range(6)]
    first, second = PanopticQuality(RANDOM_CATEGORIES), PanopticQuality(RANDOM_CATEGORIES)
    for i, image in enumerate(images):
        (first if i % 2 else second).update(*image)
    first.merge(second)
    whole = PanopticQuality(RANDOM_CATEGORIES)
    for image in images:
        whole.update(*image)
    assert first.compute()["all"] == pytest.approx(whole.compute()["all"]) and first.images == 6
