"""COCO / VOC / YOLO readers on tiny generated fixtures: exact box conversion, labels and class
names from the data, negatives kept, samples as tv_tensors, and every bad-data case under both
``on_bad_annotation`` policies."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import tv_tensors

from dataset_trees import broken_inside_jpeg, truncated_jpeg
from visiontrain.data.detection.base import IMAGE_FILE_REASONS, BadAnnotationError, BadDataPolicy, DetectionDataset
from visiontrain.data.detection.coco import _boxes_of, _boxes_one_by_one, read_coco
from visiontrain.data.detection.voc import read_voc
from visiontrain.data.detection.yolo import read_yolo

W, H = 64, 48                    # fixture image size
GOOD = [8.0, 8.0, 24.0, 24.0]    # a valid XYXY box in every fixture
BAD_BOXES = {"degenerate_x": [30.0, 10.0, 30.0, 20.0],   # x2 <= x1
             "degenerate_y": [10.0, 30.0, 20.0, 30.0],   # y2 <= y1
             "outside": [40.0, 10.0, 80.0, 20.0]}        # x2 = 80 > 64 + 1


def _img(path: Path, w: int = W, h: int = H, mode: str = "RGB") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    if mode == "I;16":
        im = Image.fromarray(rng.integers(0, 65535, (h, w), dtype=np.uint16))
    else:
        im = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).convert(mode)
    im.save(path)
    return path


def _garbage(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(np.random.default_rng(1).integers(0, 255, 512, dtype=np.uint8).tobytes())


def _write_json(path: Path, data: dict) -> str:
    path.write_text(json.dumps(data))
    return str(path)


# ----------------------------------------------------------------------------------------- COCO

def _coco_basic(tmp_path: Path) -> tuple[str, dict]:
    _img(tmp_path / "img" / "a.png")
    _img(tmp_path / "img" / "neg.jpg", 32, 16)
    data = {"images": [{"id": 7, "file_name": "neg.jpg", "height": 16, "width": 32},
                       {"id": 3, "file_name": "a.png"}],   # no height/width: taken from the header
            "categories": [{"id": 5, "name": "dog"}, {"id": 2, "name": "cat"}],
            "annotations": [{"id": 11, "image_id": 3, "category_id": 5, "bbox": [10, 20, 30, 20], "iscrowd": 0},
                            {"id": 12, "image_id": 3, "category_id": 2, "bbox": [0, 0, 5.5, 4]},
                            {"id": 13, "image_id": 3, "category_id": 2, "bbox": [1, 1, 9, 9], "iscrowd": 1}]}
    return _write_json(tmp_path / "instances.json", data), data


def test_coco_reads_boxes_labels_and_names(tmp_path: Path) -> None:
    ann_file, _ = _coco_basic(tmp_path)
    ds = read_coco(ann_file, str(tmp_path / "img"))
    assert ds.class_names == ["cat", "dog"] and ds.category_ids == [2, 5] and ds.num_classes == 2
    assert [r.image_id for r in ds.records] == [3, 7]               # id order
    a, neg = ds.records
    np.testing.assert_array_equal(a.boxes, [[10, 20, 40, 40], [0, 0, 5.5, 4]])  # xywh -> XYXY
    assert a.boxes.dtype == np.float32 and a.labels.dtype == np.int64
    assert a.labels.tolist() == [1, 0] and a.ann_ids.tolist() == [11, 12]    # crowd annotation 13 left out
    assert (a.height, a.width) == (H, W) and (neg.height, neg.width) == (16, 32)
    assert neg.boxes.shape == (0, 4) and neg.labels.shape == (0,)   # negative kept
    assert sum(ds.policy.skipped.values()) == 0 and ds.source == ann_file

    image, target = ds[0]
    assert isinstance(image, tv_tensors.Image) and image.dtype == torch.uint8
    assert tuple(image.shape) == (3, H, W)
    assert isinstance(target["boxes"], tv_tensors.BoundingBoxes)
    assert tuple(target["boxes"].canvas_size) == (H, W)
    assert target["boxes"].format == tv_tensors.BoundingBoxFormat.XYXY
    assert torch.equal(target["boxes"], torch.tensor([[10, 20, 40, 40], [0, 0, 5.5, 4]]))
    assert target["labels"].dtype == torch.int64 and target["labels"].tolist() == [1, 0]
    assert target["image_id"] == 3 and target["orig_size"].tolist() == [H, W]
    image, target = ds[1]
    assert tuple(image.shape) == (3, 16, 32) and target["boxes"].shape == (0, 4)


def test_coco_exact_example_box(tmp_path: Path) -> None:
    _img(tmp_path / "a.png", 100, 100)
    ann = _write_json(tmp_path / "i.json", {
        "images": [{"id": 1, "file_name": "a.png", "height": 100, "width": 100}],
        "categories": [{"id": 1, "name": "x"}],
        "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [10, 20, 30, 40]},
                        # grazes the border by < 1 px (rounding): clipped, not rejected
                        {"id": 2, "image_id": 1, "category_id": 1, "bbox": [-0.5, 90, 10.5, 10.5]}]})
    ds = read_coco(ann, str(tmp_path))
    np.testing.assert_array_equal(ds.records[0].boxes, [[10, 20, 40, 60], [0, 90, 10, 100]])
    assert ds.records[0].ann_ids.tolist() == [1, 2] and sum(ds.policy.skipped.values()) == 0


def test_coco_ground_truth_round_trip(tmp_path: Path) -> None:
    ann_file, data = _coco_basic(tmp_path)
    gt = read_coco(ann_file, str(tmp_path / "img")).coco_ground_truth()
    want = sorted((a["category_id"], [float(v) for v in a["bbox"]])
                  for a in data["annotations"] if not a.get("iscrowd"))
    assert sorted((a["category_id"], a["bbox"]) for a in gt["annotations"]) == want
    assert {(c["id"], c["name"]) for c in gt["categories"]} == {(5, "dog"), (2, "cat")}
    assert sorted(i["id"] for i in gt["images"]) == [3, 7]


def test_coco_limit_counts_images_after_filtering(tmp_path: Path) -> None:
    _img(tmp_path / "b.png")
    _img(tmp_path / "c.png")
    ann = _write_json(tmp_path / "i.json", {
        "images": [{"id": i, "file_name": f"{n}.png"} for i, n in ((1, "missing"), (2, "b"), (3, "c"))],
        "categories": [{"id": 1, "name": "x"}], "annotations": []})
    ds = read_coco(ann, str(tmp_path), on_bad_annotation="skip", limit=1)
    assert [r.image_id for r in ds.records] == [2] and ds.policy.skipped["missing image"] == 1


@pytest.mark.parametrize("mode", ["L", "RGBA", "P", "I;16"])
def test_any_image_mode_decodes_to_rgb_uint8(tmp_path: Path, mode: str) -> None:
    _img(tmp_path / "a.png", mode=mode)
    ann = _write_json(tmp_path / "i.json", {"images": [{"id": 1, "file_name": "a.png"}],
                                            "categories": [{"id": 1, "name": "x"}], "annotations": []})
    image, _ = read_coco(ann, str(tmp_path))[0]
    assert image.dtype == torch.uint8 and tuple(image.shape) == (3, H, W)
    if mode in ("L", "I;16"):
        assert torch.equal(image[0], image[1]) and torch.equal(image[1], image[2])
    if mode == "I;16":
        assert int(image.max()) == 255   # scaled to 8 bits, not clipped / wrapped


@pytest.mark.parametrize("content, missing", [
    ("{not json", "not valid JSON"),
    (json.dumps({"images": [], "annotations": []}), "'categories' is missing"),
    (json.dumps({"images": [{"id": 1}], "annotations": [], "categories": [{"id": 1}]}), "'file_name'"),
    (json.dumps({"images": [], "categories": [{"id": 1}],
                 "annotations": [{"id": 4, "image_id": 1, "category_id": 1}]}), "'bbox'"),
])
@pytest.mark.parametrize("policy", ["error", "skip"])
def test_coco_broken_file_always_raises(tmp_path: Path, content: str, missing: str, policy: str) -> None:
    (tmp_path / "broken.json").write_text(content)
    with pytest.raises(BadAnnotationError, match="broken.json") as info:
        read_coco(str(tmp_path / "broken.json"), str(tmp_path), on_bad_annotation=policy)
    assert missing in str(info.value)


def _two_image_coco(tmp_path: Path, first: str) -> str:
    _img(tmp_path / "good.png")
    return _write_json(tmp_path / "i.json", {
        "images": [{"id": 1, "file_name": first}, {"id": 2, "file_name": "good.png"}],
        "categories": [{"id": 1, "name": "x"}],
        "annotations": [{"id": 9, "image_id": 1, "category_id": 1, "bbox": [1, 1, 5, 5]}]})


def test_truncated_image_is_found_when_the_split_is_read(tmp_path: Path) -> None:
    """Its header reads, but the file is opened whole up front: dropped (skip) or named (error) when
    the dataset is built, not mid-epoch."""
    truncated_jpeg(tmp_path / "trunc.jpg")
    ann = _two_image_coco(tmp_path, "trunc.jpg")
    ds = read_coco(ann, str(tmp_path), on_bad_annotation="skip")
    assert len(ds) == 1 and dict(ds.policy.skipped) == {"unreadable image": 1}
    with pytest.raises(BadAnnotationError, match=r"1 image file cannot be read: image file .*trunc.jpg cannot be "
                                                 r"decoded \(corrupt or truncated\): image file is truncated"):
        read_coco(ann, str(tmp_path), on_bad_annotation="error")


def test_image_broken_inside_skip_uses_next_error_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    broken_inside_jpeg(tmp_path / "broken.jpg")
    ann = _two_image_coco(tmp_path, "broken.jpg")
    ds = read_coco(ann, str(tmp_path), on_bad_annotation="skip")
    assert len(ds) == 2                      # whole to the up-front check: found only when decoding
    with caplog.at_level(logging.WARNING, logger="visiontrain"):
        _, target = ds[0]
    assert target["image_id"] == 2
    assert any("broken.jpg" in r.getMessage() for r in caplog.records)
    with pytest.raises(BadAnnotationError, match="broken.jpg.*set data.on_bad_image=skip"):
        read_coco(ann, str(tmp_path), on_bad_annotation="error")[0]


# --------------------------------------------------------------------------------------- VOC

def _voc_xml(path: Path, objects: list[tuple[str, list[float], int]], filename: str | None = None,
             size: tuple[int, int] | None = (W, H)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    parts = ["<annotation>"]
    if filename:
        parts.append(f"<filename>{filename}</filename>")
    if size:
        parts.append(f"<size><width>{size[0]}</width><height>{size[1]}</height><depth>3</depth></size>")
    for name, box, difficult in objects:
        coords = "".join(f"<{t}>{v:g}</{t}>" for t, v in zip(("xmin", "ymin", "xmax", "ymax"), box))
        parts.append(f"<object><name>{name}</name><difficult>{difficult}</difficult>"
                     f"<bndbox>{coords}</bndbox></object>")
    path.write_text("".join(parts + ["</annotation>"]))


def _voc_split(root: Path, split: str, stems: list[str]) -> None:
    (root / "ImageSets" / "Main").mkdir(parents=True, exist_ok=True)
    (root / "ImageSets" / "Main" / f"{split}.txt").write_text("\n".join(stems) + "\n\n")


def test_voc_reads_boxes_difficult_and_names(tmp_path: Path) -> None:
    root = tmp_path / "voc"
    _img(root / "JPEGImages" / "a.jpg")
    _voc_xml(root / "Annotations" / "000001.xml", [("dog", [11, 21, 50, 40], 1), ("cat", [1, 1, W, H], 0)],
             filename="a.jpg")
    _img(root / "JPEGImages" / "000002.jpg", 32, 16)                 # no <filename>: {id}.jpg
    _voc_xml(root / "Annotations" / "000002.xml", [], size=None)     # negative
    _img(root / "JPEGImages" / "c.png")
    _voc_xml(root / "Annotations" / "000003.xml", [("person", [5, 5, 10, 10], 0)], filename="c.png")
    _voc_split(root, "train", ["000001", "000002", "000003"])
    ds = read_voc(str(root), "train")
    assert ds.class_names == ["cat", "dog", "person"] and ds.category_ids == [1, 2, 3]
    assert [r.image_id for r in ds.records] == [1, 2, 3]
    a, neg, c = ds.records
    np.testing.assert_array_equal(a.boxes, [[10, 20, 50, 40], [0, 0, W, H]])   # xmin-1, ymin-1
    assert a.labels.tolist() == [1, 0] and a.difficult.tolist() == [True, False] and a.ann_ids.tolist() == [1, 2]
    assert neg.path.endswith("000002.jpg") and neg.boxes.shape == (0, 4) and (neg.height, neg.width) == (16, 32)
    assert c.labels.tolist() == [2] and c.path.endswith("c.png")
    image, target = ds[0]
    assert isinstance(image, tv_tensors.Image) and tuple(image.shape) == (3, H, W)
    assert tuple(target["boxes"].canvas_size) == (H, W) and target["labels"].tolist() == [1, 0]

    # val reuses train's names: same labels, and a val-only name is bad data
    _voc_split(root, "val", ["000003", "000004"])
    _img(root / "JPEGImages" / "000004.jpg")
    _voc_xml(root / "Annotations" / "000004.xml", [("cat", [2, 2, 9, 9], 0), ("zebra", [2, 2, 9, 9], 0)])
    val = read_voc(str(root), "val", class_names=ds.class_names, on_bad_annotation="skip")
    assert val.class_names == ds.class_names and [r.image_id for r in val.records] == [1, 2]
    assert val.records[0].labels.tolist() == [2] and val.records[1].labels.tolist() == [0]
    assert dict(val.policy.skipped) == {"unknown category": 1}
    with pytest.raises(BadAnnotationError, match=r"000004\.xml object 2.*zebra"):
        read_voc(str(root), "val", class_names=ds.class_names)
    assert len(read_voc(str(root), "train", limit=2)) == 2


def test_voc_missing_split_or_root(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere.*ImageSets/Main"):
        read_voc(str(tmp_path / "nowhere"), "train")
    (tmp_path / "voc").mkdir()
    with pytest.raises(FileNotFoundError, match=r"train\.txt does not exist.*ImageSets/Main"):
        read_voc(str(tmp_path / "voc"), "train")


# --------------------------------------------------------------------------------------- YOLO

def _yolo_line(cls: int, box: list[float], w: int = W, h: int = H) -> str:
    x1, y1, x2, y2 = box
    return f"{cls} {(x1 + x2) / 2 / w!r} {(y1 + y2) / 2 / h!r} {(x2 - x1) / w!r} {(y2 - y1) / h!r}"


def test_yolo_reads_boxes_names_and_negatives(tmp_path: Path) -> None:
    root = tmp_path / "yolo"
    (root / "labels" / "train").mkdir(parents=True)
    (root / "data.yaml").write_text("path: .\ntrain: images/train\nnames: [cat, dog]\n")
    _img(root / "images" / "train" / "a.png", 200, 100)
    (root / "labels" / "train" / "a.txt").write_text("0 0.5 0.5 0.25 0.5\n\n1 0.25 0.5 0.5 1.0\n")
    _img(root / "images" / "train" / "b.jpg")                       # no label file: negative
    _img(root / "images" / "train" / "c.bmp")
    (root / "labels" / "train" / "c.txt").write_text("")            # empty label file: negative
    (root / "images" / "train" / "notes.txt").write_text("not an image")
    ds = read_yolo(str(root), "train")
    assert ds.class_names == ["cat", "dog"] and ds.category_ids == [0, 1]
    assert [Path(r.path).name for r in ds.records] == ["a.png", "b.jpg", "c.bmp"]
    assert [r.image_id for r in ds.records] == [1, 2, 3]
    a, b, c = ds.records
    np.testing.assert_array_equal(a.boxes, [[75, 25, 125, 75], [0, 0, 100, 100]])
    assert a.labels.tolist() == [0, 1] and a.ann_ids.tolist() == [1, 3]      # line numbers
    assert b.boxes.shape == (0, 4) and c.boxes.shape == (0, 4)
    image, target = ds[0]
    assert tuple(image.shape) == (3, 100, 200) and tuple(target["boxes"].canvas_size) == (100, 200)


def test_yolo_names_dict_and_classes_txt(tmp_path: Path) -> None:
    root = tmp_path / "yolo"
    _img(root / "images" / "val" / "a.png")
    (root / "labels" / "val").mkdir(parents=True)
    (root / "labels" / "val" / "a.txt").write_text(_yolo_line(2, GOOD) + "\n" + _yolo_line(1, GOOD) + "\n")
    (root / "data.yaml").write_text("names:\n  0: cat\n  2: bird\n")
    ds = read_yolo(str(root), "val", on_bad_annotation="skip")
    assert ds.class_names == ["cat", "bird"] and ds.category_ids == [0, 2]
    assert ds.records[0].labels.tolist() == [1] and ds.policy.skipped["unknown category"] == 1
    (root / "data.yaml").unlink()
    (root / "classes.txt").write_text("cat\ndog\nbird\n")
    ds = read_yolo(str(root), "val")
    assert ds.class_names == ["cat", "dog", "bird"] and ds.records[0].labels.tolist() == [2, 1]
    (root / "classes.txt").unlink()
    with pytest.raises(FileNotFoundError, match="data.yaml"):
        read_yolo(str(root), "val")


# ------------------------------------------------------------------- bad data, every reader

Loader = Callable[[str], DetectionDataset]


def _coco_case(tmp_path: Path, case: str) -> tuple[Loader, str, str | None]:
    img = tmp_path / "img"
    _img(img / "good.png")
    bad_name = "bad.jpg" if case == "unreadable_image" else "bad.png"
    if case == "unreadable_image":
        _garbage(img / bad_name)
    elif case != "missing_image":
        _img(img / bad_name)
    bad_ann: dict = {"id": 102, "image_id": 2, "category_id": 1, "bbox": [1, 1, 4, 4]}
    if case in BAD_BOXES:
        x1, y1, x2, y2 = BAD_BOXES[case]
        bad_ann["bbox"] = [x1, y1, x2 - x1, y2 - y1]
    elif case == "unknown_category":
        bad_ann["category_id"] = 99
    elif case == "malformed":
        bad_ann["bbox"] = [1, 2, "x"]
    xywh = [GOOD[0], GOOD[1], GOOD[2] - GOOD[0], GOOD[3] - GOOD[1]]
    data = {"images": [{"id": 1, "file_name": "good.png", "height": H, "width": W},
                       {"id": 2, "file_name": bad_name, "height": H + (case == "size_mismatch"), "width": W}],
            "categories": [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}],
            "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": xywh},
                            {"id": 101, "image_id": 2, "category_id": 2, "bbox": xywh}, bad_ann]}
    ann = _write_json(tmp_path / "instances.json", data)
    return (lambda policy: read_coco(ann, str(img), on_bad_annotation=policy)), bad_name, "annotation id 102"


def _voc_case(tmp_path: Path, case: str) -> tuple[Loader, str, str | None]:
    root = tmp_path / "voc"
    _img(root / "JPEGImages" / "good.png")
    bad_name = "bad.jpg" if case == "unreadable_image" else "bad.png"
    if case == "unreadable_image":
        _garbage(root / "JPEGImages" / bad_name)
    elif case != "missing_image":
        _img(root / "JPEGImages" / bad_name)
    voc = lambda b: [b[0] + 1, b[1] + 1, b[2], b[3]]   # XYXY -> 1-based inclusive
    _voc_xml(root / "Annotations" / "good.xml", [("cat", voc(GOOD), 0)], filename="good.png")
    bad_obj = ("cat", voc(BAD_BOXES.get(case, [1, 1, 4, 4])), 0)
    if case == "unknown_category":
        bad_obj = ("bird", bad_obj[1], 0)
    objects = [("dog", voc(GOOD), 0), bad_obj]
    _voc_xml(root / "Annotations" / "bad.xml", objects, filename=bad_name,
             size=(W, H + 1) if case == "size_mismatch" else (W, H))
    if case == "malformed":
        xml = root / "Annotations" / "bad.xml"
        xml.write_text(xml.read_text().replace("<xmin>2</xmin>", "<xmin>two</xmin>"))
    _voc_split(root, "train", ["good", "bad"])
    return (lambda policy: read_voc(str(root), "train", on_bad_annotation=policy, class_names=["cat", "dog"]),
            "bad.xml" if case not in ("missing_image", "unreadable_image", "size_mismatch") else bad_name,
            "object 2")


def _yolo_case(tmp_path: Path, case: str) -> tuple[Loader, str, str | None]:
    root = tmp_path / "yolo"
    labels = root / "labels" / "train"
    labels.mkdir(parents=True)
    (root / "data.yaml").write_text("names: [cat, dog]\n")
    _img(root / "images" / "train" / "good.png")
    (labels / "good.txt").write_text(_yolo_line(0, GOOD) + "\n")
    bad_name = "bad.jpg" if case == "unreadable_image" else "bad.png"
    if case == "unreadable_image":
        _garbage(root / "images" / "train" / bad_name)
    else:
        _img(root / "images" / "train" / bad_name)
    bad_line = {"unknown_category": _yolo_line(2, GOOD), "malformed": "0 0.5 0.5 0.1",
                "malformed_number": "0 0.5 half 0.1 0.1"}.get(case) or _yolo_line(0, BAD_BOXES.get(case, GOOD))
    (labels / "bad.txt").write_text(_yolo_line(1, GOOD) + "\n" + bad_line + "\n")
    return (lambda policy: read_yolo(str(root), "train", on_bad_annotation=policy),
            bad_name if case == "unreadable_image" else "bad.txt", "line 2")


IMAGE_CASES = {"missing_image": "missing image", "unreadable_image": "unreadable image",
               "size_mismatch": "image size mismatch"}
ANN_CASES = {"degenerate_x": "degenerate box", "degenerate_y": "degenerate box",
             "outside": "box outside image", "unknown_category": "unknown category"}
CASES = [(reader, case) for reader in ("coco", "voc", "yolo")
         for case in (*IMAGE_CASES, *ANN_CASES, "malformed")
         if not (reader == "yolo" and case in ("missing_image", "size_mismatch"))]  # YOLO lists files
CASES.append(("yolo", "malformed_number"))
BUILDERS = {"coco": _coco_case, "voc": _voc_case, "yolo": _yolo_case}
MALFORMED = {"coco": "malformed annotation", "voc": "malformed annotation", "yolo": "malformed line"}


@pytest.mark.parametrize("reader, case", CASES)
def test_bad_data_error_names_file_and_annotation(tmp_path: Path, reader: str, case: str) -> None:
    load, file_name, ann_text = BUILDERS[reader](tmp_path, case)
    with pytest.raises(BadAnnotationError) as info:
        load("error")
    message = str(info.value)
    key = "on_bad_image" if IMAGE_CASES.get(case) in IMAGE_FILE_REASONS else "on_bad_annotation"
    assert file_name in message and f"{key}=skip" in message
    if case not in IMAGE_CASES:
        assert ann_text in message


@pytest.mark.parametrize("reader, case", CASES)
def test_bad_data_skip_drops_and_counts(tmp_path: Path, reader: str, case: str) -> None:
    load, _, _ = BUILDERS[reader](tmp_path, case)
    ds = load("skip")
    reason = IMAGE_CASES.get(case) or ANN_CASES.get(case) or MALFORMED[reader]
    assert dict(ds.policy.skipped) == {reason: 1}
    by_name = {Path(r.path).stem: r for r in ds.records}
    good = by_name["good"]
    np.testing.assert_allclose(good.boxes, [GOOD], atol=1e-4)
    assert good.labels.tolist() == [0]
    if case in IMAGE_CASES:
        assert len(ds) == 1                    # the whole image is dropped
    else:
        assert len(ds) == 2                    # only the bad annotation is dropped
        bad = by_name["bad"]
        np.testing.assert_allclose(bad.boxes, [GOOD], atol=1e-4)
        assert bad.labels.tolist() == [1] and len(bad.ann_ids) == 1
        assert tuple(ds[list(ds.records.paths).index(bad.path)][0].shape) == (3, H, W)


def test_unknown_policy_is_rejected(tmp_path: Path) -> None:
    ann_file, _ = _coco_basic(tmp_path)
    with pytest.raises(ValueError, match="on_bad_annotation"):
        read_coco(ann_file, str(tmp_path / "img"), on_bad_annotation="ignore")


def test_an_images_boxes_in_one_call_equal_them_one_by_one() -> None:
    # read_coco converts an image's annotations in one numpy call when all are plain; the rule is the
    # one-by-one path, which names each bad annotation: both must give the same boxes, labels and ids
    rng = np.random.default_rng(0)
    label_of, ids = {1: 0, 5: 1, 90: 2}, [1, 5, 90]
    for _ in range(200):
        anns = [{"id": int(rng.integers(1, 10**6)), "category_id": int(rng.choice(ids)),
                 "bbox": [float(v) if rng.random() < 0.7 else int(v) for v in rng.uniform(0, 500, 4)]}
                for _ in range(int(rng.integers(0, 9)))]
        if anns and rng.random() < 0.2:
            anns[0]["category_id"] = True  # a bool is an int to the one-by-one path (category 1)
        fast = _boxes_of(anns, "x.jpg", label_of, ids, BadDataPolicy("error", "fixture"))
        slow = _boxes_one_by_one(anns, "x.jpg", label_of, ids, BadDataPolicy("error", "fixture"))
        assert fast[0].dtype == slow[0].dtype == np.float32 and fast[0].tobytes() == slow[0].tobytes()
        assert fast[1].tolist() == slow[1].tolist() and fast[2] == slow[2]
