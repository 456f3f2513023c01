"""Instance segmentation's evaluation and figures: mask AP equals pycocotools' ``COCOeval(iouType="segm")``
(overall and per category, both ``eval.coco_backend`` values, through ``coco_evaluation`` and through
``MaskRcnnTask.score``), the area ranges come from the masks, and the masks are drawn: ``val_masks.png``,
``mask_pr_curves.png``, and the first training batch of ``first_look`` / ``visiontrain preview``.

One tiny scene serves every test: three 128 x 112 grey images with ground truth given as polygons,
compressed RLE and one crowd region in uncompressed RLE, and detections with RLE masks that match
(exactly, shifted, eroded), miss, land on the crowd region, or match a box but not its mask.
"""
from __future__ import annotations

import contextlib
import copy
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from pycocotools import mask as coco_mask
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from visiontrain.core import config as C
from visiontrain.data.detection.masks import decode
from visiontrain.evaluation.coco import COCO_BACKENDS, COCO_METRICS, coco_evaluation
from visiontrain.evaluation.previews import MASK_ALPHA, PALETTE, Tile, class_rgb, mask_outline, paint_masks, tiles_image
from visiontrain.tasks import build_task

H, W, GREY = 112, 128, 128
SHIRT, BAG, SHOE = 3, 7, 9  # category ids; sorted by id they are labels 0, 1, 2
CATEGORIES = [{"id": BAG, "name": "bag"}, {"id": SHIRT, "name": "shirt"}, {"id": SHOE, "name": "shoe"}]
LOW_SCORE_CENTRE = (50, 100)  # the centre of a detection on image 11 scored below the figures' threshold


def rect(x1: int, y1: int, x2: int, y2: int) -> np.ndarray:
    m = np.zeros((H, W), np.uint8)
    m[y1:y2, x1:x2] = 1
    return m


def disk(cx: int, cy: int, r: int) -> np.ndarray:
    yy, xx = np.mgrid[:H, :W]
    return ((xx - cx) ** 2 + (yy - cy) ** 2 <= r * r).astype(np.uint8)


def band(x1: int, y1: int, x2: int, y2: int, t: int) -> list[list[int]]:
    """A polygon: a diagonal band ``t`` px wide from (x1, y1) to (x2, y2), whose box is far bigger than it."""
    return [[x1, y1, x1 + t, y1, x2, y2 - t, x2, y2, x2 - t, y2, x1, y1 + t]]


def polygon_mask(polygons: list[list[int]]) -> np.ndarray:
    return decode([coco_mask.merge(coco_mask.frPyObjects(polygons, H, W))["counts"].decode("ascii")], H, W)[0]


def rle(m: np.ndarray) -> dict:
    return {"size": [H, W], "counts": coco_mask.encode(np.asfortranarray(m))["counts"].decode("ascii")}


def uncompressed_rle(m: np.ndarray) -> dict:
    """COCO's crowd form: run lengths of the column-major pixels, starting with a run of zeros."""
    flat = m.flatten(order="F")
    edges = np.flatnonzero(np.diff(flat)) + 1
    runs = np.diff(np.concatenate([[0], edges, [flat.size]])).tolist()
    return {"size": [H, W], "counts": ([0] if flat[0] else []) + runs}


def xywh(m: np.ndarray) -> list[float]:
    ys, xs = np.nonzero(m)
    return [float(xs.min()), float(ys.min()), float(xs.max() - xs.min() + 1), float(ys.max() - ys.min() + 1)]


