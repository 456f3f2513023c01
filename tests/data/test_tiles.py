"""Large images cut into tiles (data/detection/tiles.py) and `visiontrain tile` (data/detection/tiled_coco.py):
the grid covers the image with the overlap asked, its last tile flush with the edge; a box is clipped
to its tile and kept when enough of it shows; a mask is cut with its tile; and the COCO dataset
`visiontrain tile` writes reads back (``data.name=coco``) with the boxes, masks and pixels of the
source cut at each tile's offset, for every detection source."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dataset_trees import build_coco, build_voc, build_yolo
from detection_helpers import MASK_SCENES, masks_coco, scene_image, scene_masks
from procs import in_process
from visiontrain.core import config as C
from visiontrain.data.detection.splits import build_detection_splits
from visiontrain.data.detection.tiles import MaskPiece, Tile, check_tiling, clip_boxes, cut_objects, tile_grid


# ---------------------------------------------------------------------------------- the grid
@pytest.mark.parametrize("height,width,size,overlap", [(1000, 1500, 512, 0.2), (700, 513, 256, 0.5),
                                                       (1024, 1024, 512, 0.0), (999, 37, 64, 0.25)])
def test_the_grid_covers_the_image_with_the_overlap_asked(height, width, size, overlap):
    tiles = tile_grid(height, width, size, overlap)
    seen = np.zeros((height, width), np.int32)
    for t in tiles:
        assert (t.width, t.height) == (min(size, width), min(size, height))
        assert 0 <= t.x0 and t.x1 <= width and 0 <= t.y0 and t.y1 <= height
        seen[t.y0:t.y1, t.x0:t.x1] += 1
    assert seen.min() >= 1  # every pixel in a tile, no tile padded
    step = size - int(size * overlap)
    for axis, length in (("x0", width), ("y0", height)):
        starts = sorted({getattr(t, axis) for t in tiles})
        assert starts[0] == 0 and starts[-1] + min(size, length) == length  # the last one ends at the edge
        assert all(b - a == step for a, b in zip(starts[:-1], starts[1:-1]))  # the rest a step apart
        assert 0 < starts[-1] - starts[-2] <= step if len(starts) > 1 else True
    assert len(tiles) == len({(t.x0, t.y0) for t in tiles})


def test_a_small_image_is_one_tile_as_it_is_and_a_short_side_is_not_padded():
    assert tile_grid(300, 200, 512) == [Tile(0, 0, 200, 300)]
    assert tile_grid(512, 512, 512, 0.5) == [Tile(0, 0, 512, 512)]
    assert [(t.x0, t.y0, t.width, t.height) for t in tile_grid(100, 1000, 512, 0.2)] == \
        [(0, 0, 512, 100), (410, 0, 512, 100), (488, 0, 512, 100)]
    assert Tile(512, 0, 512, 512).name("a/IMG", "png") == "a/IMG__x0512_y0000.png"


@pytest.mark.parametrize("size,overlap,message", [(0, 0.2, "size: .* >= 1, got 0"), (-5, 0.2, "got -5"),
                                                  (1.5, 0.2, "whole number"), (True, 0.2, "whole number"),
                                                  (64, 1.0, r"overlap: .* \[0, 1\) .*got 1.0"), (64, -0.1, "got -0.1")])
def test_a_bad_tiling_is_refused(size, overlap, message):
    with pytest.raises(ValueError, match=message):
        check_tiling(size, overlap)


# ----------------------------------------------------------------------------- boxes and masks
def test_a_box_is_clipped_to_its_tile_and_kept_when_enough_of_it_shows():
    tile = Tile(100, 50, 64, 64)
    boxes = np.array([[110, 60, 130, 80],      # inside: moved into the tile's pixels
                      [90, 60, 110, 80],       # half inside (10 of 20 px wide)
                      [150, 60, 200, 80],      # 14 of 50 px inside: 28%
                      [163, 60, 180, 80],      # a 1 px sliver
                      [120, 70, 121.5, 71.5],  # smaller than 2 px, whole: an object
                      [0, 0, 40, 40]], float)  # outside
    clipped, keep = clip_boxes(boxes, tile, min_visibility=0.3)
    assert keep.tolist() == [True, True, False, False, True, False]
    np.testing.assert_allclose(clipped[keep], [[10, 10, 30, 30], [0, 10, 10, 30], [20, 20, 21.5, 21.5]])
    assert clip_boxes(boxes, tile, min_visibility=0.25)[1].tolist() == [True, True, True, False, True, False]
    assert clip_boxes(boxes, tile, min_visibility=0.6)[1].tolist() == [True, False, False, False, True, False]


def test_a_mask_is_cut_with_its_tile_and_an_object_without_pixels_there_is_dropped():
    rng = np.random.default_rng(0)
    full = np.zeros((3, 90, 120), bool)
    full[0, 10:60, 20:70] = rng.random((50, 50)) > 0.3
    full[1, 40:85, 50:115] = True
    full[2, 0:6, 0:6] = True                                  # its box reaches into the tile, its pixels do not
    boxes = np.array([[20, 10, 70, 60], [50, 40, 115, 85], [0, 0, 40, 40]], float)
    pieces = [MaskPiece.of(m) for m in full]
    assert [p.pixels.shape for p in pieces][1:] == [(45, 65), (6, 6)]  # the extent of each mask, not the image
    tile = Tile(30, 20, 64, 64)
    objects = cut_objects(boxes, pieces, tile, min_visibility=0.1)
    assert objects.index.tolist() == [0, 1]
    for k, i in enumerate(objects.index):
        assert np.array_equal(objects.masks[k].astype(bool), full[i, 20:84, 30:94])
    assert cut_objects(boxes, None, tile, 0.1).index.tolist() == [0, 1, 2]  # boxes alone: the third is kept


# ------------------------------------------------------------------------------- `visiontrain tile`
def clipped(box, offset: tuple[int, int], width: int, height: int, min_visibility: float = 0.3) -> list | None:
    """The rule, written out: a box clipped to the tile, kept (else None) if >= min_visibility of its
    area shows and each side keeps 2 px."""
    (x1, y1, x2, y2), (x0, y0) = box, offset
    cx1, cy1, cx2, cy2 = max(x1, x0) - x0, max(y1, y0) - y0, min(x2, x0 + width) - x0, min(y2, y0 + height) - y0
    if cx2 - cx1 >= 2 and cy2 - cy1 >= 2 and (cx2 - cx1) * (cy2 - cy1) >= min_visibility * (x2 - x1) * (y2 - y1):
        return [cx1, cy1, cx2, cy2]
    return None


def expected_objects(boxes: np.ndarray, offset: tuple[int, int], width: int, height: int) -> list[list[float]]:
    return [c for c in (clipped(b, offset, width, height) for b in boxes.tolist()) if c is not None]


def polygon_box(polygon) -> tuple[float, float, float, float]:
    return min(polygon[0::2]), min(polygon[1::2]), max(polygon[0::2]), max(polygon[1::2])


def tiles_of(out: Path, split: str) -> dict[str, dict]:
    """The tile entries of a split's annotation file, by file name."""
    return {img["file_name"]: img for img in json.loads((out / "annotations" / f"instances_{split}.json").read_text())
            ["images"]}


