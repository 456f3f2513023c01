"""Faster R-CNN with an FPN (Ren et al. 2015; Lin et al. 2017), built from torchvision's parts.

torchvision's ``FasterRCNN`` resizes, normalises and pads images itself (``GeneralizedRCNNTransform``)
and checks every target box on the host. visiontrain's detection data already arrive resized,
ImageNet-normalised and padded into one batch with each image's real size known, so
:class:`PreparedFasterRCNN` keeps torchvision's backbone, RPN and RoI heads (same modules, same
state-dict keys, same four losses) and skips that transform: the work is done once, and nothing in
the forward pass reads a device value that torchvision's own heads do not.

Labels follow torchvision's convention inside the model (0 = background, classes from 1); the task
maps its contiguous 0-based labels in and out.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from visiontrain.core._tv_compat import ensure_torchvision

ensure_torchvision()

import torch  # noqa: E402
import torchvision  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torchvision.models.detection import FasterRCNN, MaskRCNN  # noqa: E402
from torchvision.models.detection.anchor_utils import AnchorGenerator  # noqa: E402
from torchvision.models.detection.backbone_utils import _mobilenet_extractor, _resnet_fpn_extractor  # noqa: E402
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead  # noqa: E402
from torchvision.models.detection.image_list import ImageList  # noqa: E402
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor  # noqa: E402
from torchvision.ops import FeaturePyramidNetwork, FrozenBatchNorm2d, MultiScaleRoIAlign  # noqa: E402
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool  # noqa: E402

from visiontrain.models import cached_torch_hub_weights  # noqa: E402
from visiontrain.models.freezing import freeze_parameters  # noqa: E402

__all__ = ["BACKBONES", "MaskHead", "MaskRcnnExport", "PreparedFasterRCNN", "PreparedMaskRCNN", "RcnnExport",
           "FasterRcnnSpec", "build_faster_rcnn", "fpn_levels", "paste_masks"]

RESNETS = ("resnet18", "resnet34", "resnet50", "resnet101")
BACKBONES = (*RESNETS, "mobilenet_v3_large")


def cached_imagenet_weights(name: str) -> torchvision.models.WeightsEnum:
    """torchvision's default ImageNet weights for ``name``, if cached (else PretrainedUnavailable)."""
    return cached_torch_hub_weights(torchvision.models.get_model_weights(name).DEFAULT, name)


def fpn_levels(backbone: str, returned_layers: Sequence[int]) -> int:
    """Feature maps the FPN gives the heads: one per returned stage plus the max-pooled top level."""
    if backbone not in BACKBONES:
        raise ValueError(f"task.backbone: unknown backbone {backbone!r}; expected one of {', '.join(BACKBONES)}")
    return len(returned_layers) + 1


def _fpn_backbone(name: str, pretrained: bool, trainable_layers: int, frozen_bn: bool,
                  returned_layers: Sequence[int], channels: int) -> nn.Module:
    """Trunk + FPN with ``channels`` outputs (torchvision fixes 256; CPU recipes want fewer).

    The stages below ``trainable_layers`` are frozen by torchvision's rule; their batch norms become
    FrozenBatchNorm2d even when ``frozen_bn`` is off, so a frozen stage really is frozen (torchvision
    alone would keep updating its running statistics)."""
    weights = cached_imagenet_weights(name) if pretrained else None
    norm = FrozenBatchNorm2d if frozen_bn else nn.BatchNorm2d
    trunk = getattr(torchvision.models, name)(weights=weights, norm_layer=norm)
    try:
        if name in RESNETS:
            net = _resnet_fpn_extractor(trunk, trainable_layers, list(returned_layers))
        else:
            net = _mobilenet_extractor(trunk, True, trainable_layers, list(returned_layers))
    except ValueError as err:  # torchvision names the allowed range
        raise ValueError(f"task.trainable_layers / task.returned_layers for {name}: {err}") from None
    frozen = [n for n, p in net.body.named_parameters() if not p.requires_grad]
    if frozen and not frozen_bn:
        freeze_parameters(net.body, [f"^{re.escape(n)}$" for n in frozen], frozen_bn=True)
    if channels != net.out_channels:
        in_channels = [block[0].in_channels for block in net.fpn.inner_blocks]
        net.fpn = FeaturePyramidNetwork(in_channels, channels, extra_blocks=LastLevelMaxPool())
        net.out_channels = channels
    return net


class PreparedFasterRCNN(FasterRCNN):
    """torchvision's Faster R-CNN on a prepared batch: ``forward(images [B,3,H,W] normalised and
    padded, image_sizes [(h, w)] of the real pixels, targets=None)`` returns ``(detections, losses)``;
    detections (eval mode) are in the coordinates of the prepared images, losses (train mode) are
    torchvision's four: loss_objectness, loss_rpn_box_reg, loss_classifier, loss_box_reg."""

    def forward(self, images: Tensor, image_sizes: list[tuple[int, int]],  # type: ignore[override]
                targets: list[dict[str, Tensor]] | None = None
                ) -> tuple[list[dict[str, Tensor]], dict[str, Tensor]]:
        batch = ImageList(images, image_sizes)
        features = self.backbone(images)
        proposals, rpn_losses = self.rpn(batch, features, targets)
        detections, roi_losses = self.roi_heads(features, proposals, image_sizes, targets)
        return detections, {**rpn_losses, **roi_losses}