def scene() -> tuple[dict, list[dict]]:
    """(ground truth, detections). Areas are the masks' pixels, as COCO's; the box area of the two bands
    falls in another range than their mask area (small vs medium, medium vs large)."""
    band_a, band_c, square_d = band(10, 10, 70, 70, 6), band(5, 5, 105, 105, 14), [[20, 80, 40, 80, 40, 100, 20, 100]]
    truth = [  # image, category, segmentation, mask, iscrowd
        (11, SHIRT, band_a, polygon_mask(band_a), 0), (11, BAG, rle(disk(95, 30, 18)), disk(95, 30, 18), 0),
        (11, SHIRT, uncompressed_rle(rect(80, 70, 124, 108)), rect(80, 70, 124, 108), 1),
        (12, SHIRT, band_c, polygon_mask(band_c), 0), (12, BAG, square_d, polygon_mask(square_d), 0),
        (13, BAG, rle(rect(8, 6, 118, 106)), rect(8, 6, 118, 106), 0)]
    anns = [{"id": i + 1, "image_id": im, "category_id": c, "segmentation": seg, "area": float(m.sum()),
             "bbox": xywh(m), "iscrowd": crowd} for i, (im, c, seg, m, crowd) in enumerate(truth)]
    ground_truth = {"images": [{"id": i, "width": W, "height": H, "file_name": f"{i}.png"} for i in (11, 12, 13)],
                    "annotations": anns, "categories": CATEGORIES}
    predicted = [  # image, category, mask, score
        (11, SHIRT, np.roll(polygon_mask(band_a), 2, axis=1), 0.9),  # shifted: IoU between .5 and .75
        (11, BAG, disk(95, 30, 18), 0.8),                             # exact
        (11, BAG, disk(30, 85, 12), 0.85),                            # nothing there
        (11, SHIRT, rect(84, 74, 120, 104), 0.95),                    # on the crowd region: ignored
        (12, SHIRT, rect(5, 5, 105, 105), 0.7),                       # band C's box, not its mask
        (13, BAG, rect(14, 12, 112, 100), 0.6),                       # eroded
        (13, SHIRT, disk(60, 56, 20), 0.3),                           # nothing of that class there
        (11, SHIRT, disk(*LOW_SCORE_CENTRE, 8), 0.1)]                 # below the figures' score
    detections = [{"image_id": im, "category_id": c, "bbox": xywh(m), "score": s, "segmentation": rle(m)}
                  for im, c, m, s in predicted]
    return ground_truth, detections


def reference(ground_truth: dict, detections: list[dict], iou_type: str = "segm",
              category: int | None = None) -> np.ndarray:
    """pycocotools' own ``stats``: ``loadRes`` and ``COCOeval``, restricted to ``category`` where given."""
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = copy.deepcopy(ground_truth)
        gt.createIndex()
        ev = COCOeval(gt, gt.loadRes(copy.deepcopy(detections)), iouType=iou_type)
        if category is not None:
            ev.params.catIds = [category]
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return np.where(ev.stats < 0, math.nan, ev.stats)


def assert_same(ours: float, theirs: float, what: str) -> None:
    assert (math.isnan(ours) and math.isnan(theirs)) or abs(ours - theirs) <= 1e-12, (what, ours, theirs)


@pytest.mark.parametrize("backend", COCO_BACKENDS)
def test_mask_ap_overall_and_per_class_is_cocoeval_segm_per_category(backend):
    ground_truth, detections = scene()
    result = coco_evaluation(copy.deepcopy(ground_truth), detections, backend=backend, iou_type="segm")
    overall = reference(ground_truth, detections)
    for k, name in enumerate(COCO_METRICS):
        assert_same(result.metrics[name], overall[k], name)
    rows = result.per_class()
    assert list(rows) == ["bag", "shirt", "shoe"]
    for category in CATEGORIES:
        stats, row = reference(ground_truth, detections, category=category["id"]), rows[category["name"]]
        for column, k in (("AP", 0), ("AP50", 1), ("recall", 8)):
            assert_same(row[column], stats[k], f"{category['name']} {column}")
    assert (rows["bag"]["n_gt"], rows["shirt"]["n_gt"], rows["shoe"]["n_gt"]) == (3, 2, 0)  # the crowd region: none
    # a scene where masks and boxes score apart (band C's box is found, its mask is not), every area range defined
    assert result.metrics["AP"] < coco_evaluation(ground_truth, detections, backend=backend).metrics["AP"]
    assert not any(math.isnan(result.metrics[k]) for k in ("APs", "APm", "APl"))


@pytest.mark.parametrize("backend", COCO_BACKENDS)
def test_segm_area_ranges_are_the_masks_areas_where_the_ground_truth_gives_none(backend):
    """COCO's ``area`` is the mask's: it sorts objects into APs / APm / APl. A ground truth without ``area``
    (the minimal dicts ``coco_evaluation`` takes) gets its masks' pixels under mask AP, not its boxes'."""
    ground_truth, detections = scene()
    no_area = copy.deepcopy(ground_truth)
    for a in no_area["annotations"]:
        del a["area"]
    ranges = coco_evaluation(no_area, detections, backend=backend, iou_type="segm").metrics
    expected = reference(ground_truth, detections)
    for k, name in enumerate(COCO_METRICS):
        assert_same(ranges[name], expected[k], name)
    boxes = copy.deepcopy(ground_truth)
    for a in boxes["annotations"]:
        a["area"] = a["bbox"][2] * a["bbox"][3]
    by_box_area = reference(boxes, detections)
    assert [ranges[k] for k in ("APs", "APm", "APl")] != pytest.approx(by_box_area[3:6].tolist())  # they tell apart
    no_mask = copy.deepcopy(ground_truth)
    del no_mask["annotations"][4]["segmentation"]
    with pytest.raises(ValueError, match=r"^mask AP: ground-truth annotation id 5 has no 'segmentation'$"):
        coco_evaluation(no_mask, detections, backend=backend, iou_type="segm")