#: The mask tests' scenes, and a wide one with a single object in its corner: tiles without an object.
SCENES = (*MASK_SCENES, (100, 40, ((2, (2, 3, 20, 3, 20, 22, 2, 22)),)))


def test_tiles_with_masks_read_back_as_coco_and_train_a_mask_task(tmp_path, capsys):
    """`visiontrain tile segment-mask-rcnn` on COCO polygons: every tile's pixels, boxes and masks are
    the source's cut at its offset; the train split keeps no empty tile at --keep-empty 0, the val split
    every tile; segment-mask-rcnn's own data builder reads the tiles' masks."""
    root, out = masks_coco(tmp_path / "coco", SCENES), tmp_path / "tiles"
    code, stdout, err = in_process(capsys, "tile", "segment-mask-rcnn", "data.name=coco", f"data.root={root}",
                                   "--out", str(out), "--size", "32", "--overlap", "0.25", "--keep-empty", "0")
    assert code == 0, err
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["masks"] is True and summary["classes"] == 3 and set(summary["splits"]) == {"train", "val"}
    grids = [tile_grid(h, w, 32, 0.25) for w, h, _ in SCENES]
    assert summary["splits"]["val"]["tiles"] == sum(map(len, grids))  # val: every tile, empty or not
    cfg = C.load_config("segment-mask-rcnn", ["data.name=coco", f"data.root={out}"])
    train, val = build_detection_splits(cfg.data, masks=True)
    for ds, entries in ((train, tiles_of(out, "train")), (val, tiles_of(out, "val"))):
        for i, record in enumerate(ds.records):
            entry = entries[Path(record.path).name]
            scene = SCENES[entry["source_image_id"] - 1]
            x0, y0 = entry["offset"]
            assert record.path.endswith(f"__x{x0:04d}_y{y0:04d}.png") and entry["source_file"].endswith(
                f"{entry['source_image_id']}.png")
            crop = (slice(y0, y0 + record.height), slice(x0, x0 + record.width))
            assert np.array_equal(np.asarray(Image.open(record.path)), scene_image(scene)[crop])
            seen = [(k, m[crop].astype(bool)) for k, m in enumerate(scene_masks(scene))
                    if m[crop].any() and clipped(polygon_box(scene[2][k][1]), (x0, y0), record.width, record.height)]
            masks = ds.load(i)[1]["masks"].numpy().astype(bool)  # every object the tile shows, its mask cut
            assert len(masks) == len(record.labels) == len(seen)
            for mask, label, (k, want) in zip(masks, record.labels, seen):
                assert np.array_equal(mask, want) and scene[2][k][0] == label
    assert summary["splits"]["train"]["tiles"] == len(train) < len(val)  # the empty ones left out
    assert all(len(r.labels) for r in train.records)
    from visiontrain.tasks import build_task

    image, target = build_task(cfg).build_data().train[0]  # what segment-mask-rcnn trains on
    assert target["masks"].shape[0] == len(target["labels"]) > 0


