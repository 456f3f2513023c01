"""What every detection task shares: the ``task.*`` keys every detector reads (DetectionConfig),
data (readers, transforms, grouped batches, padded collate), COCO evaluation with detections
gathered from every rank (per class too, with PR curves and a confusion matrix drawn from it), and
prediction on image files."""
from __future__ import annotations

import abc
import logging
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from visiontrain.core.config import doc
from visiontrain.data.bad_data import listed
from visiontrain.data.detection.masks import decode, segmentations
from visiontrain.data.detection.sources import detection_source
from visiontrain.data.normalize import IMAGENET_MEAN, IMAGENET_STD, NormalizeOnDevice
from visiontrain.data.section import ImageFileKeys
from visiontrain.engine.protocols.task import Prediction, Task, TaskConfig, TaskData
from visiontrain.engine.step.eval_loop import EvalData
from visiontrain.evaluation.coco import coco_api, coco_evaluation, to_coco_results
from visiontrain.evaluation.confusion import BACKGROUND, CONFUSION_IOU, CONFUSION_SCORE, detection_confusion
from visiontrain.evaluation.figures import ShownImage, confusion_figure, detections_figure, pr_curves_figure
from visiontrain.evaluation.previews import Tile, boxes_caption, display_pixels, grid, labels_figure, tiles_image
from visiontrain.rundir.metrics_file import PER_CLASS

log = logging.getLogger("visiontrain")


SHOWN_IMAGES, SHOWN_SCORE, SHOWN_MAX_BOXES = 8, 0.3, 20  # the validation images drawn after each evaluation
PREVIEW_IMAGES = 16  # images of the first training batch drawn in train_batch.png


def unread_data_keys(sizes: str, augmentation: str) -> dict[str, str]:
    """The classification ``data.*`` keys a detector ignores, each with what this detector reads."""
    return {"image_size": f"its input sizes are {sizes}", "augment": f"its augmentation is {augmentation}",
            "download": "detection datasets are read from data.root (or built in: fashion-mosaic, neon-trees)"}


@dataclass
class DetectionConfig(TaskConfig):
    """The ``task.*`` keys every detector reads, declared once so that DetectionTask reads them typed;
    a detector's config overrides a key where its default or its documentation differ (the backbones
    it builds, YOLO's square ``val_size``)."""
    backbone: str = doc("backbone network by name (each detector's own key lists those it builds)", "resnet50")
    pretrained_backbone: bool = doc("ImageNet weights for the backbone (must be cached locally)", False)
    val_size: int = doc("evaluation: shorter side", 800)
    group_aspect: bool = doc("batch images of like aspect ratio together", True)


@dataclass
class KeptEvaluation:
    """What the figures need from the last evaluation (see ``DetectionTask.score``)."""
    recall: np.ndarray                    # [R] COCO's recall thresholds
    curves: dict[str, np.ndarray]         # class name -> precision [R] at IoU 0.5 (classes with gt)
    ap50: dict[str, float]                # class name -> AP50
    confusion: np.ndarray                 # [C + 1, C + 1] (evaluation.confusion.detection_confusion)


def predictions_and_truths(records: list[Any], detections: list[dict], category_ids: list[int]
                           ) -> tuple[list[dict], list[dict]]:
    """COCO-format results and the dataset's records as per-image arrays in the records' order:
    predictions ``{boxes XYXY, scores, labels}`` (contiguous labels) and ground truth ``{boxes,
    labels, difficult}`` (COCO's crowd regions count as difficult: matched, never missed), the inputs
    of ``voc_map`` and ``detection_confusion``."""
    label_of = {c: i for i, c in enumerate(category_ids)}
    per_image: dict[int, list[dict]] = {}
    for d in detections:
        per_image.setdefault(d["image_id"], []).append(d)
    preds, gts = [], []
    for r in records:
        dets = per_image.get(r.image_id, [])
        xywh = np.array([d["bbox"] for d in dets], dtype=np.float64).reshape(-1, 4)
        preds.append({"boxes": np.concatenate([xywh[:, :2], xywh[:, :2] + xywh[:, 2:]], 1),
                      "scores": np.array([d["score"] for d in dets], dtype=np.float64),
                      "labels": np.array([label_of[d["category_id"]] for d in dets], dtype=np.int64)})
        ignored = r.difficult if r.crowd is None else r.crowd | (False if r.difficult is None else r.difficult)
        gts.append({"boxes": r.boxes, "labels": r.labels, "difficult": ignored})  # crowd: ignored as difficult
    return preds, gts


