"""Instance masks on the data side: the COCO and YOLO segmentation readers (good masks, crowd
regions, each kind of bad mask under error and skip), masks through compressed RLE and back, masks
through every geometric transform the detectors use and through the aspect-ratio batching and its
collate (checked against the image's own pixels after each step), the decoded-image cache, and the
sources that have no masks.

Every image is a few dozen pixels of flat shapes painted in their class's colour
(``detection_helpers.MASK_SCENES``), so a mask can be read back from the image it belongs to."""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision.transforms.v2 as T
from PIL import Image, ImageDraw
from torchvision import tv_tensors

from detection_helpers import (MASK_BACKGROUND, MASK_COLOURS, MASK_SCENES, masks_coco, masks_yolo, scene_image,
                               scene_masks, yolo_polygon_line)
from visiontrain.core.config import load_config
from visiontrain.data.detection import masks as M
from visiontrain.data.detection.base import BadAnnotationError, training_target
from visiontrain.data.detection.coco import read_coco
from visiontrain.data.detection.sources import DetectionDataConfig
from visiontrain.data.detection.splits import build_detection_splits
from visiontrain.data.detection.transforms import (IMAGENET_MEAN, IMAGENET_STD, RandomSizeCrop, detr_train_transform,
                                                   sanitize_boxes)
from visiontrain.data.detection.yolo import read_yolo
from visiontrain.tasks.mask_rcnn import MaskRcnnTask

W0, H0 = MASK_SCENES[0][:2]  # the first scene's image: 64 x 48


def polygon_boxes(scene) -> np.ndarray:
    """XYXY boxes of a scene's polygons."""
    return np.array([[min(p[0::2]), min(p[1::2]), max(p[0::2]), max(p[1::2])] for _, p in scene[2]], np.float32)


def uncompressed_rle(mask: np.ndarray) -> dict:
    """COCO's uncompressed RLE of one mask, computed here with numpy: run lengths of the column-major
    pixels, the first run counting zeros (what COCO writes for crowd regions)."""
    flat = np.asarray(mask, np.uint8).ravel(order="F")
    bounds = np.concatenate([[0], np.flatnonzero(np.diff(flat)) + 1, [flat.size]])
    runs = np.diff(bounds).tolist()
    return {"size": list(mask.shape), "counts": ([0] if flat[0] else []) + runs}


# ------------------------------------------------------------------------------- RLE round trip

def test_masks_round_trip_through_compressed_rle() -> None:
    masks = (np.random.default_rng(0).random((3, 17, 23)) > 0.6).astype(np.uint8)
    counts = M.encode(masks)
    np.testing.assert_array_equal(M.decode(counts, 17, 23), masks)
    assert [M.mask_area(c, 17, 23) for c in counts] == masks.sum(axis=(1, 2)).tolist()
    # the runs pycocotools writes, read back in Python, are the mask's own runs
    assert [M.compressed_runs(c) for c in counts] == [uncompressed_rle(m)["counts"] for m in masks]
    # an uncompressed RLE (COCO's crowd form) reads as the same mask
    assert [M.segmentation_rle(uncompressed_rle(m), 17, 23)[0] for m in masks] == counts
    assert M.decode([], 17, 23).shape == (0, 17, 23)