class PreparedMaskRCNN(MaskRCNN):
    """torchvision's Mask R-CNN on a prepared batch, as ``PreparedFasterRCNN``: the losses add
    ``loss_mask`` (targets carry ``masks`` uint8 [N, h, w] in the prepared image's pixels), and each
    detection (eval mode) adds ``masks`` [N, 1, M, M]: the probability of each of an M x M grid of
    cells over its box being the object (pasted into an image by ``paste_masks``)."""

    forward = PreparedFasterRCNN.forward


@dataclass(frozen=True)
class MaskHead:
    """Mask R-CNN's mask branch: ``layers`` 3x3 convolutions of ``channels`` on 14 x 14 RoI
    features, then a 2x transposed convolution to 28 x 28 and one mask logit map a class."""
    channels: int = 256
    layers: int = 4


@dataclass(frozen=True)
class FasterRcnnSpec:
    """A Faster R-CNN's network and box settings, one anchor size per FPN level; the defaults are
    torchvision's ``fasterrcnn_resnet50_fpn``. Pairs are (train, test). With ``mask_head``, a Mask
    R-CNN: the same network and a mask branch on the same FPN levels (torchvision's
    ``maskrcnn_resnet50_fpn`` with ``MaskHead()``). The names are the ``task`` keys of the R-CNN recipes."""
    backbone: str = "resnet50"
    pretrained_backbone: bool = False
    trainable_layers: int = 3
    frozen_bn: bool = True
    returned_layers: Sequence[int] = (1, 2, 3, 4)
    fpn_channels: int = 256
    anchor_sizes: Sequence[int] = (32, 64, 128, 256, 512)
    aspect_ratios: Sequence[float] = (0.5, 1.0, 2.0)
    representation_size: int = 1024
    rpn_pre_nms_top_n: Sequence[int] = (2000, 1000)
    rpn_post_nms_top_n: Sequence[int] = (2000, 1000)
    rpn_batch_size_per_image: int = 256
    box_batch_size_per_image: int = 512
    box_score_thresh: float = 0.05
    box_nms_thresh: float = 0.5
    detections_per_img: int = 100
    mask_head: MaskHead | None = None


def mask_predictor(channels: int, outputs: int) -> MaskRCNNPredictor:
    """torchvision's mask predictor with Detectron2's start: the per-class logits layer drawn with
    std 0.001 and no bias, so every pixel starts at probability 0.5 (a loss of ln 2).

    torchvision draws that layer as a ReLU layer (Kaiming, fan-out), whose fan-out is the class
    count: with one class and background each weight has std 1, the 64 channels give logits of
    several units, the first mask loss is 4 instead of 0.7, and on 56 aerial tiles of one class the
    recipe's learning rate took the loss to 1e8 and NaN by step 7. Ten classes give std 0.43, which
    is why fashion-mosaic never showed it."""
    predictor = MaskRCNNPredictor(channels, channels, outputs)
    nn.init.normal_(predictor.mask_fcn_logits.weight, std=0.001)
    nn.init.zeros_(predictor.mask_fcn_logits.bias)
    return predictor


def build_faster_rcnn(num_classes: int,
                      spec: FasterRcnnSpec = FasterRcnnSpec()) -> PreparedFasterRCNN | PreparedMaskRCNN:
    """A Faster R-CNN (or, with ``spec.mask_head``, a Mask R-CNN) for ``num_classes`` object classes,
    background added."""
    s = spec
    levels = fpn_levels(s.backbone, s.returned_layers)
    if len(s.anchor_sizes) != levels:
        raise ValueError(f"task.anchor_sizes: need one size per FPN level ({levels}: {len(s.returned_layers)} "
                         f"returned layers + the pooled level), got {list(s.anchor_sizes)}")
    for key, pair in (("rpn_pre_nms_top_n", s.rpn_pre_nms_top_n), ("rpn_post_nms_top_n", s.rpn_post_nms_top_n)):
        if len(pair) != 2:
            raise ValueError(f"task.{key}: expected [train, test], got {list(pair)}")
    body = _fpn_backbone(s.backbone, s.pretrained_backbone, s.trainable_layers, s.frozen_bn, s.returned_layers,
                         s.fpn_channels)
    anchors = AnchorGenerator(tuple((size,) for size in s.anchor_sizes), (tuple(s.aspect_ratios),) * levels)
    pool = MultiScaleRoIAlign([str(i) for i in range(levels - 1)], output_size=7, sampling_ratio=2)
    mask = s.mask_head
    masks = {} if mask is None else {
        "mask_roi_pool": MultiScaleRoIAlign(pool.featmap_names, output_size=14, sampling_ratio=2),
        "mask_head": MaskRCNNHeads(s.fpn_channels, [mask.channels] * mask.layers, dilation=1),
        "mask_predictor": mask_predictor(mask.channels, num_classes + 1)}
    model = (PreparedFasterRCNN if mask is None else PreparedMaskRCNN)(
        body, num_classes=None, rpn_anchor_generator=anchors, box_roi_pool=pool, **masks,
        box_head=TwoMLPHead(s.fpn_channels * 7 * 7, s.representation_size),
        box_predictor=FastRCNNPredictor(s.representation_size, num_classes + 1),
        rpn_pre_nms_top_n_train=s.rpn_pre_nms_top_n[0], rpn_pre_nms_top_n_test=s.rpn_pre_nms_top_n[1],
        rpn_post_nms_top_n_train=s.rpn_post_nms_top_n[0], rpn_post_nms_top_n_test=s.rpn_post_nms_top_n[1],
        rpn_batch_size_per_image=s.rpn_batch_size_per_image, box_batch_size_per_image=s.box_batch_size_per_image,
        box_score_thresh=s.box_score_thresh, box_nms_thresh=s.box_nms_thresh,
        box_detections_per_img=s.detections_per_img)
    model.transform = None  # never used: the data pipeline resizes, normalises and pads
    return model


