"""Tiny datasets in the real on-disk layouts a user points ``data.root`` at (docs/datasets.md):
COCO 2017, Pascal VOC, YOLO txt, and an ImageNet-style class folder. Used by the docs' tested
commands and by the tests that run the full-scale recipes as shipped."""
from __future__ import annotations

import json
from pathlib import Path

CLASSES = ("square", "bar")
SPLIT_IDS = (range(0, 8), range(8, 12))  # 8 training, 4 validation images


def _scene(i: int):
    """A 128x96 image with one (even i) or two (odd i) filled boxes: [(x1, y1, x2, y2, class)]."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (128, 96), (40 + 7 * (i % 9), 60, 80))
    draw = ImageDraw.Draw(img)
    boxes = []
    for k in range(1 + i % 2):
        cls = (i + k) % 2
        x1, y1 = 8 + 50 * k + 3 * (i % 5), 10 + 4 * (i % 4)
        x2, y2 = (x1 + 30, y1 + 30) if cls == 0 else (x1 + 16, y1 + 60)
        draw.rectangle([x1, y1, x2 - 1, y2 - 1], fill=(220, 200 - 120 * cls, 40 + 180 * cls))
        boxes.append((x1, y1, x2, y2, cls))
    return img, boxes


def build_coco(root: Path) -> None:
    (root / "annotations").mkdir(parents=True)
    for split, ids in zip(("train2017", "val2017"), SPLIT_IDS):
        (root / split).mkdir()
        images, anns = [], []
        for i in ids:
            img, boxes = _scene(i)
            img.save(root / split / f"{i:06d}.jpg", quality=95)
            images.append({"id": i + 1, "file_name": f"{i:06d}.jpg", "width": img.width, "height": img.height})
            for x1, y1, x2, y2, c in boxes:
                anns.append({"id": len(anns) + 1, "image_id": i + 1, "category_id": c + 1, "iscrowd": 0,
                             "bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1)})
        cats = [{"id": c + 1, "name": n} for c, n in enumerate(CLASSES)]
        (root / "annotations" / f"instances_{split}.json").write_text(
            json.dumps({"images": images, "annotations": anns, "categories": cats}))


def build_voc(root: Path) -> None:
    for d in ("ImageSets/Main", "Annotations", "JPEGImages"):
        (root / d).mkdir(parents=True)
    for split, ids in zip(("trainval", "test"), SPLIT_IDS):
        for i in ids:
            img, boxes = _scene(i)
            img.save(root / "JPEGImages" / f"{i:06d}.jpg", quality=95)
            objects = "".join(f"<object><name>{CLASSES[c]}</name><difficult>0</difficult><bndbox>"
                              f"<xmin>{x1 + 1}</xmin><ymin>{y1 + 1}</ymin><xmax>{x2}</xmax><ymax>{y2}</ymax>"
                              f"</bndbox></object>" for x1, y1, x2, y2, c in boxes)
            (root / "Annotations" / f"{i:06d}.xml").write_text(
                f"<annotation><filename>{i:06d}.jpg</filename><size><width>{img.width}</width>"
                f"<height>{img.height}</height><depth>3</depth></size>{objects}</annotation>")
        (root / "ImageSets" / "Main" / f"{split}.txt").write_text("".join(f"{i:06d}\n" for i in ids))


def build_yolo(root: Path) -> None:
    for split, ids in zip(("train", "val"), SPLIT_IDS):
        (root / "images" / split).mkdir(parents=True)
        (root / "labels" / split).mkdir(parents=True)
        for i in ids:
            img, boxes = _scene(i)
            img.save(root / "images" / split / f"{i:06d}.jpg", quality=95)
            w, h = img.size
            (root / "labels" / split / f"{i:06d}.txt").write_text("".join(
                f"{c} {(x1 + x2) / 2 / w:.6f} {(y1 + y2) / 2 / h:.6f} {(x2 - x1) / w:.6f} {(y2 - y1) / h:.6f}\n"
                for x1, y1, x2, y2, c in boxes))
    (root / "data.yaml").write_text(f"names: [{', '.join(CLASSES)}]\n")


def build_image_folder(root: Path) -> None:
    from PIL import Image, ImageDraw

    for split, n in (("train", 8), ("val", 4)):
        for name in ("circle", "cross"):
            (root / split / name).mkdir(parents=True)
            for i in range(n):
                img = Image.new("RGB", (40, 40), (30 + 20 * i, 30, 30))
                draw = ImageDraw.Draw(img)
                if name == "circle":
                    draw.ellipse([8, 8, 32, 32], fill=(240, 240, 0))
                else:
                    draw.line([8, 8, 32, 32], fill=(0, 240, 240), width=4)
                    draw.line([8, 32, 32, 8], fill=(0, 240, 240), width=4)
                img.save(root / split / name / f"{i:03d}.png")
