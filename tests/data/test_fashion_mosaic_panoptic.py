"""fashion-mosaic's stuff (wall, floor) and its COCO panoptic annotation (dataset version 4): the items
and their instance annotations are version 3's, the panoptic PNGs and JSON agree with them, and the
floor is a texture that can be told from the wall locally."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from scipy import ndimage

from visiontrain.core.panoptic_format import read_panoptic
from visiontrain.data.datasets import fashion_mnist
from visiontrain.data.detection import embedded
from visiontrain.data.detection.embedded import FLOOR_ID, WALL_ID, build_fashion_mosaic
from visiontrain.data.detection.masks import decode
from visiontrain.evaluation.panoptic import PanopticQuality

SPLITS = ("train", "val", "test")
SMALL = dict(train_images=12, val_images=4, test_images=4)
# sha256 of json.dumps({"annotations": ..., "images": ...}, sort_keys=True) of each instance json of
# build_fashion_mosaic(seed=0, **SMALL) from the real Fashion-MNIST, computed with version 3's builder
# (before the floor existed): the floor must move no item, box or mask.
VERSION_3_DIGESTS = {
    "train": "50c0b358641384135c750fc7544bc6d66a9e07bc692ae94549e535de0db84bab",
    "val": "aea6ad5ebd06f49bd2bc093b4dbe5f9972279c4a77acc61a45d898f0488e1dec",
    "test": "de7933dfeaaec685db1f104c087fc5c482d2af72d065025a47d76e0db7e99848",
}


def fashion_root() -> str:
    found = fashion_mnist.locate(None)
    if found is None:
        pytest.skip("Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
    return str(found)


@pytest.fixture(scope="module")
def mosaic(tmp_path_factory) -> Path:
    """A small fashion-mosaic, built once for the module's tests, which only read it."""
    return build_fashion_mosaic(tmp_path_factory.mktemp("mosaic"), **SMALL, fashion_root=fashion_root())


def load(root: Path, name: str) -> dict:
    return json.loads((root / "annotations" / f"{name}.json").read_text())


def images_of(root: Path, split: str):
    """Each image of a split: (image entry, RGB pixels, id map, segments_info, its instance annotations)."""
    instances, panoptic = load(root, split), load(root, f"panoptic_{split}")
    by_image = {im["id"]: [] for im in instances["images"]}
    for ann in instances["annotations"]:
        by_image[ann["image_id"]].append(ann)
    images = {im["id"]: im for im in instances["images"]}
    for entry in panoptic["annotations"]:
        image = images[entry["image_id"]]
        with Image.open(root / split / image["file_name"]) as f:
            pixels = np.asarray(f.convert("RGB"))
        ids, _ = read_panoptic(root / "annotations" / f"panoptic_{split}" / entry["file_name"], entry["segments_info"])
        yield image, pixels, ids, entry["segments_info"], by_image[image["id"]]