def paste_masks(masks: Tensor, boxes: Tensor, height: int, width: int, threshold: float = 0.5) -> Tensor:
    """bool [N, height, width]: Mask R-CNN's [N, 1, M, M] box-relative probabilities pasted into an
    image of that size at ``boxes`` (XYXY in its pixels), a pixel kept where its probability is above
    ``threshold``. Each pixel centre inside a box is placed in the box's M x M grid and the map is
    read there bilinearly (``grid_sample``); pixels outside every box stay empty. Only each box's own
    pixels are sampled: torchvision's ``paste_masks_in_image`` resizes and pastes each mask with
    padding, about 30 times slower on a CPU (100 masks in a 256-px image: 0.6 s against 0.02 s)."""
    out = torch.zeros((len(masks), height, width), dtype=torch.bool, device=masks.device)
    for i, (x0, y0, x1, y1) in enumerate(boxes.tolist()):  # host sync (evaluation and predict only)
        c0, r0, c1, r1 = max(0, int(x0)), max(0, int(y0)), min(width, int(x1) + 1), min(height, int(y1) + 1)
        if c1 <= c0 or r1 <= r0:
            continue
        gx = (torch.arange(c0, c1, device=masks.device) + 0.5 - x0) / max(x1 - x0, 1e-3) * 2 - 1  # box frame: [-1, 1]
        gy = (torch.arange(r0, r1, device=masks.device) + 0.5 - y0) / max(y1 - y0, 1e-3) * 2 - 1
        grid = torch.stack(torch.broadcast_tensors(gx[None, :], gy[:, None]), dim=-1)[None]
        probs = nn.functional.grid_sample(masks[i:i + 1].float(), grid, align_corners=False)
        out[i, r0:r1, c0:c1] = probs[0, 0] > threshold
    return out


class RcnnExport(nn.Module):
    """One prepared image [1,3,H,W] -> (boxes [N,4] XYXY in its pixels, labels [N] 0-based, scores [N]):
    the full detector with its post-processing (NMS included), in tensors only.

    The image is padded with 0 at the bottom and right to a multiple of ``size_divisible`` inside
    the graph, with its own H and W kept as its size, as the detection collate pads it for
    ``predict`` and evaluation: unpadded, a side that is not a multiple of 32 would give feature maps
    whose strides the anchor generator rounds down, and other boxes."""

    def __init__(self, model: PreparedFasterRCNN, size_divisible: int = 32) -> None:
        super().__init__()
        self.model, self.size_divisible = model, size_divisible

    def detections(self, image: Tensor) -> dict[str, Tensor]:
        """torchvision's detections of the one image, padded here, in its own pixels."""
        h, w = image.shape[-2], image.shape[-1]
        k = self.size_divisible
        padded = nn.functional.pad(image, (0, (k - w % k) % k, 0, (k - h % k) % k))
        detections, _ = self.model(padded, [(h, w)])
        return detections[0]

    def forward(self, image: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        det = self.detections(image)
        return det["boxes"], det["labels"] - 1, det["scores"]


class MaskRcnnExport(RcnnExport):
    """``RcnnExport`` of a Mask R-CNN: the same three outputs, then ``masks`` [N, 1, M, M], each
    detection's probabilities over an M x M grid of its box, for its own class (torchvision's
    ``maskrcnn_inference``). Pasting them into an image (``paste_masks``) is left to the caller,
    who wants them in the original image's pixels, not the resized input's: N maps of M x M cells
    leave the graph, not N of the image's size."""

    def forward(self, image: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # type: ignore[override]
        det = self.detections(image)
        return det["boxes"], det["labels"] - 1, det["scores"], det["masks"]
