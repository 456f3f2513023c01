"""An exported ONNX file behind the Python API's face, so that ``visiontrain predict MODEL.onnx``
writes what it writes for a checkpoint (drawings, detections.json, predictions.json, the sheet, label maps,
panoptic PNGs and panoptic.json) from the same code, with the numbers computed by ``onnx_runner``
(onnxruntime and numpy).

The image is read by the rule the datasets and ``Predictor`` use (``data.images.image_tensor``) and
handed to the runner as 8-bit pixels, so a file gives the runner the pixels ``Predictor`` sees."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from visiontrain.data.images import image_tensor
from visiontrain.engine.protocols.task import Prediction
from visiontrain.use.inference import (Detections, PanopticSegmentation, Segmentation, check_prediction_options,
                                       top_classes)
from visiontrain.use.onnx_runner import OnnxModel

_PREDICTS = {"classification": Prediction.CLASS_SCORES, "detection": Prediction.BOXES,
             "segmentation": Prediction.LABEL_MAP, "panoptic": Prediction.PANOPTIC, "features": Prediction.NONE}


class OnnxPredictor:
    """``Predictor``'s calls (``read``, ``__call__``, ``prediction``, ``info``) on an ONNX file."""

    def __init__(self, path: str | Path, *, device: str | None = None) -> None:
        self.model = OnnxModel(path, device)
        self.checkpoint = str(path)
        self.task_name = self.model.task
        self.class_names = self.model.class_names
        self.info: dict[str, Any] = {"class_names": self.class_names, "category_ids": self.model.category_ids}
        if self.model.kind == "panoptic":  # what predict's panoptic.json lists, and each segment's name
            self.info["categories"] = self.model.categories()
        self.channels = int(self.model.meta.get("input_channels", 3))

    @property
    def prediction(self) -> Prediction:
        return _PREDICTS[self.model.kind]

    @property
    def kind(self) -> str:
        return self.prediction.value

    def read(self, image: Any, what: str = "image") -> torch.Tensor:
        """``image`` as ``Predictor.read`` reads it: uint8 [C, H, W] with the model's channels."""
        return image_tensor(image, self.channels, what)

    def __call__(self, images: Any, *, top_k: int | None = None, threshold: float | None = None) -> Any:
        """Results for one image (one result) or for a list (a list), as ``Predictor``'s."""
        check_prediction_options(self.prediction, self.checkpoint, top_k, threshold)
        single = not isinstance(images, (list, tuple))
        results = [self._one(self.read(image), top_k, threshold) for image in ([images] if single else images)]
        return results[0] if single else results

    def _one(self, pixels: torch.Tensor, top_k: int | None, threshold: float | None) -> Any:
        array = pixels.permute(1, 2, 0).numpy()
        image = Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array)
        if self.prediction is Prediction.CLASS_SCORES:
            return top_classes(torch.from_numpy(self.model.probabilities(image)), self.class_names, top_k)
        if self.prediction is Prediction.LABEL_MAP:
            return Segmentation(torch.from_numpy(self.model.segment(image)), self.class_names)
        if self.prediction is Prediction.PANOPTIC:
            ids, segments = self.model.panoptic(image)
            names = {int(c["id"]): str(c["name"]) for c in self.info["categories"]}
            return PanopticSegmentation(torch.from_numpy(ids), segments, names)
        found = self.model.detect(image).above(self.model.meta["score_threshold"] if threshold is None else threshold)
        labels = found.labels.tolist()
        return Detections(torch.from_numpy(np.ascontiguousarray(found.boxes, dtype=np.float32)),
                          torch.from_numpy(found.scores.astype(np.float32)), torch.from_numpy(found.labels),
                          [self.class_names[i] for i in labels], [int(self.model.category_ids[i]) for i in labels],
                          found.image_size, None if found.masks is None else torch.from_numpy(found.masks))
