"""Semantic segmentation: each pixel's class, MMSeg style.

- the data: label maps (``data/segmentation/``) from a segmentation folder, Pascal VOC's
  ``SegmentationClass`` or fashion-mosaic (painted from its instance masks: class 0 background,
  the garments 1..10), moved as ``tv_tensors.Mask`` through a random resize, a random crop (the
  labels padded with the ignore index) and a flip;
- the network: torchvision's DeepLabV3 or FCN head, DeepLabV3+ (torchvision's ASPP and a decoder
  on the first stage) or semantic FPN (torchvision's FeaturePyramidNetwork fused at stride 4), on a
  ResNet of any depth, at output stride 8, 16 or 32, with torchvision's auxiliary FCN head on the
  third stage (``models/segmentation.py``);
- the loss: cross-entropy over the labelled pixels (the ignore index left out), with optional class
  weights; ``aux``, the same on the auxiliary head, weighted by ``task.loss_weights.aux`` (0.4, as
  torchvision's and MMSeg's references);
- the evaluation: one ``[true, predicted]`` pixel count matrix over the split, accumulated on the
  device from the logits brought back to each label map's own size, and MMSeg's ``IoUMetric`` read
  from it (``evaluation/segmentation.py``): mIoU, mAcc, aAcc and IoU / Acc per class;
- the figures: ``val_segmentation`` (the first validation images' ground truth beside the
  prediction) and the pixels' ``confusion_matrix``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from visiontrain.core.config import doc
from visiontrain.data.normalize import IMAGENET_MEAN, IMAGENET_STD, NormalizeOnDevice
from visiontrain.data.segmentation.readers import build_semantic_splits
from visiontrain.data.segmentation.sources import ignore_index, semantic_source
from visiontrain.engine.protocols.task import (DictOutputs, ExportSpec, Prediction, Task, TaskConfig, TaskData,
                                               register_task)
from visiontrain.engine.step.eval_loop import EvalData
from visiontrain.evaluation.figures import confusion_figure
from visiontrain.evaluation.previews import Tile, display_pixels, grid, tiles_image
from visiontrain.evaluation.segmentation import (accumulate_pixels, background_classes, painted_classes,
                                                  segmentation_figure, semantic_scores)
from visiontrain.rundir.metrics_file import PER_CLASS

SHOWN_IMAGES = 4  # the validation images drawn in val_segmentation.png after each evaluation
PREVIEW_IMAGES = 16  # images of the first training batch drawn in train_batch.png


@dataclass
class SemanticConfig(TaskConfig):
    unread_data_keys: ClassVar[dict[str, str]] = {
        "image_size": "its input sizes are task.train_sizes, task.crop and task.val_size",
        "augment": "its augmentation is a random resize (task.train_sizes), crop (task.crop) and flip",
        "download": "segmentation datasets are read from data.root (or built in: fashion-mosaic)"}
    name: str = doc("task name", "semantic")
    backbone: str = doc("resnet18 | resnet34 | resnet50 | resnet101", "resnet50")
    pretrained_backbone: bool = doc("ImageNet weights for the backbone (must be cached locally)", False)
    head: str = doc("deeplabv3 (torchvision's ASPP head) | deeplabv3plus (the ASPP and DeepLabV3+'s decoder on the "
                    "first stage, stride 4) | fcn (torchvision's) | fpn (semantic FPN over the four stages, usually "
                    "with task.output_stride=32)", "deeplabv3")
    output_stride: int = doc("input size / feature map size: 8, 16 (the last stages dilated) or 32", 8)
    atrous_rates: list[int] = doc("deeplabv3: the ASPP's dilation rates (torchvision's 12, 24, 36 suit stride 8 on "
                                  "500 px images; smaller feature maps want smaller rates)",
                                  factory=lambda: [12, 24, 36])
    fpn_channels: int = doc("fpn: the pyramid's channels (MMSeg's and Detectron2's 256)", 256, minimum=8)
    head_width: int = doc("fpn: the fusion's channels, each level's 3 x 3 convolutions (MMSeg's 128)", 128, minimum=8)
    aux_head: bool = doc("torchvision's auxiliary FCN head on the third stage: loss term aux "
                         "(task.loss_weights.aux, default 0.4); training only", False)
    class_weights: list[float] = doc("cross-entropy weight of each class, in the classes' order; empty: all 1",
                                     factory=list)
    train_sizes: list[int] = doc("training: [low, high] the shorter side is resized to, drawn each image",
                                 factory=lambda: [256, 512])
    crop: int = doc("training: the square crop's side in px (padded with the ignore index where the image is smaller)",
                    256, minimum=32)
    cat_max_ratio: float = doc("training: MMSeg's cat_max_ratio: a crop in which one class covers this share or "
                               "more of the labelled pixels is drawn again, up to 10 times (1 or more: any crop)",
                               1.0, minimum=0)
    val_flip: bool = doc("evaluation, predict and export: the logits averaged with those of the mirrored image "
                         "(MMSeg's flip test-time augmentation; twice the evaluation's compute)", False)
    val_size: int = doc("evaluation and predict: the image's shorter side (0: as it is); metrics are counted at the "
                        "label map's own size", 0, minimum=0)


def labelled_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore: int,
                           weight: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy averaged over the labelled pixels (by their class weights where given); a
    batch with no labelled pixel gives 0, not torch's 0 / 0. ``logits`` may be larger than
    ``labels`` (a crop padded to a multiple of 32): they are cut to the labels' size."""
    logits = logits[..., :labels.shape[-2], :labels.shape[-1]].float()
    total = F.cross_entropy(logits, labels, weight=weight, ignore_index=ignore, reduction="sum")
    labelled = labels != ignore
    counted = labelled.sum() if weight is None else (weight[labels.where(labelled, 0)] * labelled).sum()
    return total / counted.clamp_min(1)