def test_decoding_raises_no_warning_and_leaves_the_warning_filters_as_they_were() -> None:
    """pycocotools' decode warns under NumPy 2 on every call (1,400 a suite run, burying the rest):
    filtered there and only there, so the same warning raised elsewhere still shows."""
    counts = M.encode(np.ones((2, 4, 5), np.uint8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        M.decode(counts, 4, 5)
        warnings.warn(M.NUMPY2_COPY_WARNING, DeprecationWarning)
    assert [str(w.message) for w in caught] == [M.NUMPY2_COPY_WARNING]


def test_polygon_rle_against_polygons_drawn_with_pil() -> None:
    def pil(polygon: list[float], outline: bool = False) -> np.ndarray:
        im = Image.new("L", (W0, H0))
        ImageDraw.Draw(im).polygon(polygon, fill=None if outline else 1, outline=1 if outline else None)
        return np.array(im, bool)

    # a rectangle with whole-pixel corners: COCO covers pixels x1..x2-1, PIL's polygon its corners inclusive
    rle, problem = M.polygon_rle([[8, 6, 30, 6, 30, 26, 8, 26]], H0, W0)
    assert problem == "" and M.mask_area(rle, H0, W0) == 22 * 20
    np.testing.assert_array_equal(M.decode([rle], H0, W0)[0].astype(bool), pil([8, 6, 29, 6, 29, 25, 8, 25]))
    # a triangle: the two rasterisations differ only on PIL's outline, and the area is the polygon's (shoelace)
    triangle = [36, 10, 58, 40, 36, 40]
    rle, _ = M.polygon_rle([triangle], H0, W0)
    coco = M.decode([rle], H0, W0)[0].astype(bool)
    edge = F.max_pool2d(torch.from_numpy(pil(triangle, outline=True)).float()[None], 3, 1, 1)[0].bool().numpy()
    assert not ((coco ^ pil(triangle)) & ~edge).any()
    assert abs(M.mask_area(rle, H0, W0) - 22 * 30 / 2) <= (22 + 30 + np.hypot(22, 30)) / 2


# --------------------------------------------------------------------------------------- COCO

def test_coco_reads_polygons_rle_and_crowd(tmp_path: Path) -> None:
    scene = MASK_SCENES[0]
    rect, triangle = scene_masks(scene)
    crowd = np.zeros((H0, W0), np.uint8)
    crowd[30:44, 2:20] = 1
    extra = [{"id": 7, "image_id": 1, "category_id": 2, "iscrowd": 0, "bbox": [36, 8, 22, 32],  # the triangle again
              "segmentation": {"size": [H0, W0], "counts": M.encode(triangle)[0]}},
             {"id": 8, "image_id": 1, "category_id": 3, "iscrowd": 1, "bbox": [2, 30, 18, 14],
              "segmentation": uncompressed_rle(crowd)}]
    root = masks_coco(tmp_path / "coco", [scene], ("train",), extra)
    ds = read_coco(str(root / "annotations" / "instances_train.json"), str(root / "train"), masks=True)
    r = ds.records[0]
    assert r.ann_ids.tolist() == [1, 2, 7, 8] and r.crowd.tolist() == [False, False, False, True]
    np.testing.assert_array_equal(M.decode(r.masks, H0, W0), [rect, triangle, triangle, crowd])
    target = training_target(r)  # crowd regions are never trained on
    assert target["labels"].tolist() == [0, 1, 1] and isinstance(target["masks"], tv_tensors.Mask)
    np.testing.assert_array_equal(target["masks"].numpy(), [rect, triangle, triangle])
    gt = ds.coco_ground_truth()["annotations"]  # ... and are the evaluation's ignore regions
    assert [a["iscrowd"] for a in gt] == [0, 0, 0, 1] and gt[3]["area"] == crowd.sum()
    np.testing.assert_array_equal(M.decode([gt[3]["segmentation"]["counts"]], H0, W0)[0], crowd)
    boxes_only = read_coco(str(root / "annotations" / "instances_train.json"), str(root / "train"))
    assert boxes_only.records[0].masks is None and boxes_only.records[0].ann_ids.tolist() == [1, 2, 7]


def _coco_bad(tmp_path: Path, case: str) -> tuple[str, str]:
    """A one-image COCO file whose annotation 99 has a bad mask (its box is good): (file, image dir)."""
    ann = {"id": 99, "image_id": 1, "category_id": 1, "iscrowd": 0, "bbox": [50, 2, 12, 8]}
    small = M.encode(np.ones((1, 10, 10), np.uint8))[0]
    segmentation = {"two_points": [[50, 2, 60, 2]], "outside": [[50, 2, 70, 2, 70, 10]],
                    "collinear": [[50, 2, 55, 2, 60, 2]], "rle_wrong_size": {"size": [10, 10], "counts": small},
                    "compressed_runs": {"size": [H0, W0], "counts": small},
                    "uncompressed_runs": {"size": [H0, W0], "counts": [10, 20]}}
    if case in segmentation:
        ann["segmentation"] = segmentation[case]
    root = masks_coco(tmp_path / "coco", MASK_SCENES[:1], ("train",), [ann])
    return str(root / "annotations" / "instances_train.json"), str(root / "train")


COCO_BAD = {"two_points": "polygon 0 has 4 coordinates", "outside": f"outside the {W0}x{H0} image",
            "collinear": "empty mask", "rle_wrong_size": "RLE of size [10, 10]",
            "compressed_runs": f"compressed RLE of 100 pixels for {W0 * H0}",
            "uncompressed_runs": f"uncompressed RLE of 30 pixels for {W0 * H0}", "missing": "no 'segmentation' key"}


@pytest.mark.parametrize("case", COCO_BAD)
def test_coco_bad_mask_error_names_file_and_annotation(tmp_path: Path, case: str) -> None:
    ann_file, image_dir = _coco_bad(tmp_path, case)
    with pytest.raises(BadAnnotationError) as info:
        read_coco(ann_file, image_dir, masks=True)
    message = str(info.value)
    assert ann_file in message and "annotation id 99: segmentation" in message and COCO_BAD[case] in message
    assert "on_bad_annotation=skip" in message and "\n" not in message


@pytest.mark.parametrize("case", COCO_BAD)
def test_coco_bad_mask_skip_drops_and_counts(tmp_path: Path, case: str) -> None:
    ds = read_coco(*_coco_bad(tmp_path, case), masks=True, on_bad_annotation="skip")
    assert dict(ds.policy.skipped) == {"bad mask": 1}
    r = ds.records[0]
    assert r.ann_ids.tolist() == [1, 2] and len(r.masks) == len(r.boxes) == 2
    np.testing.assert_array_equal(M.decode(r.masks, H0, W0), scene_masks(MASK_SCENES[0]))


# --------------------------------------------------------------------------------------- YOLO

def test_yolo_segmentation_reads_polygons_as_masks_and_boxes(tmp_path: Path) -> None:
    root = masks_yolo(tmp_path / "yolo", splits=("train",))
    ds = read_yolo(str(root), "train", masks=True)
    assert ds.class_names == ["red", "green", "blue"] and len(ds) == len(MASK_SCENES)
    for r, scene in zip(ds.records, MASK_SCENES):
        assert r.labels.tolist() == [label for label, _ in scene[2]]
        assert r.ann_ids.tolist() == list(range(1, len(scene[2]) + 1))  # line numbers
        np.testing.assert_allclose(r.boxes, polygon_boxes(scene), atol=1e-4)
        np.testing.assert_array_equal(M.decode(r.masks, r.height, r.width), scene_masks(scene))
    _, target = ds[0]
    np.testing.assert_array_equal(target["masks"].numpy(), scene_masks(MASK_SCENES[0]))


def test_yolo_polygon_lines_train_box_detectors_without_masks(tmp_path: Path) -> None:
    root = masks_yolo(tmp_path / "yolo", splits=("train",))
    label_file = root / "labels" / "train" / "1.txt"
    label_file.write_text(label_file.read_text() + "2 0.5 0.5 0.25 0.5\n")  # a box line beside the polygons
    ds = read_yolo(str(root), "train")
    r = ds.records[0]
    assert r.masks is None and r.labels.tolist() == [0, 1, 2] and ds.records.masks is None
    np.testing.assert_allclose(r.boxes, [*polygon_boxes(MASK_SCENES[0]), [24, 12, 40, 36]], atol=1e-4)
    assert "masks" not in ds[0][1]
    with pytest.raises(BadAnnotationError, match="1.txt line 3: a box line has no polygon"):
        read_yolo(str(root), "train", masks=True)
    # a polygon line that is not x, y pairs cannot give a box either
    label_file.write_text("0 0.1 0.1 0.5 0.1 0.5\n1 0.1 0.1 0.5 0.1 half 0.5\n")
    with pytest.raises(BadAnnotationError, match="1.txt line 1: a polygon of 5 coordinates"):
        read_yolo(str(root), "train")
    ds = read_yolo(str(root), "train", on_bad_annotation="skip")
    assert dict(ds.policy.skipped) == {"malformed line": 2} and len(ds.records[0].labels) == 0
    ds = read_yolo(str(root), "train", masks=True, on_bad_annotation="skip")  # read for masks: a bad mask
    assert dict(ds.policy.skipped) == {"bad mask": 1, "malformed line": 1}
    label_file.write_text("1 0.1 0.1 0.5 0.1 half 0.5\n")
    with pytest.raises(BadAnnotationError, match=r"1.txt line 1: '1 0.1 0.1 0.5 0.1 half 0.5' is not 'class x1 y1"):
        read_yolo(str(root), "train")


# A YOLO line of fewer than 3 points is a box line (2 points) or an odd count: the two first cases.
YOLO_BAD = {"box_line": ("0 0.85 0.15 0.1 0.1", "a box line has no polygon"),
            "odd": ("0 0.8 0.05 0.95 0.05 0.95", "polygon 0 has 5 coordinates"),
            "outside": ("0 0.8 0.05 1.3 0.05 1.3 0.2", f"outside the {W0}x{H0} image"),
            "collinear": ("0 0.8 0.05 0.85 0.05 0.9 0.05", "empty mask")}


def _yolo_bad(tmp_path: Path, case: str) -> tuple[Path, Path]:
    """The first scene as YOLO-seg with a bad third line in its label file: (root, that file)."""
    root = masks_yolo(tmp_path / "yolo", MASK_SCENES[:1], ("train",))
    label_file = root / "labels" / "train" / "1.txt"
    label_file.write_text(label_file.read_text() + YOLO_BAD[case][0] + "\n")
    return root, label_file


@pytest.mark.parametrize("case", YOLO_BAD)
def test_yolo_bad_mask_error_names_file_and_line(tmp_path: Path, case: str) -> None:
    root, label_file = _yolo_bad(tmp_path, case)
    with pytest.raises(BadAnnotationError) as info:
        read_yolo(str(root), "train", masks=True)
    message = str(info.value)
    assert f"{label_file} line 3: " in message and YOLO_BAD[case][1] in message
    assert "on_bad_annotation=skip" in message and "\n" not in message


@pytest.mark.parametrize("case", YOLO_BAD)
def test_yolo_bad_mask_skip_drops_and_counts(tmp_path: Path, case: str) -> None:
    root, _ = _yolo_bad(tmp_path, case)
    ds = read_yolo(str(root), "train", masks=True, on_bad_annotation="skip")
    assert dict(ds.policy.skipped) == {"bad mask": 1}
    r = ds.records[0]
    assert r.ann_ids.tolist() == [1, 2] and len(r.masks) == 2
    np.testing.assert_array_equal(M.decode(r.masks, H0, W0), scene_masks(MASK_SCENES[0]))


# -------------------------------------------------------------------------- through the transforms

PALETTE = torch.tensor([MASK_BACKGROUND, *MASK_COLOURS], dtype=torch.float32)  # class c is PALETTE[c + 1]


def painted(image: torch.Tensor, normalized: bool) -> torch.Tensor:
    """[H, W]: the palette entry nearest to each pixel (0 background, c + 1 class c), of a uint8
    image, or of a float one in [0, 1] (``normalized``: ImageNet-normalised)."""
    pixels = image.as_subclass(torch.Tensor).float()
    if normalized:
        pixels = pixels * torch.tensor(IMAGENET_STD)[:, None, None] + torch.tensor(IMAGENET_MEAN)[:, None, None]
    if image.dtype != torch.uint8:
        pixels = pixels * 255
    # the nearest entry: argmin of |p - c|^2 = |p|^2 - 2 p.c + |c|^2, |p|^2 the same for every c
    return ((PALETTE ** 2).sum(1) - 2 * pixels.flatten(1).T @ PALETTE.T).argmin(1).view(pixels.shape[1:])


def window_any(pixels: torch.Tensor, r: int) -> torch.Tensor:
    """[H, W] bool: where some pixel of the (2r + 1)-pixel square around (inside the image) is set in
    ``pixels`` [H, W] bool. Counted with an integral image, so the test stays cheap at the recipe's sizes."""
    k = 2 * r + 1
    c = F.pad(pixels.float(), (r + 1, r, r + 1, r)).cumsum(0).cumsum(1)  # outside the image: nothing set
    return (c[k:, k:] - c[:-k, k:] - c[k:, :-k] + c[:-k, :-k]) > 0


def assert_aligned(image: torch.Tensor, target: dict, normalized: bool, where: str, edge: float = 0,
                   outside_box: float = 0) -> None:
    """Each object's mask covers exactly the pixels painted in its class's colour but within ``edge``
    pixels of its border, and lies inside its box but for ``outside_box`` pixels (the allowances of
    ``Resampling``); one mask a box and a label, at the image's size."""
    masks, boxes, labels = target["masks"], target["boxes"], target["labels"]
    h, w = image.shape[-2:]
    assert isinstance(masks, torch.Tensor) and masks.dtype == torch.uint8, where
    assert tuple(masks.shape) == (len(boxes), h, w) and len(labels) == len(boxes), where
    colours, r, slack = painted(image, normalized), int(np.ceil(edge)), int(np.ceil(outside_box))
    for mask, box, label in zip(masks.bool(), boxes.as_subclass(torch.Tensor), labels.tolist()):
        off = mask ^ (colours == label + 1)
        if off.any():  # where the image is interpolated: within r pixels of both the mask and its outside
            off &= ~(window_any(mask, r) & window_any(~mask, r))
        assert not off.any(), f"{where}: {int(off.sum())} pixels of class {label} more than {r} px off its mask's edge"
        if mask.any():
            ys, xs = torch.nonzero(mask, as_tuple=True)
            x1, y1, x2, y2 = box.tolist()
            assert xs.min() >= np.floor(x1) - slack and xs.max() + 1 <= np.ceil(x2) + slack, f"{where}: {box}, {xs}"
            assert ys.min() >= np.floor(y1) - slack and ys.max() + 1 <= np.ceil(y2) + slack, f"{where}: {box}, {ys}"


class Resampling:
    """How far a mask may be from its painted pixels, and from its box, after the steps so far.

    A flip, a crop or a change of dtype moves whole pixels: a mask stays exact. A resize samples
    the image bilinearly and the mask at the nearest pixel (torchvision's rule for masks: output
    pixel c takes input pixel floor(c * in / out), half an output pixel off the image's sampling),
    so after it a mask's edge may be a pixel from the box's, and up to half a source pixel more from
    the image's, where the image smooths the mask's staircase edges; a later resize by ``s`` scales
    what earlier ones left by ``s``."""

    def __init__(self) -> None:
        self.edge = self.outside_box = 0.0

    def after(self, step_in: tuple[int, int], step_out: tuple[int, int], crop: bool) -> None:
        if crop or step_in == step_out:
            return
        s = max(o / i for o, i in zip(step_out, step_in))
        self.edge, self.outside_box = self.edge * s + 1 + s / 2, self.outside_box * s + 1


def scene_sample(scene) -> tuple[tv_tensors.Image, dict]:
    """A scene as a dataset gives it: image and target with boxes, labels and masks."""
    width, height, objects = scene
    image = tv_tensors.Image(torch.from_numpy(scene_image(scene)).permute(2, 0, 1).contiguous())
    boxes = tv_tensors.BoundingBoxes(torch.from_numpy(polygon_boxes(scene)), format="XYXY",
                                     canvas_size=(height, width))
    return image, {"boxes": boxes, "labels": torch.tensor([label for label, _ in objects]), "image_id": 1,
                   "orig_size": torch.tensor([height, width]), "masks": tv_tensors.Mask(torch.from_numpy(
                       scene_masks(scene)))}


def run_checked(steps: list, scene, name: str) -> dict:
    """The steps one after the other on a scene, checking the alignment after each; the last target."""
    image, target = scene_sample(scene)
    normalized, allowance = False, Resampling()
    assert_aligned(image, target, normalized, f"{name}: before")
    for step in steps:
        size = tuple(image.shape[-2:])
        image, target = step(image, target)
        normalized = normalized or isinstance(step, T.Normalize)
        allowance.after(size, tuple(image.shape[-2:]), crop=isinstance(step, RandomSizeCrop))
        assert_aligned(image, target, normalized, f"{name}: after {type(step).__name__}", allowance.edge,
                       allowance.outside_box)
    return target


def mask_rcnn_task(*overrides: str) -> MaskRcnnTask:
    # the recipe's transforms and data pipeline in-process (a test of masks through them, not of a run)
    return MaskRcnnTask(load_config("segment-mask-rcnn", list(overrides)))


def test_masks_stay_aligned_through_the_mask_rcnn_transforms() -> None:
    train, val = mask_rcnn_task().transforms()
    flipped = set()
    for seed, scene in enumerate(MASK_SCENES):  # seeds 0-3 flip the first and the last
        torch.manual_seed(seed)
        target = run_checked(list(train.transforms), scene, f"segment-mask-rcnn train, seed {seed}")
        scale = target["boxes"].canvas_size[1] / scene[0]
        left = torch.from_numpy(polygon_boxes(scene)[:, 0]) * scale
        flipped.add(not torch.allclose(target["boxes"][:, 0].as_subclass(torch.Tensor), left, atol=1))
        run_checked(list(val.transforms), scene, "segment-mask-rcnn val")
    assert flipped == {True, False}


@pytest.mark.parametrize("name, steps", [
    ("horizontal flip", [T.RandomHorizontalFlip(p=1)]),
    ("vertical flip", [T.RandomVerticalFlip(p=1)]),
    ("scale jitter down and up", [T.RandomShortestSize([20], max_size=60), T.RandomShortestSize([90], max_size=150)]),
    ("resize, longer side capped", [T.Resize(40, max_size=50)]),
    ("resize, stretched", [T.Resize((50, 50))]),
])
def test_masks_stay_aligned_through_geometric_transforms(name: str, steps: list) -> None:
    for scene in MASK_SCENES:
        run_checked(steps, scene, name)


def test_masks_stay_aligned_through_detr_crops_and_sanitize_drops_them_with_their_boxes() -> None:
    flip, choice, sanitize, *to_input = detr_train_transform([64, 80], 120, [60], 24, 40).transforms
    crop_branch = choice.transforms[1].transforms
    assert any(isinstance(step, RandomSizeCrop) for step in crop_branch)
    kept = []
    for seed, scene in enumerate(MASK_SCENES * 3):
        torch.manual_seed(seed)
        target = run_checked([flip, *crop_branch, sanitize, *to_input], scene, f"DETR crop branch, seed {seed}")
        kept.append(len(target["labels"]) / len(scene[2]))
    assert min(kept) < 1 and max(kept) == 1  # some crops emptied a box, which went with its mask


def test_sanitize_drops_the_mask_of_a_box_a_crop_emptied() -> None:
    class LeftHalf(RandomSizeCrop):  # the project's crop, at a fixed place: the first scene's left half
        def make_params(self, flat_inputs: list) -> dict:
            return {"top": 0, "left": 0, "height": H0, "width": W0 // 2}

    cropped = run_checked([LeftHalf(0, 0)], MASK_SCENES[0], "left half")
    assert cropped["labels"].tolist() == [0, 1] and not cropped["masks"][1].any()  # the triangle's box: 0 wide
    target = run_checked([LeftHalf(0, 0), sanitize_boxes()], MASK_SCENES[0], "left half, sanitized")
    assert target["labels"].tolist() == [0] and target["masks"].shape[0] == 1
    np.testing.assert_array_equal(target["masks"][0].numpy(), scene_masks(MASK_SCENES[0])[0][:, :W0 // 2])


def test_aspect_ratio_batches_keep_each_images_masks(tmp_path: Path) -> None:
    root = masks_coco(tmp_path / "coco")
    # data.name and data.root: the painted scenes (whose masks can be checked) instead of the recipe's fashion-mosaic
    task = mask_rcnn_task("data.name=coco", f"data.root={root}", "data.batch_size=2")  # two batches of the 4 images
    data = task.build_data()
    assert data.group_ids == [1, 1, 0, 0]  # two wide, two tall
    sampler = task.cfg.data.batch_sampler(len(data.train), data.group_ids, seed=0, rank=0, world_size=1)
    seen = []
    for batch in sampler:
        indices = [i for i, _ in batch]
        assert len({data.group_ids[i] for i in indices}) == 1
        torch.manual_seed(batch[0][1])
        images, _, targets = data.train_collate([data.train[i] for i in indices])
        for image, target, i in zip(images, targets, indices):
            h, w = target["hw"]
            assert target["image_id"] == data.train.records[i].image_id and target["masks"].shape[-2:] == (h, w)
            allowance = Resampling()  # one resize: the recipe's random shortest side
            allowance.after(tuple(target["orig_size"].tolist()), (h, w), crop=False)
            assert_aligned(image[:, :h, :w], target, True, f"batch {indices}, image {i}", allowance.edge,
                           allowance.outside_box)
            assert not image[:, h:, :].any() and not image[:, :, w:].any()  # the padding holds no object
        seen += indices
    assert sorted(seen) == [0, 1, 2, 3]


# ------------------------------------------------------------------------------ cache and sources

def test_ram_cache_keeps_the_masks(tmp_path: Path) -> None:
    root = masks_yolo(tmp_path / "yolo")
    data = DetectionDataConfig(name="yolo", root=str(root), train_split="train", val_split="val",
                               on_bad_annotation="error", cache="ram", cache_dir=str(tmp_path))
    train, val = build_detection_splits(data, masks=True)
    first = [train[i] for i in range(len(train))]
    assert train.cache.filled() == len(train)
    for image_file in (root / "images" / "train").iterdir():  # a second read decodes nothing
        image_file.unlink()
    for i, (scene, (image, target)) in enumerate(zip(MASK_SCENES, first)):
        again_image, again = train[i]
        assert torch.equal(again_image, image) and torch.equal(again["masks"], target["masks"])
        np.testing.assert_array_equal(again["masks"].numpy(), scene_masks(scene))
    assert val.records.masks is not None and len(val.records.masks) == train.records.num_boxes


@pytest.mark.parametrize("name", ["voc", "neon-trees"])
def test_a_source_without_masks_refuses_them_in_one_line(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError) as info:
        build_detection_splits(DetectionDataConfig(name=name, root=str(tmp_path), train_split="train",
                                                   val_split="val", on_bad_annotation="error"), masks=True)
    message = str(info.value)
    assert f"data.name={name}" in message and "no instance masks" in message and "\n" not in message
    assert "coco, yolo, fashion-mosaic" in message


def test_yolo_polygon_line_is_what_ultralytics_writes() -> None:
    line = yolo_polygon_line(2, [16, 12, 48, 12, 32, 36], W0, H0)
    assert [float(v) for v in line.split()] == [2, 0.25, 0.25, 0.75, 0.25, 0.5, 0.75]