# ------------------------------------------------------------------------------------ through the task
def write_coco_tree(root: Path, ground_truth: dict) -> Path:
    """The scene as a COCO dataset (``annotations/instances_<split>.json``, ``<split>/*.png``), the same
    grey images and annotations for train and val."""
    (root / "annotations").mkdir(parents=True)
    for split in ("train", "val"):
        (root / split).mkdir()
        for img in ground_truth["images"]:
            Image.new("RGB", (W, H), (GREY, GREY, GREY)).save(root / split / img["file_name"])
        (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(ground_truth))
    return root


@pytest.fixture(scope="module")
def coco_tree(tmp_path_factory) -> Path:
    return write_coco_tree(tmp_path_factory.mktemp("masks"), scene()[0])


def mask_task(root: Path, *overrides: str):
    # the scene's COCO tree instead of fashion-mosaic: the subject is scoring and drawing known masks; data only,
    # no model is built
    cfg = C.load_config("segment-mask-rcnn", ["data.name=coco", f"data.root={root}", "data.batch_size=3",
                                              *overrides])
    task = build_task(cfg)
    task.build_data()
    return task


@pytest.mark.parametrize("backend", COCO_BACKENDS)
def test_mask_rcnn_score_is_pycocotools_segm_on_the_files_annotations(coco_tree, backend):
    """The reader's RLEs (from polygons, compressed and uncompressed RLE, a crowd region) scored by
    ``MaskRcnnTask.score`` give pycocotools' stats on the annotation file itself, per class too."""
    task = mask_task(coco_tree, f"eval.coco_backend={backend}")  # the subject: each backend
    ground_truth, detections = scene()
    metrics, per_class = task.score(copy.deepcopy(detections))
    with contextlib.redirect_stdout(io.StringIO()):
        from_file = COCO(str(coco_tree / "annotations" / "instances_val.json")).dataset
    segm, bbox = reference(from_file, detections), reference(from_file, detections, "bbox")
    for k, name in enumerate(COCO_METRICS):
        assert_same(metrics[f"mask_{name}"], segm[k], f"mask_{name}")
        assert_same(metrics[name], bbox[k], name)
    for category in CATEGORIES:
        stats, row = reference(from_file, detections, category=category["id"]), per_class[category["name"]]
        assert_same(row["mask_AP"], stats[0], f"{category['name']} mask_AP")
        assert_same(row["mask_AP50"], stats[1], f"{category['name']} mask_AP50")
    assert metrics["mask_AP"] < metrics["AP"]
    kept = task.kept_masks
    assert sorted(kept.curves) == ["bag", "shirt"]  # the classes with ground truth
    assert kept.ap50 == {name: row["mask_AP50"] for name, row in per_class.items()}
    for name, curve in kept.curves.items():
        assert float(np.mean(curve)) == pytest.approx(kept.ap50[name], abs=1e-12)


