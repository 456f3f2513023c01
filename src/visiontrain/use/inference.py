"""Inference from Python: a trained checkpoint called on images, giving typed results.

    from visiontrain import Predictor

    predictor = Predictor.load("runs/fashion")     # a run dir (best.pt, else last.pt) or a checkpoint
    result = predictor("boot.png")                 # Classification: result.name, result.probability, result.top
    results = predictor([pil_image, array, tensor])  # a list: one result per image, in order

An image is a file path, a PIL image, a numpy uint8 array (H, W, 3) or a tensor [3, H, W] (uint8,
or float in [0, 1]); a list of those or a tensor batch [B, 3, H, W] gives a list. A classifier gives
its top-k classes with names, ids and probabilities; a detector its boxes (XYXY in the input
image's own pixels), scores, labels and class names, and an instance segmenter (``mask_rcnn``)
each detection's mask too (bool, at the input image's size); a semantic segmenter (``semantic``)
its label map: each pixel's class, at the input image's size; a panoptic segmenter (``panoptic``)
each pixel's segment id and the segments (COCO's ``segments_info``: category, thing or stuff, area).

The checkpoint is restored by ``trained.load_trained``, the path ``validate`` and ``export`` take,
and each image goes through the task's ``predict``, which prepares it with the validation set's own
transform (a classifier's ``data_info["preprocess"]``, a detector's validation resize), so the model
sees a user's image exactly as it saw the images it was scored on.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from visiontrain.data.detection.masks import segmentations
from visiontrain.data.images import image_tensor
from visiontrain.engine.protocols.task import Prediction, PredictUnsupported, Task
from visiontrain.use.trained import load_trained

DEFAULT_TOP_K = 5
DETECTION_BATCH = 1  # a detector's batch pads its images to one size: one at a time sees each as it is
CLASSIFICATION_BATCH = 64


@dataclass(frozen=True)
class ClassScore:
    class_id: int       # index into the predictor's class_names (the model's output column)
    name: str
    probability: float


@dataclass(frozen=True)
class Classification:
    top: list[ClassScore]           # the k most probable classes, most probable first
    probabilities: torch.Tensor     # [classes]: every class's probability (they sum to 1)

    @property
    def class_id(self) -> int:
        return self.top[0].class_id

    @property
    def name(self) -> str:
        return self.top[0].name

    @property
    def probability(self) -> float:
        return self.top[0].probability

    def to_dict(self) -> dict[str, Any]:
        return {"top": [{"class_id": c.class_id, "name": c.name, "probability": c.probability} for c in self.top]}


@dataclass(frozen=True)
class Detections:
    boxes: torch.Tensor             # [N, 4] XYXY in the input image's own pixels, best score first
    scores: torch.Tensor            # [N]
    labels: torch.Tensor            # [N] class ids: indices into the predictor's class_names
    names: list[str]                # [N] class names
    category_ids: list[int]         # [N] the dataset's category ids (COCO's, for a COCO dataset)
    image_size: tuple[int, int]     # (height, width) of the input image
    masks: torch.Tensor | None = None  # [N, H, W] bool at image_size, one a box (instance segmentation); else None

    def __len__(self) -> int:
        return len(self.scores)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: each detection's box, score and class, and with masks its ``segmentation``
        as COCO's compressed RLE (``{"size": [h, w], "counts": str}``, pycocotools decodes it)."""
        detections = [
            {"box": [round(v, 2) for v in box], "score": score, "class_id": label, "name": name, "category_id": cat}
            for box, score, label, name, cat in zip(self.boxes.tolist(), self.scores.tolist(), self.labels.tolist(),
                                                    self.names, self.category_ids)]
        for detection, segmentation in zip(detections, self.segmentations()):
            detection["segmentation"] = segmentation
        return {"image_size": list(self.image_size), "detections": detections}

    def segmentations(self) -> list[dict[str, Any]]:
        """Each mask as COCO's compressed RLE, the ``segmentation`` of a COCO result; [] without masks."""
        return [] if self.masks is None else segmentations(self.masks.cpu().numpy())


