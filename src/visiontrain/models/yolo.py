"""YOLOv3 (Redmon & Farhadi 2018) as GluonCV builds it: a timm backbone's stride 8/16/32 features,
three detection blocks joined top-down by 1x1 conv + 2x upsample + concat, and one 1x1 output conv
per scale predicting, for each of its anchors, (tx, ty, tw, th, objectness, classes).

The network returns the three raw maps as plain tensors (what ``visiontrain export`` traces);
``decode`` turns them into boxes for the loss and for ``postprocess`` (NMS), so the same decoding
serves training, evaluation and prediction.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Sequence

import torch
from torch import nn

from visiontrain.core._tv_compat import ensure_torchvision
from visiontrain.models import MIN_BOX_SIZE, check_pretrained_reachable, pretrained_error

#: GluonCV's / Darknet's nine COCO anchors (w, h) in input pixels, three per stride 8, 16, 32.
COCO_ANCHORS: list[list[float]] = [[10, 13], [16, 30], [33, 23], [30, 61], [62, 45], [59, 119],
                                   [116, 90], [156, 198], [373, 326]]
STRIDES: tuple[int, int, int] = (8, 16, 32)


def conv_bn(cin: int, cout: int, k: int) -> nn.Sequential:
    """Darknet's unit: conv (no bias, BN follows) + BN + LeakyReLU(0.1)."""
    return nn.Sequential(nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), nn.BatchNorm2d(cout),
                         nn.LeakyReLU(0.1, inplace=True))


