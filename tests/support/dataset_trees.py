"""Tiny datasets in the real on-disk layouts a user points ``data.root`` at (docs/datasets.md):
COCO 2017, Pascal VOC, YOLO txt, and an ImageNet-style class folder. Used by the docs' tested
commands and by the tests that run the full-scale recipes as shipped. Each COCO annotation carries
its object's ``segmentation`` too (the filled box's pixels), so that instance segmentation trains on
the same tree: polygons, and in each split one RLE (compressed in train, uncompressed in val).

``orientations`` stores the images as a phone stores its photos: turned, with the EXIF orientation
tag that turns them upright again (image ``i`` takes ``orientations[i % len]``), while the
annotations describe the upright image, as the annotation tools that show it upright write them."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

CLASSES = ("square", "bar")
SPLIT_IDS = (range(0, 8), range(8, 12))  # 8 training, 4 validation images
ALL_ORIENTATIONS = (6, 8, 3, 1, 5, 7, 2, 4)  # the phone's usual ones first


def save_photo(img: Any, path: Path, orientation: int = 1) -> None:
    """A JPEG that a viewer shows as ``img``: stored turned by the inverse of what EXIF ``orientation``
    asks, with that tag (0x0112), so that applying the tag gives ``img`` back."""
    from PIL import Image

    if orientation == 1:
        img.save(path, quality=95)
        return
    t = Image.Transpose
    stored_from_upright = {2: t.FLIP_LEFT_RIGHT, 3: t.ROTATE_180, 4: t.FLIP_TOP_BOTTOM, 5: t.TRANSPOSE,
                           6: t.ROTATE_90, 7: t.TRANSVERSE, 8: t.ROTATE_270}
    exif = Image.Exif()
    exif[0x0112] = orientation
    img.transpose(stored_from_upright[orientation]).save(path, quality=95, exif=exif)


def upright_copy(photo: Path) -> Path:
    """The photo as a viewer shows it (PIL's ``exif_transpose``), as a PNG beside it with no tag: the
    same upright pixels, losslessly."""
    from PIL import Image, ImageOps

    copy = photo.with_name(f"{photo.stem}-upright.png")
    with Image.open(photo) as im:
        ImageOps.exif_transpose(im).save(copy)
    return copy


def _orientation(i: int, orientations: Sequence[int] | None) -> int:
    return orientations[i % len(orientations)] if orientations else 1


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


def _segmentation(box: Sequence[int], height: int, width: int, rle: str | None = None) -> Any:
    """The pixels of a filled box (x1, y1, x2, y2) as a COCO ``segmentation``: a polygon, or with
    ``rle`` the same pixels as an RLE: ``compressed`` (string counts, as COCO results and the
    embedded sets write them) or ``uncompressed`` (a list of runs, as COCO's files write crowd regions)."""
    import numpy as np
    from pycocotools import mask as coco_mask

    x1, y1, x2, y2 = box
    if rle is None:
        return [[x1, y1, x2, y1, x2, y2, x1, y2]]
    pixels = np.zeros((height, width), np.uint8)
    pixels[y1:y2, x1:x2] = 1
    if rle == "compressed":
        return {"size": [height, width], "counts": coco_mask.encode(np.asfortranarray(pixels))["counts"].decode()}
    flat = pixels.flatten(order="F")  # column-major runs, starting with a run of zeros
    runs = np.diff(np.concatenate([[0], np.flatnonzero(np.diff(flat)) + 1, [flat.size]])).tolist()
    return {"size": [height, width], "counts": [0] * int(flat[0]) + runs}


def build_coco(root: Path, orientations: Sequence[int] | None = None) -> None:
    (root / "annotations").mkdir(parents=True)
    for split, ids, rle in zip(("train2017", "val2017"), SPLIT_IDS, ("compressed", "uncompressed")):
        (root / split).mkdir()
        images, anns = [], []
        for i in ids:
            img, boxes = _scene(i)
            save_photo(img, root / split / f"{i:06d}.jpg", _orientation(i, orientations))
            images.append({"id": i + 1, "file_name": f"{i:06d}.jpg", "width": img.width, "height": img.height})
            for x1, y1, x2, y2, c in boxes:
                anns.append({"id": len(anns) + 1, "image_id": i + 1, "category_id": c + 1, "iscrowd": 0,
                             "bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1),
                             "segmentation": _segmentation((x1, y1, x2, y2), img.height, img.width,
                                                           rle if not anns else None)})
        cats = [{"id": c + 1, "name": n} for c, n in enumerate(CLASSES)]
        (root / "annotations" / f"instances_{split}.json").write_text(
            json.dumps({"images": images, "annotations": anns, "categories": cats}))


def build_voc(root: Path, orientations: Sequence[int] | None = None) -> None:
    for d in ("ImageSets/Main", "Annotations", "JPEGImages"):
        (root / d).mkdir(parents=True)
    for split, ids in zip(("trainval", "test"), SPLIT_IDS):
        for i in ids:
            img, boxes = _scene(i)
            save_photo(img, root / "JPEGImages" / f"{i:06d}.jpg", _orientation(i, orientations))
            objects = "".join(f"<object><name>{CLASSES[c]}</name><difficult>0</difficult><bndbox>"
                              f"<xmin>{x1 + 1}</xmin><ymin>{y1 + 1}</ymin><xmax>{x2}</xmax><ymax>{y2}</ymax>"
                              f"</bndbox></object>" for x1, y1, x2, y2, c in boxes)
            (root / "Annotations" / f"{i:06d}.xml").write_text(
                f"<annotation><filename>{i:06d}.jpg</filename><size><width>{img.width}</width>"
                f"<height>{img.height}</height><depth>3</depth></size>{objects}</annotation>")
        (root / "ImageSets" / "Main" / f"{split}.txt").write_text("".join(f"{i:06d}\n" for i in ids))


def build_yolo(root: Path, orientations: Sequence[int] | None = None) -> None:
    for split, ids in zip(("train", "val"), SPLIT_IDS):
        (root / "images" / split).mkdir(parents=True)
        (root / "labels" / split).mkdir(parents=True)
        for i in ids:
            img, boxes = _scene(i)
            save_photo(img, root / "images" / split / f"{i:06d}.jpg", _orientation(i, orientations))
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


# ------------------------------------------------------------------ files a user's tree gets wrong

def truncated_jpeg(path: Path, size: tuple[int, int] = (64, 48)) -> Path:
    """A JPEG cut off half-way (an interrupted copy or download): its header, and so its size, reads."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(2).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, quality=95)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    return path


def broken_inside_jpeg(path: Path, size: tuple[int, int] = (64, 48)) -> Path:
    """A JPEG whose Huffman table is overwritten: whole to the up-front check (header and end marker
    are there), but its decoder fails on the pixel data, as it does only when the image is loaded."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(4).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, quality=95)
    data = bytearray(path.read_bytes())
    table = data.find(b"\xff\xc4")  # DHT: the first Huffman table
    data[table + 5:table + 25] = b"\xff" * 20
    path.write_bytes(bytes(data))
    return path


def renamed_text(path: Path, text: str = "class notes, saved with the wrong extension\n") -> Path:
    """A text file under an image's name (a .txt renamed .jpg; a git-LFS pointer is one too)."""
    path.write_text(text)
    return path


GIT_LFS_POINTER = ("version https://git-lfs.github.com/spec/v1\n"
                   "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 12345\n")


def build_voc_names(root: Path, names: dict[str, list[str]]) -> None:
    """A VOC tree whose split ``trainval`` has one image per entry of ``names`` (its stem), holding
    one object per class name given, written exactly as given (``"tree "`` keeps its space)."""
    from PIL import Image

    for d in ("ImageSets/Main", "Annotations", "JPEGImages"):
        (root / d).mkdir(parents=True, exist_ok=True)
    for stem, objects in names.items():
        Image.new("RGB", (64, 48), (90, 120, 60)).save(root / "JPEGImages" / f"{stem}.jpg")
        xml = "".join(f"<object><name>{name}</name><bndbox><xmin>{5 + 10 * k}</xmin><ymin>5</ymin>"
                      f"<xmax>{14 + 10 * k}</xmax><ymax>20</ymax></bndbox></object>" for k, name in enumerate(objects))
        (root / "Annotations" / f"{stem}.xml").write_text(f"<annotation><filename>{stem}.jpg</filename>{xml}"
                                                          f"</annotation>")
    (root / "ImageSets" / "Main" / "trainval.txt").write_text("".join(f"{stem}\n" for stem in names))


def add_image_folder_split(root: Path, split: str, per_class: int = 3) -> None:
    """Another split beside build_image_folder's train/ and val/ (e.g. test/), with the same classes;
    or more images in one of them (named ``<split>-<i>.png``)."""
    from PIL import Image, ImageDraw

    for name in ("circle", "cross"):
        (root / split / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            img = Image.new("RGB", (40, 40), (40 + 25 * i, 20, 50))
            draw = ImageDraw.Draw(img)
            if name == "circle":
                draw.ellipse([10, 10, 30, 30], fill=(240, 240, 0))
            else:
                draw.line([10, 10, 30, 30], fill=(0, 240, 240), width=4)
                draw.line([10, 30, 30, 10], fill=(0, 240, 240), width=4)
            img.save(root / split / name / f"{split}-{i:03d}.png")


# ---------------------------------------------------------------- image-folder
def build_png_tree(root: Path, classes: dict[str, list[str]], n: int = 3) -> None:
    """An image folder of random PNGs, ``n`` a class, of a few sizes (one file greyscale): ``{split: [class...]}``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, names in classes.items():
        for c in names:
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                arr = rng.integers(0, 256, size=(20 + 4 * i, 24, 3), dtype=np.uint8)
                mode = "L" if i == 1 else "RGB"  # a grey file must still come out RGB
                img = Image.fromarray(arr[..., 0] if mode == "L" else arr, mode=mode)
                img.save(root / split / c / f"{i}.png")


def build_crowns(root: Path, cache: Path) -> Path:
    """Real photographs with instance masks, as a newcomer's hand-drawn tree crowns: neon-trees' 400 px
    aerial tiles (deepforest's NEON images, one class) written as COCO, each crown a 24-point polygon
    inside its box, its radius jittered by up to 15 % as a hand traces an edge. Returns ``root``."""
    import shutil

    import numpy as np

    from visiontrain.data.detection.embedded import build_neon_trees

    source, rng = build_neon_trees(cache), np.random.default_rng(0)
    angle = np.linspace(0, 2 * np.pi, 24, endpoint=False)
    for split in ("train", "val"):
        shutil.copytree(source / split, root / split)
        coco = json.loads((source / "annotations" / f"{split}.json").read_text())
        for ann in coco["annotations"]:
            x, y, w, h = ann["bbox"]
            radius = 1 - 0.15 * rng.random(len(angle))
            xs, ys = x + w / 2 * (1 + radius * np.cos(angle)), y + h / 2 * (1 + radius * np.sin(angle))
            ann["segmentation"] = [np.round(np.stack([xs, ys], 1).ravel(), 1).tolist()]
        (root / "annotations").mkdir(exist_ok=True)
        (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(coco))
    return root