@pytest.mark.parametrize("source,build,overrides", [
    ("coco", build_coco, ["data.train_split=train2017", "data.val_split=val2017"]),
    ("voc", build_voc, ["data.train_split=trainval", "data.val_split=test"]),
    ("yolo", build_yolo, [])])
def test_every_detection_source_tiles_to_its_clipped_boxes(tmp_path, capsys, source, build, overrides):
    """Boxes of COCO (photos stored turned, with an EXIF orientation tag), VOC and YOLO: each tile's
    boxes read back are the source's boxes clipped to it by the rule; its tiles are JPEG, as the source."""
    root, out = tmp_path / source, tmp_path / "tiles"
    build(root, orientations=[1, 6]) if source == "coco" else build(root)
    args = [f"data.name={source}", f"data.root={root}", *overrides]
    code, _, err = in_process(capsys, "tile", "detect-faster-rcnn", *args, "--out", str(out), "--size", "48",
                              "--keep-empty", "1")
    assert code == 0, err
    sources = build_detection_splits(C.load_config("detect-faster-rcnn", args).data)
    tiles = build_detection_splits(C.load_config("detect-faster-rcnn", ["data.name=coco", f"data.root={out}",
                                                                        *overrides]).data)
    for src, ds in zip(sources, tiles):
        entries = tiles_of(out, ds.source.rsplit("instances_", 1)[1][:-len(".json")])
        assert len(ds) == len(entries) == sum(len(tile_grid(r.height, r.width, 48, 0.2)) for r in src.records)
        by_path = {r.path: r for r in src.records}
        for record in ds.records:
            entry = entries[Path(record.path).name]
            origin = by_path[entry["source_file"]]
            assert record.path.endswith(".jpg") and (entry["source_height"], entry["source_width"]) == \
                (origin.height, origin.width)
            want = expected_objects(origin.boxes, entry["offset"], record.width, record.height)
            np.testing.assert_allclose(record.boxes.reshape(-1, 4), np.array(want).reshape(-1, 4), atol=1e-4)


@pytest.mark.parametrize("args,message", [
    (["detect-faster-rcnn", "--size", "0"], "--size: the tile's side must be a whole number of pixels >= 1, got 0"),
    (["detect-faster-rcnn", "--size", "64", "--overlap", "1"], "--overlap: the share of a tile its neighbour "
                                                               "overlaps must be in [0, 1)"),
    (["detect-faster-rcnn", "--size", "64", "--keep-empty", "2"], "--keep-empty: a share in [0, 1], got 2.0"),
    (["classify-fashion", "data.name=digits", "--size", "64"], "data.name=digits: visiontrain tile cuts the boxes "
                                                               "and masks of a detection source")])
def test_bad_options_and_a_classification_source_are_one_line(tmp_path, capsys, args, message):
    code, _, err = in_process(capsys, "tile", *args, "--out", str(tmp_path / "t"))
    assert code == 2 and err.startswith("visiontrain: error: ") and message in err and "Traceback" not in err, err
    assert not (tmp_path / "t").exists()


def test_a_split_written_before_is_not_overwritten(tmp_path, capsys):
    root, out = masks_coco(tmp_path / "coco"), tmp_path / "tiles"
    args = ["tile", "detect-faster-rcnn", "data.name=coco", f"data.root={root}", "--out", str(out), "--size", "32"]
    assert in_process(capsys, *args)[0] == 0
    code, _, err = in_process(capsys, *args)
    assert code == 2 and "split 'train' is there already" in err and "remove it, or choose another --out" in err
