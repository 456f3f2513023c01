"""Run a visiontrain ONNX file with onnxruntime, numpy and PIL only: no torch, and nothing else from
visiontrain, so this one file can be copied to a machine that has only those three and run there.

    python -m visiontrain.use.onnx_runner MODEL.onnx IMAGE... [--threshold T] [--top-k K] [--masks DIR]
    python onnx_runner.py MODEL.onnx IMAGE...      # the same, this file copied elsewhere

    from visiontrain.use.onnx_runner import OnnxModel
    model = OnnxModel("digits.onnx")
    model.predict("digit.png")                     # {"top": [{"class_id", "name", "probability"}, ...]}
    OnnxModel("semantic.onnx").segment(image)      # a semantic model's label map, int64 [H, W]
    OnnxModel("panoptic.onnx").panoptic(image)     # a panoptic model's (segment ids int32 [H, W], segments_info)

Every size, statistic, class name and decoding rule comes from the file's metadata, which
``visiontrain export`` writes (docs/inference.md lists the keys). An image is read as visiontrain
reads it (upright by its EXIF orientation; 16-bit grey scaled to 8 bits by its range), prepared as
the model's validation images were, and decoded as visiontrain decodes the model's outputs, so the
results are the Python API's (``visiontrain.Predictor``) to float rounding on an image that needs
no resize (PIL's bilinear resize differs from torchvision's by a grey level on a few pixels).
``visiontrain predict MODEL.onnx IMAGE...`` runs this module behind the command's usual outputs.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image, ImageOps

#: The exported tasks whose outputs this module decodes, by what they give.
CLASSIFIERS = ("classification",)
DETECTORS = ("rcnn", "mask_rcnn", "yolo", "detr")
BACKBONES = ("dino",)
SEGMENTERS = ("semantic",)
PANOPTIC = ("panoptic",)
MASK_DETECTORS = ("mask_rcnn", *PANOPTIC)  # each detection's M x M probabilities, pasted by mask_paste
DEFAULT_TOP_K = 5


class OnnxRunnerError(ValueError):
    """An ONNX file or an image this module cannot run: the message names it and says why."""


def read_image(path: str | Path) -> Image.Image:
    """The file as visiontrain reads it: turned upright by its EXIF orientation (as viewers show a
    phone photo), and 16-bit (or 32-bit) grey scaled to 8 bits by its range instead of clipped at
    255, which PIL's ``convert`` would do."""
    try:
        image = ImageOps.exif_transpose(Image.open(path))
    except (OSError, SyntaxError, ValueError) as err:  # PIL raises SyntaxError for some broken files
        raise OnnxRunnerError(f"{path}: cannot be read as an image ({err})") from None
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        grey = np.asarray(image, dtype=np.float64)
        top = 65535.0 if image.mode.startswith("I;16") else max(grey.max(), 1.0)
        image = Image.fromarray((grey / top * 255).round().clip(0, 255).astype(np.uint8))
    return image


def read_metadata(session: Any) -> dict[str, Any]:
    """metadata_props: strings as they are, every other value as JSON."""
    meta: dict[str, Any] = {}
    for key, value in session.get_modelmeta().custom_metadata_map.items():
        try:
            meta[key] = json.loads(value)
        except ValueError:
            meta[key] = value
    return meta


def providers_for(device: str | None, available: Sequence[str]) -> list[Any]:
    """onnxruntime's execution providers for a torch-style device name: ``cpu``, ``cuda``,
    ``cuda:N``; None: the GPU where onnxruntime has one, else the CPU."""
    if device is None:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"] if "CUDAExecutionProvider" in available \
            else ["CPUExecutionProvider"]
    kind, _, index = device.partition(":")
    if kind == "cpu" and not index:
        return ["CPUExecutionProvider"]
    if kind == "cuda" and (not index or index.isdigit()):
        if "CUDAExecutionProvider" not in available:
            raise OnnxRunnerError(f"device {device!r}: this onnxruntime has no CUDA provider (it has "
                                  f"{', '.join(available)}); install onnxruntime-gpu, or use the cpu")
        return [("CUDAExecutionProvider", {"device_id": int(index or 0)}), "CPUExecutionProvider"]
    raise OnnxRunnerError(f"device {device!r}: expected cpu, cuda or cuda:N")