class DetectionTask(Task):
    """A detector: ``transforms`` and ``predict_batch`` are the family-specific parts."""

    predicts = Prediction.BOXES
    shown_detections: list[dict] | None = None  # the last evaluation's detections on the drawn images
    kept: KeptEvaluation | None = None  # the last evaluation's PR curves and confusion matrix
    predict_threshold: float = 0.5  # `visiontrain predict`'s default minimum score
    reads_masks: bool = False  # instance segmentation: the readers read each object's mask (data/detection/masks.py)

    @abc.abstractmethod
    def transforms(self) -> tuple[Any, Any]:
        """(train, val) v2 transforms on (image, target) samples."""

    @abc.abstractmethod
    def predict_batch(self, model: nn.Module, images: torch.Tensor, mask: torch.Tensor,
                      orig_sizes: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """Per image: boxes (absolute XYXY in the original image), scores, labels (contiguous)."""

    def build_data(self) -> TaskData:
        from visiontrain.data.detection.splits import build_detection_splits
        from visiontrain.data.detection.transforms import collate_detection

        coco_api(self.cfg.eval.coco_backend)  # its package importable, before any training
        d = self.cfg.data
        train, val = build_detection_splits(detection_source(d), masks=self.reads_masks)
        for split, ds in (("train", train), ("val", val)):
            if ds.policy.skipped:
                # the key that skipped them: under on_bad_annotation=error only image files can have been
                key = "on_bad_annotation" if d.on_bad_annotation == "skip" else "on_bad_image"
                files = ds.policy.unreadable if ds.policy.image_policy == "skip" else []
                log.warning("%s %s: skipped bad data (data.%s=skip): %s%s", d.name, split, key,
                            ", ".join(f"{n} {reason}" for reason, n in sorted(ds.policy.skipped.items())),
                            f"; {listed(files, 3, sep='; ')}" if files else "")
        train_tf, val_tf = self.transforms()
        self.val_set = val.with_transform(val_tf)
        self.train_set = train  # its labels, for labels.png
        self.info = {"num_classes": train.num_classes, "class_names": list(train.class_names),
                     "category_ids": list(train.category_ids)}
        groups = [int(r >= 1.0) for r in train.aspect_ratios()] if self.cfg.task.group_aspect else None
        return TaskData(train.with_transform(train_tf), self.val_set, self.info, random_transforms=True,
                        train_collate=collate_detection, eval_collate=collate_detection, group_ids=groups)

    def device_transform(self, *, channels_last: bool) -> Callable[[Any], Any] | None:
        data = self.cfg.data  # a detection source, or a panoptic one
        if not (isinstance(data, ImageFileKeys) and data.normalize_on_device):
            return None

        normalize = NormalizeOnDevice()
        return lambda batch: (normalize(batch[0], batch[1]), *batch[1:])

    def collect_detections(self, model: nn.Module, data: EvalData) -> list[dict] | None:
        """COCO-format detections of the whole validation set, gathered to rank 0; None on the
        other ranks (they have nothing to score)."""
        detections: list[dict] = []
        for (images, mask, targets), real in data:
            orig = torch.stack([t["orig_size"] for t in targets])
            preds = self.predict_batch(model, images, mask, orig)
            for pred, target in zip(preds[real], targets[real]):  # host transfer per batch: evaluation only
                results = to_coco_results(pred["boxes"].cpu(), pred["scores"].cpu(),  # host sync
                                          pred["labels"].cpu(), target["image_id"],  # host sync
                                          self.info["category_ids"])
                if "masks" in pred:  # instance masks at the original size: COCO's compressed RLE
                    for result, segmentation in zip(results, segmentations(pred["masks"].cpu().numpy())):  # host sync
                        result["segmentation"] = segmentation
                detections += results
        gathered = data.gather(detections, dst=0)
        if gathered is None:
            return None
        shown = {r.image_id for r in self.val_set.records[:SHOWN_IMAGES]}
        self.shown_detections = [d for d in gathered if d["image_id"] in shown]  # for eval_figures
        return gathered

    def evaluate(self, model: nn.Module, data: EvalData) -> dict[str, Any]:
        """COCO AP and its per-class table (``score``)."""
        detections = self.collect_detections(model, data)
        if detections is None:  # not rank 0
            return {}
        metrics, per_class = self.score(detections)
        return {**metrics, PER_CLASS: per_class}

    def score(self, detections: list[dict]) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        """COCO AP (``eval.coco_backend``) and per class AP, AP50, recall and n_gt (``CocoEvaluation.per_class``);
        keeps the PR curves at IoU 0.5 and the confusion matrix of the same detections for
        ``eval_figures`` (a few kilobytes: the detections themselves are not kept)."""
        result = coco_evaluation(self.val_set.coco_ground_truth(), detections, backend=self.cfg.eval.coco_backend)
        per_class = result.per_class()
        preds, gts = predictions_and_truths(self.val_set.records, detections, self.info["category_ids"])
        self.kept = KeptEvaluation(result.recall_thresholds, result.pr_curves(0.5),
                                   {name: row["AP50"] for name, row in per_class.items()},
                                   detection_confusion(preds, gts, self.info["num_classes"]))
        return result.metrics, per_class

    def preview_figures(self, batch: Any) -> dict[str, Any]:
        """The first training batch (``train_batch_figure``) and the training set's labels: boxes per
        class, their sizes and centres."""
        images, _, targets = batch[:3]
        records = self.train_set.records  # a RecordIndex: every box of the split in one array
        boxes, labels, sizes = records.boxes, records.labels, records.box_sizes
        return {"train_batch": self.train_batch_figure(images, targets),
                "labels": labels_figure(boxes, labels, sizes, self.info["class_names"],
                                        title=f"training labels: {len(records)} images, {len(labels)} boxes")}

    def train_batch_figure(self, images: torch.Tensor, targets: list[dict[str, Any]]) -> Any:
        """The first training images with their boxes and, where the data has them, their instance
        masks, padded as the model receives them."""
        n = min(PREVIEW_IMAGES, len(images))
        tiles = [Tile(display_pixels(images[i], IMAGENET_MEAN, IMAGENET_STD), boxes_caption(len(t["labels"])),
                      t["boxes"].numpy(), t["labels"].tolist(),
                      t["masks"].numpy().astype(bool) if "masks" in t else None)  # unpadded: the image's top-left
                 for i, t in enumerate(targets[:n])]
        title = f"first training batch as the model receives it ({n} of {len(images)} images, padded to " \
                f"{images.shape[-1]} x {images.shape[-2]} px)"
        return tiles_image(grid(tiles, 4), title=title, class_names=self.info["class_names"], cell=240)

    def eval_figures(self) -> dict[str, Any]:
        """From the last evaluation: the first validation images with their detections over the
        ground truth, the PR curves per class at IoU 0.5, and the confusion matrix with background."""
        figures = self.validation_figures(self.shown_images()) if self.shown_detections is not None else {}
        kept = self.kept
        if kept is not None:
            figures["pr_curves"] = pr_curves_figure(
                kept.recall, kept.curves, kept.ap50, legend_title="AP50",
                title=f"precision-recall at IoU 0.5, {len(kept.curves)} classes with ground truth")
            true, predicted = int(kept.confusion[:-1].sum()), int(kept.confusion[:, :-1].sum())
            figures["confusion_matrix"] = confusion_figure(
                kept.confusion, [*self.info["class_names"], BACKGROUND],
                title=f"confusion matrix: score >= {CONFUSION_SCORE}, IoU >= {CONFUSION_IOU}\n"
                      f"{true} true boxes, {predicted} predictions")
        return figures

    def shown_images(self) -> list[ShownImage]:
        """The first validation images with the last evaluation's detections on them (score >=
        ``SHOWN_SCORE``, the highest first) and the ground truth; with both's instance masks where
        the detections carry them (``collect_detections``' ``segmentation``, decoded)."""
        to_label = {c: i for i, c in enumerate(self.info["category_ids"])}
        shown = []
        for index in range(min(SHOWN_IMAGES, len(self.val_set))):
            image, target = self.val_set.load(index)
            dets = sorted((d for d in self.shown_detections or () if d["image_id"] == target["image_id"]
                           and d["score"] >= SHOWN_SCORE), key=lambda d: -d["score"])[:SHOWN_MAX_BOXES]
            boxes = torch.tensor([[x, y, x + w, y + h] for x, y, w, h in (d["bbox"] for d in dets)]).reshape(-1, 4)
            item = ShownImage(image.as_subclass(torch.Tensor), target["boxes"].as_subclass(torch.Tensor),
                              target["labels"].tolist(), boxes, [d["score"] for d in dets],
                              [to_label[d["category_id"]] for d in dets])
            if "masks" in target and all("segmentation" in d for d in dets):
                h, w = image.shape[-2:]
                item.gt_masks = target["masks"].numpy().astype(bool)
                item.masks = decode([d["segmentation"]["counts"] for d in dets], h, w).astype(bool)
            shown.append(item)
        return shown

    def validation_figures(self, shown: list[ShownImage]) -> dict[str, Any]:
        """What ``eval_figures`` draws of the first validation images: the detections over the ground truth."""
        title = f"validation images: predictions with score >= {SHOWN_SCORE} (red), ground truth (green)"
        return {"val_detections": detections_figure(shown, self.info["class_names"], title=title)}

    def export_metadata(self, info: dict[str, Any]) -> dict[str, Any]:
        """What every detector's exported file says about its input and labels; each detector adds
        its resize rule, box format and post-processing."""
        n = info["num_classes"]
        return {"class_names": list(info.get("class_names") or map(str, range(n))),
                "category_ids": list(info.get("category_ids") or range(n)),
                "labels": "0-based indices into class_names (category_ids gives the dataset's ids)",
                "input_layout": "NCHW", "input_channels": 3, "color": "RGB", "scale": 1 / 255,
                "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD), "score_threshold": self.predict_threshold}

    @torch.no_grad()
    def predict(self, model: nn.Module, images: list[torch.Tensor], device: torch.device
                ) -> list[dict[str, torch.Tensor]]:
        """Detections on uint8 [3, H, W] images (or float in [0, 1]), in their own pixel coordinates:
        the validation transform, the padded collate and ``predict_batch``, as evaluation runs them."""
        from torchvision import tv_tensors

        from visiontrain.data.detection.transforms import collate_detection

        _, val_tf = self.transforms()
        samples = []
        for img in images:
            h, w = img.shape[-2:]
            empty = {"boxes": tv_tensors.BoundingBoxes(torch.zeros(0, 4), format="XYXY", canvas_size=(h, w)),
                     "labels": torch.zeros(0, dtype=torch.int64), "image_id": 0,
                     "orig_size": torch.tensor([h, w])}
            samples.append(val_tf(tv_tensors.Image(img), empty))
        batch, mask, targets = collate_detection(samples)
        orig = torch.stack([t["orig_size"] for t in targets]).to(device)
        model.eval()
        return [{k: v.cpu() for k, v in p.items()}  # host sync (prediction output)
                for p in self.predict_batch(model, batch.to(device), mask.to(device), orig)]