def stuff_masks(ids: np.ndarray, segments: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(wall, floor) pixels of an id map."""
    def region(category_id: int) -> np.ndarray:
        return np.isin(ids, [s["id"] for s in segments if s["category_id"] == category_id])
    return region(WALL_ID), region(FLOOR_ID)


def digest(coco: dict) -> str:
    return hashlib.sha256(json.dumps({k: coco[k] for k in ("annotations", "images")}, sort_keys=True)
                          .encode()).hexdigest()


def test_the_instance_annotations_are_those_of_version_3(mosaic):
    assert json.loads((mosaic / "BUILD.json").read_text())["version"] == 4
    assert {split: digest(load(mosaic, split)) for split in SPLITS} == VERSION_3_DIGESTS


def test_the_panoptic_json_lists_the_images_and_the_categories(mosaic):
    names = fashion_mnist.CLASS_NAMES
    for split in SPLITS:
        instances, panoptic = load(mosaic, split), load(mosaic, f"panoptic_{split}")
        assert panoptic["images"] == instances["images"]
        assert [(c["id"], c["name"], c["isthing"]) for c in panoptic["categories"]] == \
            [(i + 1, n, 1) for i, n in enumerate(names)] + [(11, "wall", 0), (12, "floor", 0)]
        assert all(set(c) == {"id", "name", "supercategory", "isthing", "color"} for c in panoptic["categories"])
        assert [(a["image_id"], a["file_name"]) for a in panoptic["annotations"]] == \
            [(im["id"], Path(im["file_name"]).stem + ".png") for im in instances["images"]]


def check_image(image: dict, ids: np.ndarray, segments: list[dict], instances: list[dict]) -> None:
    """Every pixel in one listed segment; each thing segment is an instance mask with its box and area;
    at most one wall and one floor; every area a pixel count and every bbox the tight box."""
    h, w = image["height"], image["width"]
    assert ids.shape == (h, w) and (ids != 0).all()
    assert len({s["id"] for s in segments}) == len(segments) and all(s["id"] > 0 for s in segments)
    assert sum(s["area"] for s in segments) == h * w
    for s in segments:
        region = ids == s["id"]
        ys, xs = np.nonzero(region)
        assert s["area"] == region.sum() and s["iscrowd"] == 0
        assert s["bbox"] == [xs.min(), ys.min(), xs.max() + 1 - xs.min(), ys.max() + 1 - ys.min()]
    things = [s for s in segments if s["category_id"] <= 10]
    assert len(things) == len(instances)
    masks = decode([a["segmentation"]["counts"] for a in instances], h, w)
    for s, ann, mask in zip(things, instances, masks):
        assert s["category_id"] == ann["category_id"] and s["bbox"] == ann["bbox"] and s["area"] == ann["area"]
        assert np.array_equal(ids == s["id"], mask.astype(bool))
    stuff = [s["category_id"] for s in segments if s["category_id"] > 10]
    assert sorted(stuff) == sorted(set(stuff)) and set(stuff) <= {WALL_ID, FLOOR_ID}


def test_the_panoptic_pngs_agree_with_the_instance_masks(mosaic):
    counted = 0
    for split in SPLITS:
        for image, _, ids, segments, instances in images_of(mosaic, split):
            check_image(image, ids, segments, instances)
            counted += 1
    assert counted == sum(SMALL.values())


def check_floor_line(wall: np.ndarray, floor: np.ndarray) -> None:
    """In every column, every wall pixel lies above every floor pixel; where the two touch, the rows
    they meet at lie on one straight line of slope at most ``FLOOR_SLOPE``, at 40-85% of the height."""
    h, w = wall.shape
    rows = np.arange(h)[:, None]
    last_wall = np.where(wall, rows, -1).max(0)
    first_floor = np.where(floor, rows, h).min(0)
    assert (last_wall < first_floor).all()
    touch = np.flatnonzero(last_wall + 1 == first_floor)
    assert len(touch) >= w // 4   # items hide the line in the other columns
    slope, offset = np.polyfit(touch + 0.5, first_floor[touch], 1)
    assert abs(slope) <= embedded.FLOOR_SLOPE + 0.01
    assert np.abs(slope * (touch + 0.5) + offset - first_floor[touch]).max() <= 1
    assert 0.4 * h - 1 <= slope * w / 2 + offset <= 0.85 * h + 1


def test_some_images_have_a_floor_below_a_straight_line(mosaic):
    floors = []
    for split in SPLITS:
        for _, _, ids, segments, _ in images_of(mosaic, split):
            wall, floor = stuff_masks(ids, segments)
            floors.append(bool(floor.any()))
            if floor.any() and wall.any():
                check_floor_line(wall, floor)
    assert 0 < sum(floors) < len(floors), floors


def test_the_ground_truth_scores_pq_1_against_itself(mosaic):
    for split in SPLITS:
        pq = PanopticQuality(load(mosaic, f"panoptic_{split}")["categories"])
        for image, _, ids, segments, _ in images_of(mosaic, split):
            pq.update(ids, segments, ids, segments, image=image["file_name"])
        result = pq.compute()
        assert result["images"] == len(load(mosaic, split)["images"])
        assert result["all"]["pq"] == result["things"]["pq"] == result["stuff"]["pq"] == 1.0


def grout_response(pixels: np.ndarray) -> np.ndarray:
    """How much a straight, horizontal or vertical, thin dark line passes near each pixel: the grey level
    of the pixels 2 px to either side minus the pixel's, averaged along the line over 15 px, the largest
    within 15 px. A tiled floor has such lines every 8-32 px; the wall's field and stripes rarely do."""
    grey = pixels.astype(np.float32).mean(2)
    pad = np.pad(grey, 2, mode="edge")
    across_rows = 0.5 * (pad[:-4, 2:-2] + pad[4:, 2:-2]) - grey
    across_cols = 0.5 * (pad[2:-2, :-4] + pad[2:-2, 4:]) - grey
    line = np.maximum(ndimage.uniform_filter1d(across_rows, 15, axis=1),
                      ndimage.uniform_filter1d(across_cols, 15, axis=0))
    return ndimage.maximum_filter(line, 15)


def test_the_floor_can_be_told_from_the_wall_locally(mosaic):
    """One fixed threshold on a local statistic separates the floor's pixels from the wall's (balanced
    accuracy >= 0.75) on most images: the floor is not recognised by its position only."""
    accuracies = []
    for split in SPLITS:
        for _, pixels, ids, segments, _ in images_of(mosaic, split):
            wall, floor = stuff_masks(ids, segments)
            if floor.any() and wall.any():
                response = grout_response(pixels)
                accuracies.append(0.5 * ((response[floor] > 30).mean() + (response[wall] <= 30).mean()))
    assert len(accuracies) >= 8 and np.mean(np.array(accuracies) >= 0.75) >= 0.75, np.round(accuracies, 2)


def test_a_cache_without_its_panoptic_files_or_of_version_3_is_rebuilt(tmp_path):
    root = fashion_root()
    built = build_fashion_mosaic(tmp_path, train_images=2, val_images=1, test_images=1, fashion_root=root)
    (built / "annotations" / "panoptic_val.json").unlink()
    assert build_fashion_mosaic(tmp_path, train_images=2, val_images=1, test_images=1, fashion_root=root) == built
    assert (built / "annotations" / "panoptic_val.json").is_file()
    marker = json.loads((built / "BUILD.json").read_text())
    (built / "BUILD.json").write_text(json.dumps({**marker, "version": 3}))
    build_fashion_mosaic(tmp_path, train_images=2, val_images=1, test_images=1, fashion_root=root)
    assert json.loads((built / "BUILD.json").read_text())["version"] == 4