class DetectionBlock(nn.Module):
    """GluonCV's YOLODetectionBlockV3: five alternating 1x1 / 3x3 convs (the route, passed up the
    top-down path) and one more 3x3 (the tip, read by the output conv)."""

    def __init__(self, cin: int, channels: int) -> None:
        super().__init__()
        layers, c = [], cin
        for i in range(5):
            out = channels if i % 2 == 0 else 2 * channels
            layers.append(conv_bn(c, out, 1 if i % 2 == 0 else 3))
            c = out
        self.body = nn.Sequential(*layers)
        self.tip = conv_bn(channels, 2 * channels, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        route = self.body(x)
        return route, self.tip(route)


def _width_overrides(timm: Any, name: str, width: float) -> dict[str, Any]:
    """timm kwargs that scale the stem and stage widths of a (CSP)Darknet by ``width`` (multiples
    of 8): the same architecture as Darknet-53, narrow enough to train on a CPU."""
    from timm.models import cspnet

    cfg = cspnet.model_cfgs.get(name)
    if cfg is None:
        raise ValueError(f"task.backbone_width={width} applies to timm's Darknet / CSP family "
                         f"({', '.join(sorted(cspnet.model_cfgs)[:6])}, ...), not to {name!r}")

    def scale(c: Any) -> Any:
        return tuple(scale(x) for x in c) if isinstance(c, tuple) else max(8, int(round(c * width / 8)) * 8)

    return {"stem": replace(cfg.stem, out_chs=scale(cfg.stem.out_chs)),
            "stages": replace(cfg.stages, out_chs=scale(cfg.stages.out_chs))}


def _timm_features(name: str, pretrained: bool, width: float = 1.0) -> tuple[nn.Module, list[int], list[int]]:
    """A timm ``features_only`` backbone and the positions/channels of its stride 8, 16, 32 maps."""
    ensure_torchvision()
    import timm

    if not timm.is_model(name):
        close = timm.list_models(f"*{name.split('_')[0]}*")[:8]
        hint = f"; close: {', '.join(close)}" if close else ""
        raise ValueError(f"task.backbone: unknown timm model {name!r}{hint}")
    if width <= 0:
        raise ValueError(f"task.backbone_width: must be > 0, got {width}")
    if width != 1.0 and pretrained:
        raise ValueError(f"task.backbone_width={width}: pretrained weights exist only at width 1.0")
    extra = _width_overrides(timm, name, width) if width != 1.0 else {}
    if pretrained:
        check_pretrained_reachable(timm, name, "task.pretrained_backbone")
    try:
        net = timm.create_model(name, pretrained=pretrained, features_only=True, **extra)
    except RuntimeError as e:  # e.g. no features_only support
        raise ValueError(f"task.backbone={name!r}: cannot build it as a feature extractor ({e})") from e
    except Exception as e:  # the hub client's errors (unreachable, nothing cached) come in many types
        if pretrained and not isinstance(e, TypeError):
            raise pretrained_error(name, e, "task.pretrained_backbone") from e
        raise
    reductions = list(net.feature_info.reduction())
    missing = [s for s in STRIDES if s not in reductions]
    if missing:
        raise ValueError(f"task.backbone={name!r} has no feature maps at stride(s) {missing} "
                         f"(it has {reductions}); YOLOv3 needs strides 8, 16 and 32")
    pos = [len(reductions) - 1 - reductions[::-1].index(s) for s in STRIDES]  # last map of each stride
    return net, pos, [net.feature_info.channels()[p] for p in pos]


class YOLOv3(nn.Module):
    """Backbone + top-down neck + three output convs. ``forward(images)`` -> the raw maps at
    strides 8, 16, 32, each ``[B, A * (5 + C), H / s, W / s]`` (A anchors per scale)."""

    def __init__(self, num_classes: int, num_anchors: int = 3, *, backbone: str = "darknet53",
                 backbone_width: float = 1.0, neck_channels: Sequence[int] = (512, 256, 128),
                 pretrained_backbone: bool = False, obj_prior: float = 0.01) -> None:
        super().__init__()
        if len(neck_channels) != 3 or min(neck_channels) <= 0:
            raise ValueError(f"task.neck_channels: need 3 positive widths (stride 32, 16, 8), "
                             f"got {list(neck_channels)}")
        # the anchor sizes live in the task config (decode / postprocess take them): the network
        # only needs how many there are per scale
        self.num_classes, self.num_anchors = num_classes, num_anchors
        self.backbone, self._pos, chans = _timm_features(backbone, pretrained_backbone, backbone_width)
        per_anchor = 5 + num_classes
        self.blocks, self.transitions, self.outputs = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
        cin = chans[2]
        for i, c in enumerate(neck_channels):  # deepest (stride 32) first, as GluonCV builds it
            if i > 0:
                self.transitions.append(conv_bn(neck_channels[i - 1], c, 1))
                cin = c + chans[2 - i]
            self.blocks.append(DetectionBlock(cin, c))
            out = nn.Conv2d(2 * c, self.num_anchors * per_anchor, 1)
            # A low objectness prior (RetinaNet's trick): the thousands of background predictions
            # start near 0 loss instead of swamping the first steps of a from-scratch run.
            with torch.no_grad():
                out.bias.view(self.num_anchors, per_anchor)[:, 4].fill_(math.log(obj_prior / (1 - obj_prior)))
            self.outputs.append(out)
        self.upsample = nn.Upsample(scale_factor=2, mode="nearest")

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        feats = self.backbone(images)
        c8, c16, c32 = (feats[p] for p in self._pos)
        outs, x = [], c32
        for i, (block, head) in enumerate(zip(self.blocks, self.outputs)):
            if i > 0:
                up = self.upsample(self.transitions[i - 1](x))
                skip = c16 if i == 1 else c8
                x = torch.cat([up[..., :skip.shape[-2], :skip.shape[-1]], skip], dim=1)
            x, tip = block(x)
            outs.append(head(tip))
        return outs[2], outs[1], outs[0]


def decode(raw: Sequence[torch.Tensor], anchors: torch.Tensor, num_classes: int
           ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """Raw maps -> (``pred`` [B, N, 5 + C] with the per-anchor channels last, ``boxes`` [B, N, 4]
    absolute XYXY in input pixels, the (H, W) of each scale).

    Predictions are flattened scale by scale, then anchor, row, column: index
    ``offset[l] + (a * H + y) * W + x``, the layout the target generator writes into.
    """
    a = anchors.shape[0] // len(raw)
    preds, boxes, sizes = [], [], []
    for level, x in enumerate(raw):
        b, _, h, w = x.shape
        sizes.append((h, w))
        p = x.float().view(b, a, 5 + num_classes, h, w).permute(0, 1, 3, 4, 2).reshape(b, a * h * w, -1)
        stride = STRIDES[level]
        ys, xs = torch.meshgrid(torch.arange(h, device=x.device), torch.arange(w, device=x.device), indexing="ij")
        grid = torch.stack([xs, ys], -1).reshape(1, h * w, 2).expand(a, -1, -1).reshape(-1, 2)
        anc = anchors[level * a:(level + 1) * a].to(x.device)[:, None].expand(-1, h * w, -1).reshape(-1, 2)
        centre = (p[..., :2].sigmoid() + grid) * stride
        size = p[..., 2:4].clamp(max=10.0).exp() * anc  # the clamp keeps a wild early step finite
        boxes.append(torch.cat([centre - size / 2, centre + size / 2], -1))
        preds.append(p)
    return torch.cat(preds, 1), torch.cat(boxes, 1), sizes


def postprocess(raw: Sequence[torch.Tensor], anchors: torch.Tensor, num_classes: int, valid_hw: torch.Tensor,
                orig_sizes: torch.Tensor, *, conf_threshold: float = 0.01, nms_iou: float = 0.45,
                pre_nms_topk: int = 400, max_detections: int = 100) -> list[dict[str, torch.Tensor]]:
    """Per image: boxes mapped from the input (``valid_hw``: each image's unpadded size there) to
    ``orig_sizes`` (H, W) and clipped to it, degenerate ones (side < ``MIN_BOX_SIZE``) dropped, then
    the ``pre_nms_topk`` best (box, class) pairs by objectness x class probability, those above
    ``conf_threshold``, per-class NMS at ``nms_iou``, the best ``max_detections``."""
    ensure_torchvision()
    from torchvision.ops import batched_nms, clip_boxes_to_image, remove_small_boxes

    pred, boxes, _ = decode(raw, anchors, num_classes)
    scores = pred[..., 4:5].sigmoid() * pred[..., 5:].sigmoid()  # [B, N, C]
    scale = (orig_sizes.to(boxes) / valid_hw.to(boxes)).flip(-1).repeat(1, 2)[:, None]  # (sx, sy, sx, sy)
    boxes = boxes * scale
    out = []
    # evaluation / prediction only: per-image sizes and variable-size selections are fine
    for b, (h, w) in enumerate(orig_sizes.tolist()):  # host sync
        bx = clip_boxes_to_image(boxes[b], (int(h), int(w)))
        valid = remove_small_boxes(bx, MIN_BOX_SIZE)  # anchors whose box is not degenerate
        sc = scores[b, valid].flatten()  # [V * C]
        top, idx = sc.topk(min(pre_nms_topk, sc.numel()))
        keep = top > conf_threshold
        top, idx = top[keep], idx[keep]  # host sync (a mask sizes its output)
        bx, lb = bx[valid[idx // num_classes]], idx % num_classes
        kept = batched_nms(bx, top, lb, nms_iou)[:max_detections]
        out.append({"boxes": bx[kept], "scores": top[kept], "labels": lb[kept]})
    return out
