"""Sliced prediction: a detector run on overlapping tiles of a large image, its boxes merged back.

    from visiontrain import Predictor, predict_tiled

    predictor = Predictor.load("runs/trees")
    result = predict_tiled(predictor, "orthophoto.tif", 512, 0.2)   # Detections at the image's size

A detector resizes its input to its validation size (``task.val_size``): an image of thousands of
pixels a side shrinks its small objects to nothing. Here the image is cut into the tiles
``visiontrain tile`` trains on (``data.detection.tiles.tile_grid``: the same grid, so a model sees
windows of the size it learnt from), the ``Predictor`` runs on each, and on the whole image too (as
SAHI does by default: large objects that no tile holds whole are found there; ``whole_image=False``
leaves that pass out). Each tile's boxes move to the image's pixels, its masks are kept as pieces
of their extent (``MaskPiece``) and pasted into the image's canvas at the end, once per object.

The detections of every pass are merged class by class with greedy non-maximum *merging* (SAHI's
default, GREEDYNMM) rather than suppression: an object larger than the overlap is seen in parts by
two tiles, neither part whole, and NMS would keep one part (a box too small) where merging joins
them into the object's box. Two boxes match by their intersection over the *smaller* one's area,
not over their union: a part inside the whole object's box overlaps it little by IoU and almost
wholly by that measure. The best-scoring detection leads its group; the group's box is the union
of its members' boxes, its mask the union of their masks, its score and class the leader's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from visiontrain.data.detection.tiles import MaskPiece, Tile, check_tiling, tile_grid
from visiontrain.engine.protocols.task import Prediction
from visiontrain.use.inference import Detections, Predictor

#: Two detections of a class are one object when their intersection covers this share of the smaller box.
MATCH_THRESHOLD = 0.5


@dataclass
class Found:
    """Every pass's detections, in the image's pixels, before they are merged."""

    boxes: torch.Tensor
    scores: torch.Tensor
    labels: torch.Tensor
    names: list[str]
    category_ids: list[int]
    pieces: list[MaskPiece] | None


def predict_tiled(predictor: Predictor, image: Any, size: int, overlap: float = 0.2, *,
                  threshold: float | None = None, whole_image: bool = True,
                  match_threshold: float = MATCH_THRESHOLD) -> Detections:
    """One image's detections (``Detections`` at its own size) from ``size`` x ``size`` tiles that
    overlap by ``overlap`` of a tile, merged (the module docstring). ``image``: anything a Predictor
    takes; ``threshold``: each pass's minimum score (default the task's); ``whole_image``: run on the
    whole image too. An image no larger than a tile is predicted as it is, in one pass."""
    check_tiling(size, overlap)
    if predictor.prediction is not Prediction.BOXES:
        raise ValueError(f"tiled prediction applies to detectors; {predictor.checkpoint or 'this model'} predicts "
                         f"{predictor.prediction.value} (a classifier takes each image whole)")
    pixels = predictor.read(image)
    height, width = (int(v) for v in pixels.shape[-2:])
    tiles = tile_grid(height, width, size, overlap)
    if len(tiles) == 1:
        return predictor(pixels, threshold=threshold)
    windows = tiles + ([Tile(0, 0, width, height)] if whole_image else [])
    passes = [(t, predictor(pixels[:, t.y0:t.y1, t.x0:t.x1], threshold=threshold)) for t in windows]
    found = gathered(passes)
    return merged(found, greedy_merge(found.boxes, found.scores, found.labels, match_threshold), (height, width))


def gathered(passes: list[tuple[Tile, Detections]]) -> Found:
    """The detections of each window, moved to the image's pixels, masks as pieces (a tile's masks
    are never held at the image's size)."""
    boxes = [d.boxes.cpu().float() + torch.tensor([t.x0, t.y0, t.x0, t.y0], dtype=torch.float32) for t, d in passes]
    pieces = None
    if all(d.masks is not None for _, d in passes):
        pieces = [MaskPiece.of(m, t.x0, t.y0) for t, d in passes for m in d.masks.cpu().numpy()]
    scores = torch.cat([torch.zeros(0), *(d.scores.cpu().float() for _, d in passes)])
    labels = torch.cat([torch.zeros(0, dtype=torch.int64), *(d.labels.cpu() for _, d in passes)])
    return Found(torch.cat([torch.zeros(0, 4), *boxes]), scores, labels, [n for _, d in passes for n in d.names],
                 [c for _, d in passes for c in d.category_ids], pieces)


def greedy_merge(boxes: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor,
                 threshold: float = MATCH_THRESHOLD) -> list[list[int]]:
    """Groups of detections that are one object, best leader first: the best-scoring detection not
    yet taken leads, and takes every free detection of its class whose box's intersection with its
    own covers ``threshold`` of the smaller of the two."""
    sides = (boxes[:, 2:] - boxes[:, :2]).clamp(min=0)
    areas = (sides[:, 0] * sides[:, 1]).clamp(min=1e-9)
    free = torch.ones(len(scores), dtype=torch.bool)
    groups = []
    for i in scores.argsort(descending=True, stable=True).tolist():
        if not free[i]:
            continue
        inter = (torch.minimum(boxes[i, 2:], boxes[:, 2:]) - torch.maximum(boxes[i, :2], boxes[:, :2])).clamp(min=0)
        smaller = inter[:, 0] * inter[:, 1] / torch.minimum(areas[i], areas)
        members = free & (labels == labels[i]) & (smaller >= threshold)
        members[i] = False
        free[i] = False
        free &= ~members
        groups.append([i, *members.nonzero().flatten().tolist()])
    return groups


def merged(found: Found, groups: list[list[int]], size: tuple[int, int]) -> Detections:
    """One detection a group: the union of its boxes (and masks, pasted at the image's size), the
    leader's score and class."""
    lead = [g[0] for g in groups]
    boxes = torch.stack([torch.cat([found.boxes[g, :2].amin(0), found.boxes[g, 2:].amax(0)]) for g in groups]) \
        if groups else torch.zeros(0, 4)
    masks = None
    if found.pieces is not None:
        canvas, whole = np.zeros((len(groups), *size), bool), Tile(0, 0, size[1], size[0])
        for k, group in enumerate(groups):
            for j in group:
                found.pieces[j].paste_into(canvas[k], whole)
        masks = torch.from_numpy(canvas)
    return Detections(boxes, found.scores[lead], found.labels[lead], [found.names[i] for i in lead],
                      [found.category_ids[i] for i in lead], size, masks)