class SemanticTask(Task):
    name = "semantic"
    predicts = Prediction.LABEL_MAP
    default_loss_weights = {"ce": 1.0, "aux": 0.4}
    metric, mode = "mIoU", "max"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        semantic_source(self.cfg.data)
        self.ignore = ignore_index(self.cfg.data)
        self.confusion: torch.Tensor | None = None  # the last evaluation's pixel counts [true, predicted]
        self.shown: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # ... and its first images
        self._weights: dict[torch.device, torch.Tensor] = {}
        if len(self.cfg.task.train_sizes) != 2:
            raise ValueError(f"task.train_sizes: give [low, high], got {self.cfg.task.train_sizes}")

    def build_data(self) -> TaskData:
        from visiontrain.data.segmentation.transforms import PrepareImage, collate_label_maps, train_transform

        t, d = self.cfg.task, self.cfg.data
        train, val = build_semantic_splits(d)
        if train.class_names != val.class_names:
            raise ValueError(f"{d.name}: the classes of split {d.val_split!r} differ from those of {d.train_split!r}")
        self.info = {"num_classes": train.num_classes, "class_names": list(train.class_names)}
        collate = functools.partial(collate_label_maps, ignore=self.ignore)
        train_tf = train_transform(t.train_sizes, t.crop, self.ignore, d.normalize_on_device, t.cat_max_ratio)
        return TaskData(train.with_transform(train_tf), val.with_transform(PrepareImage(t.val_size)), self.info,
                        random_transforms=True, train_collate=collate, eval_collate=collate)

    def build_model(self, info: dict[str, Any]) -> nn.Module:
        from visiontrain.models.segmentation import SegmenterSpec, build_segmenter

        self.info = info
        t = self.cfg.task
        if t.class_weights and len(t.class_weights) != info["num_classes"]:
            raise ValueError(f"task.class_weights: {len(t.class_weights)} weights for {info['num_classes']} classes")
        spec = SegmenterSpec(**{f.name: getattr(t, f.name) for f in fields(SegmenterSpec)})
        return build_segmenter(spec, info["num_classes"])

    def device_transform(self, *, channels_last: bool) -> Callable[[Any], Any] | None:
        if not self.cfg.data.normalize_on_device:
            return None

        normalize = NormalizeOnDevice()
        return lambda batch: (normalize(batch[0]), *batch[1:])

    def pixel_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``labelled_cross_entropy`` with the task's class weights, where given."""
        weight = None
        if self.cfg.task.class_weights:
            weight = self._weights.get(labels.device)
            if weight is None:  # once a device: no copy each step
                weight = self._weights[labels.device] = torch.tensor(self.cfg.task.class_weights,
                                                                     device=labels.device)
        return labelled_cross_entropy(logits, labels, self.ignore, weight)

    def losses(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        images, labels, _ = batch
        out = model(images)
        losses = {"ce": self.pixel_loss(out["out"], labels)}
        if "aux" in out:
            losses["aux"] = self.pixel_loss(out["aux"], labels)
        return losses

    def logits(self, model: nn.Module, images: torch.Tensor) -> torch.Tensor:
        """The network's logits [B, classes, H, W] in float32, as evaluation, predict and the export
        read them (``FlipAveraged`` under ``task.val_flip``)."""
        from visiontrain.models.segmentation import FlipAveraged

        return (FlipAveraged(model) if self.cfg.task.val_flip else model)(images)["out"].float()

    @staticmethod
    def label_maps(logits: torch.Tensor, sizes: list[tuple[int, int, int, int]]) -> list[torch.Tensor]:
        """Each image's classes [H, W] at its label map's size: its logits cut to its prepared size
        (h, w), brought back to (H, W) bilinearly, then the argmax (MMSeg's order)."""
        return [F.interpolate(logits[i:i + 1, :, :h, :w], size=(oh, ow), mode="bilinear",
                              align_corners=False).argmax(1)[0] for i, (h, w, oh, ow) in enumerate(sizes)]

    def evaluate(self, model: nn.Module, data: EvalData) -> dict[str, Any]:
        """mIoU, mAcc, aAcc and IoU / Acc per class from the split's pixel counts (``semantic_scores``)."""
        c = self.info["num_classes"]
        counts = torch.zeros(c * c + 1, dtype=torch.int64, device=data.device)
        shown = []
        for (images, labels, sizes), real in data:
            sizes = sizes[real]
            predicted = self.label_maps(self.logits(model, images), sizes)
            for i, (h, w, oh, ow) in enumerate(sizes):
                accumulate_pixels(counts, labels[i, :oh, :ow], predicted[i], self.ignore)
                if len(shown) < SHOWN_IMAGES:
                    shown.append((images[i, :, :h, :w], labels[i, :oh, :ow], predicted[i]))
        data.sum_(counts)
        self.confusion = counts[:-1].view(c, c).cpu()  # host sync (end of evaluation)
        self.shown = [self.shown_image(*item) for item in shown]  # host sync (end of evaluation, a few images)
        metrics, per_class = semantic_scores(self.confusion, self.info["class_names"])
        return {**metrics, PER_CLASS: per_class}

    @staticmethod
    def shown_image(image: torch.Tensor, truth: torch.Tensor, predicted: torch.Tensor
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One drawn image: its pixels at its label map's size, in [0, 1], and both label maps."""
        pixels = F.interpolate(image[None].float(), size=tuple(truth.shape), mode="bilinear", align_corners=False)[0]
        return display_pixels(pixels, IMAGENET_MEAN, IMAGENET_STD), truth.cpu().numpy(), predicted.cpu().numpy()

    def unpainted(self) -> list[int]:
        """The classes the figures leave unpainted, so that the image shows: those named background."""
        return background_classes(self.info["class_names"])

    def preview_figures(self, batch: Any) -> dict[str, Any]:
        """The first training batch as the model receives it, each crop's label map painted over it
        (the ignore index, e.g. a crop's padding, unpainted)."""
        images, labels, _ = batch
        n = min(PREVIEW_IMAGES, len(images))
        tiles = [Tile(painted_classes(display_pixels(images[i], IMAGENET_MEAN, IMAGENET_STD), labels[i].numpy(),
                                      self.unpainted())) for i in range(n)]
        title = f"first training batch as the model receives it ({n} of {len(images)} crops), classes painted"
        return {"train_batch": tiles_image(grid(tiles, 4), title=title, class_names=self.info["class_names"])}

    def eval_figures(self) -> dict[str, Any]:
        """``val_segmentation`` (ground truth beside prediction) and the pixels' confusion matrix."""
        if self.confusion is None:
            return {}
        names = self.info["class_names"]
        pixels = int(self.confusion.sum())
        return {"val_segmentation": segmentation_figure(self.shown, names, unpainted=self.unpainted()),
                "confusion_matrix": confusion_figure(self.confusion, names, title=f"confusion matrix of "
                                                     f"{pixels:,} labelled pixels (rows: true class)")}

    @torch.no_grad()
    def predict(self, model: nn.Module, images: list[torch.Tensor], device: torch.device
                ) -> list[dict[str, torch.Tensor]]:
        """Each raw image's classes [H, W] (int64) at its own size, prepared as evaluation prepares
        a validation image and read back as evaluation reads it (``label_maps``)."""
        from torchvision import tv_tensors

        from visiontrain.data.segmentation.transforms import PrepareImage, collate_label_maps

        prepare = PrepareImage(self.cfg.task.val_size)
        samples = [prepare(tv_tensors.Image(img), torch.zeros(img.shape[-2:], dtype=torch.uint8)) for img in images]
        batch, _, sizes = collate_label_maps(samples, self.ignore)
        predicted = self.label_maps(self.logits(model.eval(), batch.to(device)), sizes)
        return [{"labels": p.cpu()} for p in predicted]  # host sync (prediction output)

    def export_spec(self, model: nn.Module, info: dict[str, Any]) -> ExportSpec:
        """The network on prepared images (shorter side ``task.val_size``, ImageNet-normalised, padded
        to a multiple of 32 as ``predict`` pads them) of any height and width, giving the logits at
        the input's size; checked on a second aspect ratio. The metadata says how the label map
        follows, as ``predict`` makes it: the logits cut to the image, resized to the original, argmax."""
        from visiontrain.models.segmentation import FlipAveraged

        side = -(-(self.cfg.task.val_size or self.cfg.task.crop) // 32) * 32  # padded, as predict pads
        seed = torch.Generator().manual_seed(0)
        example = torch.randn(1, 3, side, side, generator=seed)
        wide = torch.randn(1, 3, side, side * 3 // 2 + 32, generator=seed)
        n = info["num_classes"]
        resize = {"mode": "shorter_side", "shorter_side": self.cfg.task.val_size} if self.cfg.task.val_size else \
            {"mode": "none"}
        metadata = {"class_names": list(info.get("class_names") or map(str, range(n))), "category_ids": list(range(n)),
                    "input_layout": "NCHW", "input_channels": 3, "color": "RGB", "scale": 1 / 255,
                    "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD), "resize": resize,
                    "input_size": {"height": "dynamic", "width": "dynamic"}, "pad": {"multiple": 32, "value": 0},
                    "output": "logits [B, classes, H, W] at the padded input's size: cut them to the resized "
                              "image's height and width, resize them bilinearly (half-pixel centres, "
                              "align_corners=false) to the original image's size; the argmax over classes is then "
                              "each pixel's class id, an index into class_names"}
        axes = {"image": {2: "height", 3: "width"}, "logits": {2: "height", 3: "width"}}
        if self.cfg.task.val_flip:
            metadata["output"] += "; the logits are already averaged with the mirrored image's (task.val_flip)"
        network = FlipAveraged(model) if self.cfg.task.val_flip else model
        return ExportSpec(DictOutputs(network, ["out"]).eval(), (example,), ["image"], ["logits"], dynamic_axes=axes,
                          check_inputs=[(wide,)], metadata=metadata)


register_task("semantic", SemanticTask, SemanticConfig)