def resized_size(h: int, w: int, resize: dict[str, Any]) -> tuple[int, int]:
    """(height, width) after the model's resize rule (torchvision's Resize arithmetic)."""
    if resize["mode"] == "none":
        return h, w
    if resize["mode"] == "stretch":
        return resize["height"], resize["width"]
    short, long = min(h, w), max(h, w)
    if resize["mode"] == "longer_side":
        new_short, new_long = int(resize["longer_side"] * short / long), resize["longer_side"]
    else:  # shorter_side, shorter_side_then_center_crop
        new_short, new_long = resize["shorter_side"], int(resize["shorter_side"] * long / short)
        cap = resize.get("max_longer_side")
        if cap and new_long > cap:
            new_short, new_long = int(cap * new_short / new_long), cap
    return (new_long, new_short) if w <= h else (new_short, new_long)


def prepare(image: Image.Image, meta: dict[str, Any]) -> tuple[np.ndarray, tuple[int, int]]:
    """The model input [1, C, H, W] float32 (padded where the metadata says) and the real (h, w)."""
    image = image.convert(meta["color"])  # "RGB", or "L" for a grey model
    h, w = resized_size(image.height, image.width, meta["resize"])
    if (h, w) != (image.height, image.width):
        image = image.resize((w, h), Image.BILINEAR)
    crop = meta["resize"].get("crop")
    if crop:  # centre crop, as torchvision's CenterCrop
        top, left = int(round((h - crop) / 2)), int(round((w - crop) / 2))
        image, h, w = image.crop((left, top, left + crop, top + crop)), crop, crop
    x = np.asarray(image, dtype=np.float32).reshape(h, w, -1) * np.float32(meta["scale"])
    x = (x - np.float32(meta["mean"])) / np.float32(meta["std"])
    x = x.transpose(2, 0, 1)[None]
    pad = meta.get("pad")
    if isinstance(pad, dict):  # bottom and right, with 0, to a multiple of 32 (YOLO, DETR)
        ph, pw = -(-h // pad["multiple"]) * pad["multiple"], -(-w // pad["multiple"]) * pad["multiple"]
        x = np.pad(x, ((0, 0), (0, 0), (0, ph - h), (0, pw - w)), constant_values=pad["value"])
    return np.ascontiguousarray(x, dtype=np.float32), (h, w)


def resize_bilinear(x: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Maps [C, h, w] resized to ``size`` (H, W) as torch's ``interpolate(mode="bilinear",
    align_corners=False)``: half-pixel centres, a source coordinate below 0 taken as 0."""
    def taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        src = np.maximum((np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5, 0.0)
        low = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
        return low, np.minimum(low + 1, n_in - 1), (src - low).astype(np.float32)

    (y0, y1, wy), (x0, x1, wx) = taps(x.shape[-2], size[0]), taps(x.shape[-1], size[1])
    rows = x[:, y0] * (1 - wy)[:, None] + x[:, y1] * wy[:, None]
    return rows[:, :, x0] * (1 - wx) + rows[:, :, x1] * wx


def label_map(logits: np.ndarray, size: tuple[int, int], orig: tuple[int, int]) -> np.ndarray:
    """Logits [C, H', W'] at the padded input's size -> each pixel's class, int64 [H, W] at the original
    size, as visiontrain's semantic task makes its label maps: cut to the resized image (``size``),
    resized bilinearly to the original (``resize_bilinear``), argmax (the first class of a tie)."""
    logits = logits[:, :size[0], :size[1]]
    return (logits if size == orig else resize_bilinear(logits, orig)).argmax(0).astype(np.int64)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def nms(boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray, iou: float) -> np.ndarray:
    """Per-class greedy NMS, as torchvision's batched_nms: kept indices, best score first."""
    boxes = boxes + (labels * (boxes.max(initial=0) + 1))[:, None]  # classes never overlap
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    order, keep = np.argsort(-scores, kind="stable"), []
    while order.size:
        i, rest = order[0], order[1:]
        keep.append(i)
        wh = np.clip(np.minimum(boxes[i, 2:], boxes[rest, 2:]) - np.maximum(boxes[i, :2], boxes[rest, :2]), 0, None)
        inter = wh[:, 0] * wh[:, 1]
        order = rest[inter / (area[i] + area[rest] - inter) <= iou]
    return np.array(keep, dtype=np.int64)


def clip_and_drop_small(boxes: np.ndarray, h: int, w: int, min_size: float) -> tuple[np.ndarray, np.ndarray]:
    """Boxes clipped to the image, and which of them keep both sides at least ``min_size``."""
    boxes = np.stack([boxes[:, 0].clip(0, w), boxes[:, 1].clip(0, h), boxes[:, 2].clip(0, w),
                      boxes[:, 3].clip(0, h)], 1)
    return boxes, (boxes[:, 2] - boxes[:, 0] >= min_size) & (boxes[:, 3] - boxes[:, 1] >= min_size)


def scale_to(boxes: np.ndarray, size: tuple[int, int], orig: tuple[int, int]) -> np.ndarray:
    """Boxes in the resized image's pixels to the original image's, as visiontrain rescales them."""
    sx, sy = np.float32(orig[1]) / np.float32(size[1]), np.float32(orig[0]) / np.float32(size[0])
    return boxes * np.float32([sx, sy, sx, sy])


def yolo_candidates(outputs: Sequence[np.ndarray], meta: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """YOLOv3's raw maps -> every anchor's box (in input pixels) and class scores [N, classes]."""
    classes, per_scale = len(meta["class_names"]), meta["anchors_per_scale"]
    anchors = np.float32(meta["anchors"])
    boxes, raw = [], []
    for level, (out, stride) in enumerate(zip(outputs, meta["strides"])):
        _, _, gh, gw = out.shape
        p = out[0].reshape(per_scale, 5 + classes, gh, gw).transpose(0, 2, 3, 1).reshape(-1, 5 + classes)
        ys, xs = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
        cell = np.tile(np.stack([xs.ravel(), ys.ravel()], 1), (per_scale, 1)).astype(np.float32)
        anchor = np.repeat(anchors[level * per_scale:(level + 1) * per_scale], gh * gw, axis=0)
        centre = (sigmoid(p[:, :2]) + cell) * np.float32(stride)
        half = np.exp(np.minimum(p[:, 2:4], np.float32(10))) * anchor / 2
        boxes.append(np.concatenate([centre - half, centre + half], 1))
        raw.append(p)
    p = np.concatenate(raw)
    return np.concatenate(boxes), sigmoid(p[:, 4:5]) * sigmoid(p[:, 5:])


def decode_yolo(outputs: Sequence[np.ndarray], meta: dict[str, Any], size: tuple[int, int],
                orig: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw maps -> (boxes in the original image, scores, labels), as visiontrain's YOLO post-processing:
    the best ``pre_nms_topk`` (anchor, class) pairs above ``conf_threshold``, then per-class NMS."""
    boxes, scores = yolo_candidates(outputs, meta)
    classes = scores.shape[1]
    boxes, valid = clip_and_drop_small(scale_to(boxes, size, orig), *orig, meta["min_box_size"])
    flat = scores[valid].ravel()
    best = np.argsort(-flat, kind="stable")[:meta["pre_nms_topk"]]
    best = best[flat[best] > meta["conf_threshold"]]
    boxes, scores, labels = boxes[valid][best // classes], flat[best], best % classes
    kept = nms(boxes, scores, labels, meta["nms_iou"])[:meta["max_detections"]]
    return boxes[kept], scores[kept], labels[kept]


def decode_detr(outputs: Sequence[np.ndarray], meta: dict[str, Any],
                orig: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Query logits and cxcywh fractions -> (boxes in the original image, scores, labels)."""
    logits, cxcywh = outputs[0][0], outputs[1][0]
    if meta["class_activation"] == "sigmoid":  # the best (query, class) pairs
        classes = logits.shape[-1]
        flat = sigmoid(logits).ravel()
        best = np.argsort(-flat, kind="stable")[:meta["top_k"]]
        scores, labels, cxcywh = flat[best], best % classes, cxcywh[best // classes]
    else:  # softmax with a last 'no object' column: each query's best real class
        probs = softmax(logits)[:, :-1]
        scores, labels = probs.max(-1), probs.argmax(-1)
    (cx, cy, bw, bh), (h, w) = cxcywh.T, orig
    boxes = np.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], 1) * np.float32([w, h, w, h])
    boxes, keep = clip_and_drop_small(boxes, h, w, meta["min_box_size"])
    return boxes[keep], scores[keep], labels[keep]


def grid_taps(start: int, stop: int, lo: float, hi: float, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Where a box edge lo..hi samples its M cells for the pixel centres start..stop-1 of one axis
    (torch's grid_sample, align_corners=False, in float32 as torch computes it): the cell below each
    sample, in the grid padded with one cell of 0, and the weight of the cell above it."""
    g = (np.arange(start, stop, dtype=np.float32) + np.float32(0.5) - np.float32(lo)) / np.float32(
        max(hi - lo, 1e-3)) * np.float32(2) - np.float32(1)
    x = ((g + np.float32(1)) * np.float32(m) - np.float32(1)) / np.float32(2)
    below = np.floor(x)
    return np.clip(below.astype(np.int64), -1, m) + 1, (x - below).astype(np.float32)


def paste_mask(probabilities: np.ndarray, box: np.ndarray, h: int, w: int, threshold: float) -> np.ndarray:
    """One detection's M x M probabilities over its box -> its bool mask [h, w] in an image of that
    size (the metadata's ``mask_paste``): each pixel whose centre lies in the box (its corners
    truncated to whole pixels) reads the grid bilinearly at the centre's place in the box, 0 beyond
    the grid's outer cells, and is in the mask where that is above ``threshold``."""
    m = probabilities.shape[-1]
    grid = np.pad(probabilities.astype(np.float32), 1)  # 0 outside the M x M cells
    x0, y0, x1, y1 = (float(v) for v in box)
    c0, r0, c1, r1 = max(0, int(x0)), max(0, int(y0)), min(w, int(x1) + 1), min(h, int(y1) + 1)
    mask = np.zeros((h, w), dtype=bool)
    if c1 <= c0 or r1 <= r0:
        return mask
    r, rw = grid_taps(r0, r1, y0, y1, m)
    c, cw = grid_taps(c0, c1, x0, x1, m)
    r2, c2 = np.minimum(r + 1, m + 1), np.minimum(c + 1, m + 1)
    rw, cw = rw[:, None], cw[None, :]
    value = ((1 - rw) * ((1 - cw) * grid[r][:, c] + cw * grid[r][:, c2])
             + rw * ((1 - cw) * grid[r2][:, c] + cw * grid[r2][:, c2]))
    mask[r0:r1, c0:c1] = value > np.float32(threshold)
    return mask


@dataclass(frozen=True)
class Found:
    """A detector's detections on one image, best score first, before any score threshold: boxes
    [N, 4] XYXY in the image's pixels, scores [N], labels [N] (indices into the class names), and a
    mask model's bool masks [N, H, W] at the image's size (else None)."""

    boxes: np.ndarray
    scores: np.ndarray
    labels: np.ndarray
    masks: np.ndarray | None
    image_size: tuple[int, int]

    def above(self, threshold: float) -> "Found":
        keep = self.scores >= threshold
        return Found(self.boxes[keep], self.scores[keep], self.labels[keep],
                     None if self.masks is None else self.masks[keep], self.image_size)


def fuse(found: Found, semantic: np.ndarray, thing_ids: Sequence[int], stuff_ids: Sequence[int],
         fusion: dict[str, Any]) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """One image's panoptic segmentation, (segment ids int32 [H, W], COCO's segments_info), as
    visiontrain's ``models.panoptic.fuse_panoptic`` makes it (the metadata's ``fusion.rule``), so that
    the file gives the checkpoint's segments: ``found``'s instances (labels index ``thing_ids``, masks at
    the image's size) best score first while at least ``instance_score_thresh``, each skipped if more
    than ``overlap_thresh`` of its mask is taken, else its free pixels a new segment; then each stuff
    class k >= 1 of ``semantic`` (the argmax, 0 the things) on the free pixels, if at least
    ``stuff_area`` of them. Equal scores keep the outputs' order (the graph's NMS gives them best first),
    as ``fuse_panoptic``'s stable sort keeps them."""
    ids = np.zeros(semantic.shape, dtype=np.int32)
    segments: list[dict[str, Any]] = []
    scores = found.scores.tolist()  # Python floats: compared and rounded as fuse_panoptic's .tolist() gives them
    for i in np.argsort(-found.scores, kind="stable").tolist():
        if scores[i] < fusion["instance_score_thresh"]:
            break
        mask = found.masks[i]
        area = int(mask.sum())
        if area == 0 or int((mask & (ids > 0)).sum()) / area > fusion["overlap_thresh"]:
            continue
        mask = mask & (ids == 0)
        segments.append({"id": len(segments) + 1, "category_id": int(thing_ids[int(found.labels[i])]), "iscrowd": 0,
                         "isthing": 1, "score": round(scores[i], 4), "area": int(mask.sum())})
        ids[mask] = len(segments)
    for k in np.unique(semantic).tolist():
        if k == 0 or k > len(stuff_ids):  # the things' class: the instances decide those pixels
            continue
        mask = (semantic == k) & (ids == 0)
        area = int(mask.sum())
        if area >= fusion["stuff_area"]:
            segments.append({"id": len(segments) + 1, "category_id": int(stuff_ids[k - 1]), "iscrowd": 0,
                             "isthing": 0, "area": area})
            ids[mask] = len(segments)
    return ids, segments


class OnnxModel:
    """An ONNX file written by ``visiontrain export`` and what its metadata says about it."""

    def __init__(self, path: str | Path, device: str | None = None) -> None:
        import onnxruntime as ort  # here, not at the top: reading an image needs no runtime

        self.path = str(path)
        providers = providers_for(device, ort.get_available_providers())
        try:
            self.session = ort.InferenceSession(self.path, providers=providers)
        except Exception as err:  # onnxruntime raises its own Fail/InvalidProtobuf/NoSuchFile types
            raise OnnxRunnerError(f"{self.path}: onnxruntime cannot load it ({str(err).splitlines()[0]})") from None
        self.meta = read_metadata(self.session)
        self.task: str = str(self.meta.get("task", ""))
        known = CLASSIFIERS + DETECTORS + BACKBONES + SEGMENTERS + PANOPTIC
        if self.task not in known:
            raise OnnxRunnerError(f"{self.path}: its metadata names task {self.task or None!r}; this runner reads "
                                  f"files visiontrain export wrote for {', '.join(known)}")
        self.class_names: list[str] = [str(n) for n in self.meta.get("class_names") or []]
        self.category_ids: list[int] = list(self.meta.get("category_ids") or range(len(self.class_names)))

    @property
    def kind(self) -> str:
        """'classification', 'detection', 'segmentation' (a label map), 'panoptic' (segments), or
        'features' (a DINO backbone)."""
        return "classification" if self.task in CLASSIFIERS else "detection" if self.task in DETECTORS \
            else "segmentation" if self.task in SEGMENTERS else "panoptic" if self.task in PANOPTIC else "features"

    def categories(self) -> list[dict[str, Any]]:
        """A panoptic model's categories by id, things and stuff: ``{"id", "name", "isthing"}`` (the
        things from ``category_ids`` and ``class_names``, the stuff from ``stuff_category_ids`` and
        ``semantic_classes`` after its class 0), as COCO's panoptic JSON lists them."""
        things = [(int(i), name, 1) for i, name in zip(self.category_ids, self.class_names)]
        stuff = [(int(i), str(name), 0) for i, name in zip(self.meta.get("stuff_category_ids") or [],
                                                           (self.meta.get("semantic_classes") or [])[1:])]
        return [{"id": i, "name": name, "isthing": isthing} for i, name, isthing in sorted(things + stuff)]

    def run(self, image: Image.Image) -> tuple[list[np.ndarray], tuple[int, int], tuple[int, int]]:
        """The graph's outputs on ``image``, the size it was resized to and its own (h, w)."""
        orig = (image.height, image.width)
        x, size = prepare(image, self.meta)
        feeds = {self.session.get_inputs()[0].name: x}
        if self.task == "detr":  # the padding mask: True where x is padding
            mask = np.ones(x.shape[:1] + x.shape[2:], dtype=bool)
            mask[:, :size[0], :size[1]] = False
            feeds["mask"] = mask
        return self.session.run(None, feeds), size, orig

    def probabilities(self, image: Image.Image) -> np.ndarray:
        """A classifier's class probabilities [classes] on one image."""
        outputs, _, _ = self.run(image)
        return softmax(outputs[0][0])

    def features(self, image: Image.Image) -> np.ndarray:
        """A backbone's features [D] on one image."""
        outputs, _, _ = self.run(image)
        return outputs[0][0]

    def segment(self, image: Image.Image) -> np.ndarray:
        """A semantic model's label map, int64 [H, W] at the image's own size: the logits cut to the
        resized image, resized to the original (``resize_bilinear``), their argmax."""
        outputs, size, orig = self.run(image)
        return label_map(outputs[0][0], size, orig)

    def panoptic(self, image: Image.Image) -> tuple[np.ndarray, list[dict[str, Any]]]:
        """A panoptic model's segmentation of one image at its own size: (segment ids int32 [H, W], 0
        VOID; COCO's segments_info), as ``Predictor`` gives it: the Mask R-CNN's detections with their
        masks pasted into the original image, the semantic logits' argmax there (``label_map``), fused
        by the metadata's ``fusion`` (``fuse``)."""
        outputs, size, orig = self.run(image)
        found = self.decode(outputs[:4], size, orig)
        return fuse(found, label_map(outputs[4][0], size, orig), self.category_ids,
                    self.meta["stuff_category_ids"], self.meta["fusion"])

    def detect(self, image: Image.Image) -> Found:
        """A detector's detections on one image, best first, in the image's own pixels."""
        return self.decode(*self.run(image))

    def decode(self, outputs: Sequence[np.ndarray], size: tuple[int, int], orig: tuple[int, int]) -> Found:
        """The graph's outputs as detections, best first, in the original image's pixels (``orig``)."""
        masks = None
        if self.task in ("rcnn", *MASK_DETECTORS):  # NMS is in the graph; boxes are in the resized image's pixels
            boxes, labels, scores = outputs[:3]
            boxes = scale_to(boxes, size, orig)
            if self.task in MASK_DETECTORS:  # each box's M x M probabilities, pasted into the original image
                masks = np.stack([paste_mask(p[0], box, *orig, self.meta["mask_threshold"])
                                  for p, box in zip(outputs[3], boxes)]) if len(boxes) else \
                    np.zeros((0, *orig), dtype=bool)
        elif self.task == "yolo":
            boxes, scores, labels = decode_yolo(outputs, self.meta, size, orig)
        else:
            boxes, scores, labels = decode_detr(outputs, self.meta, orig)
        order = np.argsort(-scores, kind="stable")
        return Found(boxes[order], scores[order], labels[order].astype(np.int64),
                     None if masks is None else masks[order], orig)

    def predict(self, image: str | Path | Image.Image, threshold: float | None = None,
                top_k: int | None = None) -> dict[str, Any]:
        """JSON-ready results for one image (a path or a PIL image), as ``Predictor(...).to_dict()``
        gives them; a mask model's masks under ``"masks"`` (bool [N, H, W], the detections' order), a
        semantic model's label map under ``"labels"`` (int64 [H, W]), a panoptic model's segment ids
        under ``"ids"`` (int32 [H, W]). ``threshold`` and ``top_k`` do not apply to a segmenter: a panoptic
        model's instances are kept by its metadata's ``fusion.instance_score_thresh``, as the checkpoint's."""
        if not isinstance(image, Image.Image):
            image = read_image(image)
        if self.kind == "features":
            return {"features": self.features(image).tolist()}
        if self.kind == "panoptic":
            ids, segments = self.panoptic(image)
            names = {c["id"]: c["name"] for c in self.categories()}
            return {"image_size": list(ids.shape), "ids": ids,
                    "segments_info": [{**s, "category": names[s["category_id"]]} for s in segments]}
        if self.kind == "segmentation":
            labels = self.segment(image)
            counts = np.bincount(labels.ravel(), minlength=len(self.class_names))
            return {"image_size": list(labels.shape), "labels": labels,
                    "pixels": {self.class_names[k]: int(n) for k, n in enumerate(counts) if n}}
        if self.kind == "classification":
            probs = self.probabilities(image)
            best = np.argsort(-probs, kind="stable")[:top_k or min(DEFAULT_TOP_K, probs.size)]
            return {"top": [{"class_id": int(i), "name": self.class_names[i], "probability": float(probs[i])}
                            for i in best]}
        found = self.detect(image).above(self.meta["score_threshold"] if threshold is None else threshold)
        result: dict[str, Any] = {"image_size": list(found.image_size), "detections": [
            {"box": [round(float(v), 2) for v in box], "score": float(score), "class_id": int(label),
             "name": self.class_names[label], "category_id": self.category_ids[label]}
            for box, score, label in zip(found.boxes, found.scores, found.labels)]}
        if found.masks is not None:  # each one's pixel count in the JSON, the masks themselves beside it
            result["masks"] = found.masks
            for detection, mask in zip(result["detections"], found.masks):
                detection["mask_area"] = int(mask.sum())
        return result


def mask_files(images: Sequence[str], folder: Path) -> list[Path]:
    """Where each image's masks go: FOLDER/<image stem>.npy, ``-2``, ``-3``... for a stem seen before."""
    taken: set[str] = set()
    files = []
    for image in images:
        stem, name, n = Path(image).stem, Path(image).stem, 1
        while name.lower() in taken:
            n += 1
            name = f"{stem}-{n}"
        taken.add(name.lower())
        files.append(folder / f"{name}.npy")
    return files


def main(argv: Sequence[str] | None = None) -> int:
    """One JSON line per image, in the order given; --masks DIR: a mask model's masks (a segmenter's
    label map, a panoptic model's segment ids) as .npy files, never in the JSON."""
    parser = argparse.ArgumentParser(prog="onnx_runner", description=__doc__.splitlines()[0])
    parser.add_argument("model", help="an ONNX file visiontrain export wrote")
    parser.add_argument("images", nargs="+", help="image files")
    parser.add_argument("--threshold", type=float, help="detection: minimum score (default: the model's)")
    parser.add_argument("--top-k", type=int, help="classification: classes shown (default 5 or fewer)")
    parser.add_argument("--masks", help="segmentation: save each image's masks to DIR/<image stem>.npy (bool "
                                        "[N, H, W] in the printed order; a semantic model's label map, int64 [H, W]; "
                                        "a panoptic model's segment ids, int32 [H, W])")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: the GPU where onnxruntime has one)")
    args = parser.parse_args(argv)
    if args.top_k is not None and args.top_k < 1:
        parser.error(f"--top-k: must be >= 1, got {args.top_k}")
    try:
        model = OnnxModel(args.model, args.device)
        if args.masks and model.task not in (*MASK_DETECTORS, *SEGMENTERS):
            parser.error(f"--masks: {args.model} gives no masks (a mask_rcnn, semantic or panoptic model does)")
        for image, masks_file in zip(args.images, mask_files(args.images, Path(args.masks or "."))):
            result = model.predict(image, args.threshold, args.top_k)
            arrays = [result.pop(key) for key in ("masks", "labels", "ids") if key in result]  # not JSON
            if args.masks:
                masks_file.parent.mkdir(parents=True, exist_ok=True)
                np.save(masks_file, arrays[0])
                result["masks_file"] = str(masks_file)
            print(json.dumps({"file_name": image, **result}))
    except OnnxRunnerError as err:
        print(f"onnx_runner: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