def test_val_masks_fills_the_predictions_and_outlines_the_truth(coco_tree, tmp_path):
    from visiontrain.engine.records.plots import save_figure

    task = mask_task(coco_tree)
    _, detections = scene()
    task.shown_detections = detections  # what collect_detections keeps of the shown images (all three here)
    task.score(copy.deepcopy(detections))
    figures = task.eval_figures()
    assert set(figures) == {"val_detections", "pr_curves", "confusion_matrix", "val_masks", "mask_pr_curves"}
    plots = tmp_path / "plots"
    plots.mkdir()
    for name in ("val_masks", "mask_pr_curves"):
        save_figure(figures[name], plots / f"{name}.png")
    assert "mask AP50" in figures["mask_pr_curves"].axes[0].get_legend().get_title().get_text()

    fig = figures["val_masks"]
    pixels = np.asarray(Image.open(plots / "val_masks.png").convert("RGB"), np.float64)
    grey = np.full(3, GREY / 255)

    def drawn(panel: int, x: int, y: int) -> np.ndarray:
        """The PNG's colour (in [0, 1]) where image pixel (x, y) of panel ``panel`` is shown."""
        dx, dy = fig.axes[panel].transData.transform((x, y))  # the figure as save_figure drew it
        return pixels[int(pixels.shape[0] - dy), int(dx)] / 255

    bag, shirt = class_rgb(1), class_rgb(0)
    fill = lambda colour: (1 - MASK_ALPHA) * grey + MASK_ALPHA * colour  # noqa: E731
    assert drawn(0, 95, 30) == pytest.approx(fill(bag), abs=2 / 255)       # the bag found on image 11
    assert drawn(0, 30, 85) == pytest.approx(fill(bag), abs=2 / 255)       # the false bag, filled too
    assert drawn(0, *LOW_SCORE_CENTRE) == pytest.approx(grey, abs=2 / 255)  # below the shown score: not drawn
    assert drawn(0, 5, 60) == pytest.approx(grey, abs=2 / 255)             # nothing there
    assert drawn(2, 100, 20) == pytest.approx(fill(bag), abs=2 / 255)      # image 13's eroded bag
    square = polygon_mask([[20, 80, 40, 80, 40, 100, 20, 100]]).astype(bool)  # image 12's bag, never detected
    ys, xs = np.nonzero(mask_outline(square))
    left = np.flatnonzero(xs == xs.min())[len(ys[xs == xs.min()]) // 2]
    assert drawn(1, xs[left], ys[left]) == pytest.approx(bag, abs=2 / 255)  # outlined, opaque
    assert drawn(1, 30, 90) == pytest.approx(fill(shirt), abs=2 / 255)      # inside: band C's box, predicted shirt


def test_masks_are_painted_filled_or_outlined_in_their_class_colour_at_the_top_left():
    pixels = np.full((6, 8), 0.5)  # a grey image; the masks 4 x 5: a padded batch's image before its padding
    masks = np.zeros((2, 4, 5), bool)
    masks[0, 1:3, 1:3] = True
    masks[1, :, :] = True
    filled = paint_masks(pixels, masks[:1], [2])
    assert filled.shape == (6, 8, 3) and pixels.shape == (6, 8)  # a new RGB array
    assert np.allclose(filled[1:3, 1:3], 0.5 * (1 - MASK_ALPHA) + MASK_ALPHA * class_rgb(2))
    untouched = np.ones((6, 8), bool)
    untouched[1:3, 1:3] = False
    assert np.allclose(filled[untouched], 0.5)
    outlined = paint_masks(pixels, masks[1:], [3], outline=True)
    edge = np.zeros((6, 8), bool)
    edge[:4, :5] = True
    edge[1:3, 1:4] = False  # the 4 x 5 mask's inside
    assert np.allclose(outlined[edge], class_rgb(3)) and np.allclose(outlined[~edge], 0.5)
    assert PALETTE[3] == "#f58231" and np.allclose(class_rgb(3) * 255, [0xf5, 0x82, 0x31])

    tile = Tile(np.full((4, 4, 3), 0.5), boxes=np.array([[0, 0, 2, 2]]), labels=[1],
                masks=np.pad(np.ones((1, 2, 2), bool), ((0, 0), (0, 2), (0, 2))))
    composed = tiles_image([[tile]], title="", cell=40).astype(np.float64) / 255
    expected = 0.5 * (1 - MASK_ALPHA) + MASK_ALPHA * class_rgb(1)
    # the cell's 4 x 4 pixels, 10 screen pixels each, start 4 px in and 24 + 4 + 14 px down (tiles_image's layout)
    assert np.allclose(composed[42 + 15, 4 + 15], expected, atol=1 / 255)   # inside the mask (not its box outline)
    assert np.allclose(composed[42 + 35, 4 + 35], 0.5, atol=1 / 255)        # outside it


def test_preview_draws_the_first_batchs_masks_filled(coco_tree, tmp_path):
    """``visiontrain preview`` of a mask_rcnn config (and first_look's train_batch.png, the same
    ``preview_figures``): the grey images come out with the class colours blended over the masks."""
    from visiontrain.app import cli

    out = tmp_path / "preview"
    # the scene's COCO tree instead of fashion-mosaic: known masks on plain grey images
    assert cli.main(["preview", "segment-mask-rcnn", "data.name=coco", f"data.root={coco_tree}", "data.batch_size=3",
                     "--out", str(out)]) == 0
    batch = np.asarray(Image.open(out / "train_batch.png").convert("RGB"), np.float64)
    for label in (0, 1):  # shirt, bag: both in every training batch of the three images
        blended = ((1 - MASK_ALPHA) * GREY / 255 + MASK_ALPHA * class_rgb(label)) * 255
        share = (np.abs(batch - blended).max(-1) <= 2).mean()
        assert share > 0.02, (label, share)


def test_the_report_shows_each_mask_figure_beside_its_box_figure():
    from visiontrain.report.page import _plot_order

    names = ["val_masks", "throughput", "pr_curves", "val_detections", "losses", "mask_pr_curves", "confusion_matrix"]
    ordered = [p.stem for p in sorted((Path(f"{n}.png") for n in names), key=_plot_order)]
    assert ordered == ["losses", "pr_curves", "mask_pr_curves", "confusion_matrix", "val_detections", "val_masks",
                       "throughput"]
