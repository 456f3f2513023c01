"""Semantic segmentation networks: torchvision's DeepLabV3 and FCN (their heads, their auxiliary FCN
head on the third stage, their forward that brings the logits back to the input's size) on a ResNet
trunk of any depth, which torchvision builds only for ResNet-50 and -101; and the two heads
torchvision lacks, on the same model class: DeepLabV3+ (its ASPP and a decoder, ``PlusHead``) and
semantic FPN (its FeaturePyramidNetwork and a fusion to stride 4, ``FpnHead``).

What is added is the trunk's output stride for any ResNet: torchvision dilates a Bottleneck stage
(``replace_stride_with_dilation``) but refuses a BasicBlock one (ResNet-18 and -34), so here the
stages above the stride set every stride-2 convolution to stride 1 and dilate their 3 x 3
convolutions instead (2 for the first stage so changed, 4 for the next), for both kinds of block;
the receptive field is then the undilated network's and the feature map ``output_stride`` times
smaller than the input.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from visiontrain.core._tv_compat import ensure_torchvision

ensure_torchvision()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402
from torch import nn  # noqa: E402
from torchvision.models._utils import IntermediateLayerGetter  # noqa: E402
from torchvision.models.segmentation.deeplabv3 import ASPP, DeepLabHead, DeepLabV3  # noqa: E402
from torchvision.models.segmentation.fcn import FCN, FCNHead  # noqa: E402
from torchvision.ops import FeaturePyramidNetwork  # noqa: E402

from visiontrain.models.rcnn import RESNETS, cached_imagenet_weights  # noqa: E402

HEADS = ("deeplabv3", "deeplabv3plus", "fcn", "fpn")
STRIDES = (8, 16, 32)


@dataclass(frozen=True)
class SegmenterSpec:
    """A segmenter's network; the names are the ``task`` keys of the semantic recipes."""
    backbone: str = "resnet50"
    pretrained_backbone: bool = False
    head: str = "deeplabv3"
    output_stride: int = 8
    atrous_rates: Sequence[int] = (12, 24, 36)
    aux_head: bool = False
    fpn_channels: int = 256
    head_width: int = 128


def dilate(trunk: nn.Module, output_stride: int) -> None:
    """Keep the resolution of ``trunk``'s last stages (the module docstring), in place."""
    kept = {32: (), 16: (trunk.layer4,), 8: (trunk.layer3, trunk.layer4)}[output_stride]
    for k, stage in enumerate(kept, 1):
        for module in stage.modules():
            if isinstance(module, nn.Conv2d):
                module.stride = (1, 1)
                if module.kernel_size == (3, 3):
                    module.dilation = module.padding = (2 ** k, 2 ** k)