@dataclass(frozen=True)
class Segmentation:
    labels: torch.Tensor            # [H, W] int64: each pixel's class id, an index into class_names
    class_names: list[str]          # every class of the model, by id

    @property
    def image_size(self) -> tuple[int, int]:
        return int(self.labels.shape[-2]), int(self.labels.shape[-1])

    def pixels(self) -> dict[str, int]:
        """Pixels of each class present in the map, by class name, in class order."""
        counts = torch.bincount(self.labels.flatten(), minlength=len(self.class_names))
        return {self.class_names[k]: int(n) for k, n in enumerate(counts.tolist()) if n}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the image's size and each present class's pixel count (the map itself is an
        image: ``visiontrain predict`` writes it as a PNG)."""
        return {"image_size": list(self.image_size), "pixels": self.pixels()}


@dataclass
class PanopticSegmentation:
    """One image's panoptic segmentation: every pixel a segment (a thing instance or a stuff region)
    or none, in COCO's panoptic form."""
    ids: torch.Tensor               # [H, W] int32: each pixel's segment id, 0 where none (VOID)
    segments: list[dict[str, Any]]  # COCO segments_info: id, category_id, isthing, area (things: score)
    category_names: dict[int, str]  # category id -> name, things and stuff

    @property
    def image_size(self) -> tuple[int, int]:
        return int(self.ids.shape[-2]), int(self.ids.shape[-1])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the image's size and each segment with its category's name (the id map itself is
        an image: ``visiontrain predict`` writes it as COCO's panoptic PNG)."""
        return {"image_size": list(self.image_size),
                "segments_info": [{**s, "category": self.category_names[s["category_id"]]} for s in self.segments]}


def _device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def check_predicts(task: Task, checkpoint: str = "") -> None:
    """A task that predicts nothing on images (DINO) is refused with what to use instead."""
    if task.predicts is Prediction.NONE:
        where = f"{checkpoint}: " if checkpoint else ""
        raise PredictUnsupported(f"{where}task {task.name!r} makes no predictions on images; predict works for "
                                 f"classification, detection and segmentation checkpoints (a DINO backbone's features: "
                                 f"visiontrain export)")


def check_prediction_options(prediction: Prediction, what: str, top_k: int | None, threshold: float | None) -> None:
    """``top_k`` is a classifier's option and ``threshold`` a detector's (a segmenter takes neither);
    a ValueError saying so names ``what`` (the checkpoint) and the option that fits it."""
    if prediction in (Prediction.LABEL_MAP, Prediction.PANOPTIC) and (top_k is not None or threshold is not None):
        kind = "semantic segmenter (each pixel's most probable class)" if prediction is Prediction.LABEL_MAP else \
            "panoptic segmenter (its instances' score threshold is the model's task.instance_score_thresh)"
        raise ValueError(f"top_k and threshold apply to classification and detection; {what} is a {kind}")
    detection = prediction is Prediction.BOXES
    if detection and top_k is not None:
        raise ValueError(f"top_k applies to classification; {what} is a detector (use threshold)")
    if not detection and threshold is not None:
        raise ValueError(f"threshold applies to detection; {what} is a classifier (use top_k)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k: must be >= 1, got {top_k}")


def top_classes(probabilities: torch.Tensor, class_names: list[str], top_k: int | None) -> Classification:
    """The ``top_k`` most probable classes (default 5, or the class count if lower), most probable first."""
    values, ids = probabilities.topk(min(top_k or DEFAULT_TOP_K, probabilities.numel()))
    top = [ClassScore(i, class_names[i], p) for i, p in zip(ids.tolist(), values.tolist())]
    return Classification(top, probabilities)


class Predictor:
    """A trained model and its task, callable on images. ``Predictor.load`` restores a checkpoint;
    the constructor takes a task, a model and its ``data_info`` already built (tests, notebooks)."""

    def __init__(self, task: Task, model: nn.Module, info: dict[str, Any], *,
                 device: str | torch.device | None = None, checkpoint: str = "") -> None:
        check_predicts(task, checkpoint)
        self.task, self.info, self.checkpoint = task, info, checkpoint
        self.device = _device(device)
        self.model = model.to(self.device).eval()
        self.class_names: list[str] = [str(n) for n in info.get("class_names") or range(info["num_classes"])]
        self.channels: int = int(info.get("in_channels", 3))

    @classmethod
    def load(cls, target: str | Path, *, ema: bool = False, device: str | torch.device | None = None,
             overrides: Sequence[str] = ()) -> "Predictor":
        """``target``: a checkpoint, or a run dir (its best.pt, else last.pt). ``ema``: the EMA's
        weights. ``device``: where the model runs (default: the GPU if there is one). ``overrides``:
        ``key=value`` over the saved config (e.g. ``data.root=...``)."""
        trained = load_trained(target, overrides)
        check_predicts(trained.task, trained.path)  # before the model is built
        return cls(trained.task, trained.model(ema=ema), trained.info, device=device, checkpoint=trained.path)

    @property
    def prediction(self) -> Prediction:
        """What the task predicts, as it declares it (``Task.predicts``): boxes or class scores."""
        return self.task.predicts

    @property
    def task_name(self) -> str:
        return self.task.name

    @property
    def kind(self) -> str:
        """'detection' for a detector (boxes), 'classification' for a classifier (class probabilities),
        'segmentation' for a semantic segmenter (a label map), 'panoptic' for a panoptic one (segments)."""
        return self.prediction.value

    def read(self, image: Any, what: str = "image") -> torch.Tensor:
        """``image`` as the task's ``predict`` takes it: [C, H, W] with the model's channels, uint8
        or float in [0, 1] (what :func:`visiontrain.data.images.image_tensor` accepts)."""
        return image_tensor(image, self.channels, what)

    def __call__(self, images: Any, *, top_k: int | None = None, threshold: float | None = None,
                 batch_size: int | None = None) -> Any:
        """Results for one image (one result) or for a list / a tensor batch [B, C, H, W] (a list).
        ``top_k`` (classification): classes kept, default 5 or the class count if lower.
        ``threshold`` (detection): minimum score, default the task's (``predict_threshold``).
        ``batch_size``: images per forward pass (detection and segmentation default 1, classification 64):
        a semantic segmenter's result is a ``Segmentation`` (label map at the input's size), a panoptic
        one's a ``PanopticSegmentation``."""
        check_prediction_options(self.prediction, self._what(), top_k, threshold)
        padded = self.prediction is not Prediction.CLASS_SCORES  # images of their own sizes
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        single = not isinstance(images, (list, tuple)) and not (isinstance(images, torch.Tensor) and images.ndim == 4)
        items = [images] if single else list(images)
        step = batch_size or (DETECTION_BATCH if padded else CLASSIFICATION_BATCH)
        results = []
        for start in range(0, len(items), step):  # read a batch at a time: a long list is not held decoded
            chunk = [self.read(img, "image" if single else f"image {start + i}")
                     for i, img in enumerate(items[start:start + step])]
            preds = self.task.predict(self.model, chunk, self.device)
            results += [self._result(p, img, top_k, threshold) for p, img in zip(preds, chunk)]
        return results[0] if single else results

    def _what(self) -> str:
        return self.checkpoint or f"task {self.task.name!r}"

    def _result(self, pred: dict[str, torch.Tensor], image: torch.Tensor, top_k: int | None,
                threshold: float | None) -> Classification | Detections | Segmentation | PanopticSegmentation:
        """One image's result, of the kind the task declares it predicts."""
        if self.prediction is Prediction.BOXES:
            return self._detections(pred, image, threshold)
        if self.prediction is Prediction.LABEL_MAP:
            return Segmentation(pred["labels"], self.class_names)
        if self.prediction is Prediction.PANOPTIC:
            names = {int(c["id"]): str(c.get("name", c["id"])) for c in self.info["categories"]}
            return PanopticSegmentation(pred["ids"], pred["segments"], names)
        return top_classes(pred["probabilities"], self.class_names, top_k)

    def _detections(self, pred: dict[str, torch.Tensor], image: torch.Tensor, threshold: float | None) -> Detections:
        minimum = self.task.predict_threshold if threshold is None else threshold
        order = pred["scores"].argsort(descending=True, stable=True)
        order = order[pred["scores"][order] >= minimum]
        boxes, scores, labels = pred["boxes"][order], pred["scores"][order], pred["labels"][order]
        masks = pred["masks"][order] if "masks" in pred else None  # the same order and threshold as the boxes
        ids = self.info.get("category_ids") or list(range(len(self.class_names)))
        return Detections(boxes, scores, labels, [self.class_names[i] for i in labels.tolist()],
                          [int(ids[i]) for i in labels.tolist()], (int(image.shape[-2]), int(image.shape[-1])),
                          masks)
