"""DETR: set prediction with Hungarian matching (Carion et al. 2020), on any detection dataset.

The weighted loss dict (ce / L1 / GIoU, copied per decoder layer with an ``_i`` suffix), the
backbone's lower lr (``optim.lr_mult``), clipping at 0.1 and the lr drop are engine settings in the
recipe; this file holds what is specific to DETR: the model, the matcher and criterion, the box
format (normalised cxcywh of each image's own size) and COCO evaluation.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from visiontrain.core.config import doc
from visiontrain.engine.protocols.task import DictOutputs, ExportSpec, register_task
from visiontrain.engine.state.checkpoint import CheckpointError
from visiontrain.engine.state.weights import load_init_weights
from visiontrain.models import MIN_BOX_SIZE
from visiontrain.models.detr_queries import QueryOptions
from visiontrain.tasks.detection import DetectionConfig, DetectionTask, unread_data_keys


@dataclass
class DetrConfig(DetectionConfig):
    unread_data_keys: ClassVar[dict[str, str]] = unread_data_keys(
        "task.train_scales, task.max_size and task.val_size",
        "DETR's own (flip, multi-scale, crop): task.train_scales, task.crop_resize, task.crop_min, task.crop_max")
    name: str = doc("task name", "detr")
    backbone: str = doc("torchvision ResNet: resnet18 | resnet34 | resnet50 | resnet101", "resnet50")
    backbone_weights: str = doc("file (.safetensors or checkpoint) with ResNet weights for the backbone, e.g. "
                                "the model.safetensors of a classification run with task.model=resnet18; "
                                "'' = none", "")
    train_backbone_layers: list[str] = doc("trained backbone parts (stem, layer1..layer4); the rest frozen",
                                           factory=lambda: ["layer2", "layer3", "layer4"])
    feature_layer: str = doc("backbone output: layer4 (stride 32, the paper) or layer3 (stride 16)", "layer4")
    frozen_bn: bool = doc("FrozenBatchNorm2d in the backbone (the paper; needs pretrained weights)", True)
    hidden_dim: int = doc("transformer width", 256)
    nheads: int = doc("attention heads", 8)
    enc_layers: int = doc("encoder layers", 6)
    dec_layers: int = doc("decoder layers", 6)
    dim_feedforward: int = doc("feed-forward width", 2048)
    dropout: float = doc("transformer dropout", 0.1)
    num_queries: int = doc("object queries (max detections per image)", 100)
    aux_loss: bool = doc("losses on every decoder layer's output (suffix _i)", True)
    eos_coef: float = doc("weight of the no-object class in the cross-entropy", 0.1)
    class_loss: Literal["ce", "focal", "varifocal"] = doc(
        "class loss: ce (the paper: softmax with a no-object class), focal (sigmoid focal loss and a "
        "matching cost to match, Deformable DETR), varifocal (focal with IoU targets, RT-DETR)", "ce")
    class_weight: float | None = doc("weight of the class loss on every decoder layer (None: 1 for ce and varifocal, "
                                     "2 for focal, as the paper, RT-DETR and Deformable DETR)", None)
    focal_alpha: float = doc("focal loss and focal matching cost: weight of the positives", 0.25)
    focal_gamma: float = doc("focal loss: focusing exponent", 2.0)
    box_refine: bool = doc("queries carry reference boxes, refined layer by layer (DAB / Deformable DETR)", False)
    two_stage: bool = doc("the encoder's top-scoring tokens become the queries' boxes (two-stage selection)",
                          False)
    query_groups: int = doc("training only: copies of the query set, each matched one-to-one (Group DETR)",
                            1, minimum=1)
    dn_groups: int = doc("training only: noised copies of the ground truth to reconstruct (DN-DETR); 0 = off",
                         0, minimum=0)
    dn_label_noise: float = doc("denoising: probability a copy's label is replaced by a random class", 0.2)
    dn_box_noise: float = doc("denoising: box jitter, as a fraction of the box's size", 0.4)
    deformable_levels: Literal[0, 1, 2] = doc(
        "decoder cross-attention: 0 = the paper's (all cells); 1 = deformable, sampling around each query's box "
        "(Deformable DETR); 2 = also from the finer backbone map", 0)
    deformable_points: int = doc("deformable attention: sampling points per head and level", 4, minimum=1)
    cost_class: float = doc("matching cost weight: class probability (focal: class focal cost)", 1.0)
    cost_bbox: float = doc("matching cost weight: L1 box distance", 5.0)
    cost_giou: float = doc("matching cost weight: generalized IoU", 2.0)
    train_scales: list[int] = doc("shorter-side sizes drawn for training",
                                  factory=lambda: list(range(480, 801, 32)))
    max_size: int = doc("cap on the longer side", 1333)
    crop_resize: list[int] = doc("crop branch: shorter-side sizes before the crop", factory=lambda: [400, 500, 600])
    crop_min: int = doc("crop branch: smallest crop side", 384)
    crop_max: int = doc("crop branch: largest crop side", 600)


CLASS_WEIGHTS = {"ce": 1.0, "focal": 2.0, "varifocal": 1.0}  # the paper, Deformable DETR, RT-DETR


class DetrTask(DetectionTask):
    name = "detr"
    metric, mode = "AP", "max"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        from visiontrain.models.detr_loss import CLASS_LOSSES, detr_weight_dict

        t = cfg.task
        if t.val_size >= t.max_size:
            raise ValueError(f"task.val_size={t.val_size} must be below task.max_size={t.max_size} "
                             f"(the longer side is capped at max_size)")
        class_weight = CLASS_WEIGHTS[t.class_loss] if t.class_weight is None else t.class_weight
        self.default_loss_weights = detr_weight_dict(
            class_weight, aux_layers=t.dec_layers - 1 if t.aux_loss else 0, class_key=CLASS_LOSSES[t.class_loss],
            two_stage=t.two_stage, denoising=t.dn_groups > 0)

    @property
    def predict_threshold(self) -> float:
        """Focal-trained sigmoid scores sit lower than softmax ones (0.3-0.6 on objects found, as in
        Deformable DETR's demos), so 0.5 would drop most true detections."""
        return 0.5 if self.cfg.task.class_loss == "ce" else 0.3

    def transforms(self) -> tuple[Any, Any]:
        from visiontrain.data.detection.transforms import detr_train_transform, detr_val_transform

        t = self.cfg.task
        return (detr_train_transform(t.train_scales, t.max_size, t.crop_resize, t.crop_min, t.crop_max,
                                     on_device=self.cfg.data.normalize_on_device),
                detr_val_transform(t.val_size, t.max_size))

    def build_model(self, info: dict[str, Any]) -> nn.Module:
        from visiontrain.models.detr import DETR, DetrSpec
        from visiontrain.models.detr_loss import HungarianMatcher, SetCriterion

        t = self.cfg.task
        sigmoid = t.class_loss != "ce"
        matcher = HungarianMatcher(t.cost_class, t.cost_bbox, t.cost_giou, focal=sigmoid, alpha=t.focal_alpha,
                                   gamma=t.focal_gamma)
        self.criterion = SetCriterion(info["num_classes"], matcher, self.loss_weights, eos_coef=t.eos_coef,
                                      class_loss=t.class_loss, focal_alpha=t.focal_alpha, focal_gamma=t.focal_gamma,
                                      num_queries=t.num_queries)
        queries = QueryOptions(box_refine=t.box_refine, two_stage=t.two_stage, groups=t.query_groups,
                               dn_groups=t.dn_groups, dn_label_noise=t.dn_label_noise, dn_box_noise=t.dn_box_noise,
                               deformable_levels=t.deformable_levels, deformable_points=t.deformable_points)
        keys = [f.name for f in fields(DetrSpec) if f.name not in ("sigmoid_class", "queries")]  # this section's
        return DETR(info["num_classes"], DetrSpec(**{k: getattr(t, k) for k in keys}, sigmoid_class=sigmoid,
                                                  queries=queries))

    def init_weights(self, model: nn.Module) -> str | None:
        """``task.backbone_weights``: a ResNet's own weights (torchvision or timm names: conv1, bn1,
        layer1..) into the trunk; its classifier and the layers DETR does not use are ignored, and a
        grey stem is adapted to RGB."""
        path = self.cfg.task.backbone_weights
        if not path:
            return None
        try:
            return load_init_weights(model.backbone.body, path, what="task.backbone_weights")
        except (CheckpointError, FileNotFoundError) as err:
            raise ValueError(f"task.backbone_weights: {err}") from err

    def losses(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        from torchvision.ops import box_convert

        images, mask, targets = batch
        normalised = []
        for t in targets:  # boxes as cxcywh of the image's own size; no host read (size is a tensor)
            wh = t["size"].flip(0).repeat(2).to(t["boxes"].dtype)
            normalised.append({"labels": t["labels"],
                               "boxes": box_convert(t["boxes"], "xyxy", "cxcywh") / wh})
        # only the denoising queries read the targets; without them the call is the paper's
        outputs = model(images, mask, normalised) if self.cfg.task.dn_groups else model(images, mask)
        if not self.cfg.task.aux_loss:
            outputs.pop("aux_outputs", None)
            outputs.get("dn_outputs", {}).pop("aux_outputs", None)
        self.criterion.to(images.device)
        return self.criterion(outputs, normalised)

    def predict_batch(self, model: nn.Module, images: torch.Tensor, mask: torch.Tensor,
                      orig_sizes: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        from visiontrain.models.detr import postprocess

        return postprocess(model(images, mask), orig_sizes, sigmoid=self.cfg.task.class_loss != "ce")

    def export_spec(self, model: nn.Module, info: dict[str, Any]) -> ExportSpec:
        """The raw outputs (pred_logits [B,Q,C+1], or [B,Q,C] sigmoid logits with a focal or varifocal
        class loss; pred_boxes [B,Q,4] normalised cxcywh) from images
        [B,3,H,W] prepared as for evaluation and their padding mask [B,H,W] (True = padding), of any
        height and width (checked on a wider image too): the Hungarian-free post-processing is a
        softmax and a box scale, left to the caller (the metadata describes it)."""
        side = -(-self.cfg.task.val_size // 32) * 32
        seed = torch.Generator().manual_seed(0)
        images = torch.randn(2, 3, side, side, generator=seed)
        mask = torch.zeros(2, side, side, dtype=torch.bool)
        mask[1, :, side - side // 4:] = True  # the second image padded on the right, as in a real batch
        wide = torch.randn(1, 3, side, side * 3 // 2, generator=seed)
        return ExportSpec(DictOutputs(model.eval(), ["pred_logits", "pred_boxes"]), (images, mask),
                          ["images", "mask"], ["pred_logits", "pred_boxes"],
                          dynamic_axes={"images": {2: "height", 3: "width"}, "mask": {1: "height", 2: "width"}},
                          check_inputs=[(wide, torch.zeros(1, side, side * 3 // 2, dtype=torch.bool))],
                          metadata=self._export_metadata(info))

    def _export_metadata(self, info: dict[str, Any]) -> dict[str, Any]:
        from visiontrain.models.detr import SIGMOID_TOP_K

        t = self.cfg.task
        sigmoid = t.class_loss != "ce"
        logits = f"pred_logits [B, Q, C]: sigmoid, score every (query, class) pair, keep the best {SIGMOID_TOP_K}" \
            if sigmoid else "pred_logits [B, Q, C + 1]: softmax, drop the last column ('no object'), score = best class"
        return {**self.export_metadata(info), "input_size": {"height": "dynamic", "width": "dynamic"},
                "resize": {"mode": "shorter_side", "shorter_side": t.val_size, "max_longer_side": t.max_size},
                "pad": {"multiple": 32, "value": 0, "where": "bottom and right, after normalisation"},
                "mask": "[B, H, W] bool, True on padding", "class_activation": "sigmoid" if sigmoid else "softmax",
                "top_k": SIGMOID_TOP_K if sigmoid else None, "output": f"{logits}; pred_boxes [B, Q, 4]",
                "num_queries": t.num_queries, "box_format": "cxcywh", "min_box_size": MIN_BOX_SIZE,
                "box_frame": "fractions of the real (unpadded) resized image: multiply by the original image's "
                             "width and height, then clip to it"}


register_task("detr", DetrTask, DetrConfig)