def conv_bn_relu(cin: int, cout: int, kernel: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, kernel, padding=kernel // 2, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))


class PlusHead(nn.Module):
    """DeepLabV3+'s decoder (Chen et al. 2018, as its reference code and MMSeg's DepthwiseSeparableASPPHead
    without the separable convolutions): torchvision's ASPP on the last stage, upsampled to the first
    stage's resolution (stride 4), concatenated with that stage projected to 48 channels, two 3 x 3
    convolutions of 256 and a 1 x 1 classifier. It takes ``{"high", "low"}`` (``Stages``)."""

    def __init__(self, in_channels: int, low_channels: int, num_classes: int, rates: Sequence[int]) -> None:
        super().__init__()
        self.aspp = ASPP(in_channels, list(rates), 256)
        self.project = conv_bn_relu(low_channels, 48, 1)
        self.fuse = nn.Sequential(conv_bn_relu(256 + 48, 256, 3), conv_bn_relu(256, 256, 3),
                                  nn.Conv2d(256, num_classes, 1))

    def forward(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        low = self.project(features["low"])
        high = F.interpolate(self.aspp(features["high"]), size=low.shape[-2:], mode="bilinear", align_corners=False)
        return self.fuse(torch.cat([high, low], 1))


class PyramidFusion(nn.Module):
    """Semantic FPN's fusion (Kirillov et al. 2019, MMSeg's FPNHead, Detectron2's SemSegFPNHead): each
    pyramid level through 3 x 3 convolutions of ``width`` (one, or one per halving of its resolution
    below the finest level's: 1, 1, 2, 3), brought to the finest level's size, the levels summed, a
    1 x 1 classifier: logits at the finest level's stride. MMSeg and Detectron2 upsample 2x after each
    convolution; here a level is upsampled once, after its convolutions. Panoptic FPN's semantic
    head is this on the detector's own FPN."""

    def __init__(self, levels: int, channels: int, num_classes: int, width: int = 128) -> None:
        super().__init__()
        self.levels = nn.ModuleList(
            nn.Sequential(*[conv_bn_relu(width if k else channels, width, 3) for k in range(max(1, level))])
            for level in range(levels))
        self.classifier = nn.Conv2d(width, num_classes, 1)

    def forward(self, pyramid: Sequence[torch.Tensor]) -> torch.Tensor:
        size = pyramid[0].shape[-2:]
        out = sum(F.interpolate(level(p), size=size, mode="bilinear", align_corners=False)
                  for level, p in zip(self.levels, pyramid))
        return self.classifier(out)


class FpnHead(nn.Module):
    """Semantic FPN: torchvision's FeaturePyramidNetwork over the four stages and ``PyramidFusion`` to
    the first stage's stride (4). It takes the stages by name (``Stages``)."""

    def __init__(self, in_channels: Sequence[int], num_classes: int, channels: int = 256, width: int = 128) -> None:
        super().__init__()
        self.fpn = FeaturePyramidNetwork(list(in_channels), channels)
        self.fusion = PyramidFusion(len(in_channels), channels, num_classes, width)

    def forward(self, features: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.fusion(list(self.fpn(features).values()))


class DeepLabV3Plus(DeepLabV3):
    """torchvision's ``DeepLabV3`` model (the trunk's stages, the head, logits at the input's size) with
    ``PlusHead``: a class of its own so that the model summary and the report name the network."""


class SemanticFPN(DeepLabV3):
    """torchvision's ``DeepLabV3`` model with ``FpnHead``: named for the same reason as ``DeepLabV3Plus``."""


class Stages(nn.Module):
    """The trunk's stages a head takes together, for torchvision's ``DeepLabV3``: ``{"out": {name:
    stage, ...}, "aux": stage 3}``, so that it hands its classifier them all (DeepLabV3+'s two, the
    FPN's four) and its auxiliary head the third."""

    def __init__(self, trunk: nn.Module, stages: dict[str, str], aux: bool) -> None:
        super().__init__()
        self.names = list(stages.values())
        self.aux = stages.get("layer3", "aux") if aux else None  # the FPN's third stage serves both
        self.body = IntermediateLayerGetter(trunk, return_layers={**({"layer3": "aux"} if aux else {}), **stages})

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        f = self.body(x)
        return {"out": {name: f[name] for name in self.names}, **({"aux": f[self.aux]} if self.aux else {})}


class FlipAveraged(nn.Module):
    """A segmenter's ``{"out": logits}`` averaged with its logits for the horizontally mirrored input,
    mirrored back (MMSeg's flip test-time augmentation, there on the softmax). Averaging the logits
    keeps the output logits, so the export's consumers read it as the plain network's. An image
    padded on its right is mirrored with its padding; the logits of its own pixels come back to
    their place."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        mirrored = self.model(images.flip(-1))["out"].flip(-1)
        return {"out": (self.model(images)["out"] + mirrored) / 2}


def build_segmenter(spec: SegmenterSpec, num_classes: int) -> nn.Module:
    """torchvision's ``DeepLabV3`` (with ``spec.head``'s head) or ``FCN`` on ``spec.backbone``: ``model(images)`` gives
    ``{"out": logits [B, classes, H, W]}`` at the input's size, and ``"aux"`` (the FCN head on the
    third stage) with ``spec.aux_head``."""
    if spec.backbone not in RESNETS:
        raise ValueError(f"task.backbone: {spec.backbone!r}; expected one of {', '.join(RESNETS)}")
    if spec.head not in HEADS or spec.output_stride not in STRIDES:
        raise ValueError(f"task.head={spec.head!r}, task.output_stride={spec.output_stride}: expected a head of "
                         f"{', '.join(HEADS)} and a stride of {', '.join(map(str, STRIDES))}")
    weights = cached_imagenet_weights(spec.backbone) if spec.pretrained_backbone else None
    trunk = getattr(torchvision.models, spec.backbone)(weights=weights)
    dilate(trunk, spec.output_stride)
    channels = trunk.fc.in_features  # the last stage's; the third stage has half, the first an eighth
    aux = FCNHead(channels // 2, num_classes) if spec.aux_head else None
    if spec.head == "deeplabv3plus":
        head = PlusHead(channels, channels // 8, num_classes, spec.atrous_rates)
        return DeepLabV3Plus(Stages(trunk, {"layer1": "low", "layer4": "high"}, spec.aux_head), head, aux)
    if spec.head == "fpn":
        stages = {f"layer{k}": str(k) for k in range(1, 5)}
        head = FpnHead([channels // 8, channels // 4, channels // 2, channels], num_classes, spec.fpn_channels,
                       spec.head_width)
        return SemanticFPN(Stages(trunk, stages, spec.aux_head), head, aux)
    layers = {"layer4": "out", **({"layer3": "aux"} if spec.aux_head else {})}
    body = IntermediateLayerGetter(trunk, return_layers=layers)
    if spec.head == "fcn":
        return FCN(body, FCNHead(channels, num_classes), aux)
    return DeepLabV3(body, DeepLabHead(channels, num_classes, tuple(spec.atrous_rates)), aux)
