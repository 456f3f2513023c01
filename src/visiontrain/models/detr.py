"""DETR (Carion et al., 2020, "End-to-End Object Detection with Transformers").

A ResNet backbone with frozen batch norm gives a stride-32 feature map; a 1x1 conv projects it to
``hidden_dim``; a post-norm transformer encoder/decoder turns ``num_queries`` learned queries into
box predictions; linear/MLP heads give class logits (``num_classes + 1``, last = no-object) and
normalised ``cxcywh`` boxes.  Every decoder layer's output goes through the heads so the loss can
supervise them (``aux_outputs``).

``torch.nn.Transformer`` is not used: DETR adds the positional encodings to the queries and keys of
*every* attention layer (and never to the values), which that module has no hook for.

Padding: images of different sizes are batched by padding bottom/right; ``mask`` (True = padding)
is downsampled to the feature map and used both for the positional encoding (positions are
normalised by the real extent of each image) and as the attention ``key_padding_mask``.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Sequence

from visiontrain._tv_compat import ensure_torchvision

ensure_torchvision()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torchvision.models._utils import IntermediateLayerGetter  # noqa: E402
from torchvision.ops import FrozenBatchNorm2d, box_convert, clip_boxes_to_image, remove_small_boxes  # noqa: E402

from visiontrain.models import MIN_BOX_SIZE, cached_torch_hub_weights  # noqa: E402

__all__ = ["DETR", "postprocess", "sine_position_encoding", "downsample_mask"]

_BACKBONES = {  # name -> (builder name, weights enum name, output channels of layer4)
    "resnet18": ("resnet18", "ResNet18_Weights", 512),
    "resnet34": ("resnet34", "ResNet34_Weights", 512),
    "resnet50": ("resnet50", "ResNet50_Weights", 2048),
    "resnet101": ("resnet101", "ResNet101_Weights", 2048),
}
_LAYERS = ("stem", "layer1", "layer2", "layer3", "layer4")  # "stem" = conv1 + bn1


def _cached_weights(backbone: str):
    """The IMAGENET1K_V1 weights (what DETR used), if cached (else PretrainedUnavailable)."""
    return cached_torch_hub_weights(getattr(torchvision.models, _BACKBONES[backbone][1]).IMAGENET1K_V1, backbone)


class Backbone(nn.Module):
    """ResNet trunk up to layer4 (stride 32) with FrozenBatchNorm2d everywhere.

    Batch norm is frozen because detection batches are tiny (a few images per GPU), so batch
    statistics would be noise; the stem and layer1 are frozen too (as in DETR) since they learn
    generic edges and training them buys nothing but memory.
    """

    def __init__(self, name: str, pretrained: bool, train_layers: Sequence[str], *,
                 feature_layer: str = "layer4", frozen_bn: bool = True) -> None:
        super().__init__()
        if name not in _BACKBONES:
            raise ValueError(f"unknown DETR backbone {name!r}; choose one of {sorted(_BACKBONES)}")
        bad = [layer for layer in train_layers if layer not in _LAYERS]
        if bad:
            raise ValueError(f"train_backbone_layers may only name {_LAYERS}; got {bad}")
        if feature_layer not in ("layer3", "layer4"):
            raise ValueError(f"feature_layer must be layer3 (stride 16) or layer4 (stride 32), got {feature_layer!r}")
        weights = _cached_weights(name) if pretrained else None
        builder = getattr(torchvision.models, _BACKBONES[name][0])
        # Frozen BN is right for a pretrained trunk on tiny batches; a trunk trained from scratch
        # needs real batch norm (FrozenBatchNorm2d at its initial values is the identity).
        trunk = builder(weights=weights, norm_layer=FrozenBatchNorm2d if frozen_bn else nn.BatchNorm2d)
        # IntermediateLayerGetter keeps the children up to feature_layer and drops the rest.
        self.body = IntermediateLayerGetter(trunk, return_layers={feature_layer: "out"})
        self.num_channels = _BACKBONES[name][2] // (2 if feature_layer == "layer3" else 1)
        prefixes = tuple(f"{layer}." for layer in train_layers if layer != "stem")
        prefixes += ("conv1.", "bn1.") if "stem" in train_layers else ()
        for pname, p in self.body.named_parameters():
            if not pname.startswith(prefixes):
                p.requires_grad_(False)

    def forward(self, images: Tensor) -> Tensor:
        return self.body(images)["out"]


def downsample_mask(mask: Tensor, size: Sequence[int]) -> Tensor:
    """Padding mask [B,H,W] -> [B,h,w] by nearest interpolation (a feature cell is padding iff the
    pixel at its top-left corner is; with bottom/right padding that is exact for multiples of 32)."""
    return F.interpolate(mask[:, None].float(), size=tuple(size), mode="nearest")[:, 0].bool()


def sine_position_encoding(mask: Tensor, dim: int, temperature: float = 10000.0,
                           scale: float = 2 * math.pi) -> Tensor:
    """Fixed 2-D sine/cosine encoding [B,dim,h,w] from a padding mask [B,h,w] (True = padding).

    Coordinates are the running count of real cells along each axis, normalised by each image's
    own real extent (so a padded image gets the same encoding over its real region as unpadded)
    and scaled to [0, 2pi].  Half the channels encode y, half x; within each half, channel pairs
    share a frequency ``temperature ** (2k/half)`` and hold (sin, cos).
    """
    if dim % 2:
        raise ValueError(f"position encoding needs an even dim, got {dim}")
    half, eps = dim // 2, 1e-6
    real = (~mask).float()
    y = real.cumsum(1)
    x = real.cumsum(2)
    y = y / (y[:, -1:, :] + eps) * scale
    x = x / (x[:, :, -1:] + eps) * scale
    k = torch.arange(half, dtype=torch.float32, device=mask.device)
    freqs = temperature ** (2 * torch.div(k, 2, rounding_mode="floor") / half)

    def encode(coord: Tensor) -> Tensor:  # [B,h,w] -> [B,h,w,half], sin on even, cos on odd
        phase = coord[..., None] / freqs
        return torch.stack((phase[..., 0::2].sin(), phase[..., 1::2].cos()), dim=4).flatten(3)

    return torch.cat((encode(y), encode(x)), dim=3).permute(0, 3, 1, 2)


class EncoderLayer(nn.Module):
    """Post-norm self-attention + FFN; ``pos`` is added to queries and keys, not values."""

    def __init__(self, d: int, nheads: int, ff: int, dropout: float) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d, nheads, dropout=dropout, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, ff), nn.ReLU(inplace=True), nn.Dropout(dropout), nn.Linear(ff, d))
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop1, self.drop2 = nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, src: Tensor, pos: Tensor, pad: Tensor) -> Tensor:
        qk = src + pos
        src = self.norm1(src + self.drop1(self.attn(qk, qk, src, key_padding_mask=pad, need_weights=False)[0]))
        return self.norm2(src + self.drop2(self.ff(src)))


class DecoderLayer(nn.Module):
    """Post-norm query self-attention, cross-attention to the memory, FFN; query positions are
    added at both attentions and the memory's positions to the cross-attention keys."""

    def __init__(self, d: int, nheads: int, ff: int, dropout: float) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d, nheads, dropout=dropout, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(d, nheads, dropout=dropout, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, ff), nn.ReLU(inplace=True), nn.Dropout(dropout), nn.Linear(ff, d))
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop1, self.drop2, self.drop3 = nn.Dropout(dropout), nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, tgt: Tensor, memory: Tensor, query_pos: Tensor, pos: Tensor, pad: Tensor) -> Tensor:
        qk = tgt + query_pos
        tgt = self.norm1(tgt + self.drop1(self.self_attn(qk, qk, tgt, need_weights=False)[0]))
        att = self.cross_attn(tgt + query_pos, memory + pos, memory, key_padding_mask=pad, need_weights=False)[0]
        tgt = self.norm2(tgt + self.drop2(att))
        return self.norm3(tgt + self.drop3(self.ff(tgt)))


class MLP(nn.Module):
    """Linear layers with ReLU between them (the box head: hidden -> hidden -> hidden -> 4)."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int, num_layers: int) -> None:
        super().__init__()
        dims = [d_in] + [d_hidden] * (num_layers - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else F.relu(layer(x))
        return x


class DETR(nn.Module):
    """DETR detector; see the module docstring.  ``forward(images, mask)`` returns
    ``{"pred_logits": [B,Q,C+1], "pred_boxes": [B,Q,4] (cxcywh in [0,1]), "aux_outputs": [...]}``
    where ``aux_outputs`` holds the same two entries for every decoder layer but the last."""

    def __init__(self, num_classes: int, *, backbone: str = "resnet50", hidden_dim: int = 256, nheads: int = 8,
                 enc_layers: int = 6, dec_layers: int = 6, dim_feedforward: int = 2048, dropout: float = 0.1,
                 num_queries: int = 100, pretrained_backbone: bool = False,
                 train_backbone_layers: Sequence[str] = ("layer2", "layer3", "layer4"),
                 feature_layer: str = "layer4", frozen_bn: bool = True) -> None:
        super().__init__()
        if num_classes < 1 or num_queries < 1 or dec_layers < 1 or enc_layers < 0:
            raise ValueError(f"DETR needs num_classes>=1, num_queries>=1, dec_layers>=1, enc_layers>=0; got "
                             f"{num_classes}, {num_queries}, {dec_layers}, {enc_layers}")
        if hidden_dim % nheads or hidden_dim % 2:
            raise ValueError(f"hidden_dim ({hidden_dim}) must be even and divisible by nheads ({nheads})")
        self.num_classes, self.num_queries, self.hidden_dim = num_classes, num_queries, hidden_dim
        self.backbone = Backbone(backbone, pretrained_backbone, tuple(train_backbone_layers),
                                 feature_layer=feature_layer, frozen_bn=frozen_bn)
        self.input_proj = nn.Conv2d(self.backbone.num_channels, hidden_dim, kernel_size=1)
        enc = EncoderLayer(hidden_dim, nheads, dim_feedforward, dropout)
        dec = DecoderLayer(hidden_dim, nheads, dim_feedforward, dropout)
        self.encoder = nn.ModuleList(copy.deepcopy(enc) for _ in range(enc_layers))
        self.decoder = nn.ModuleList(copy.deepcopy(dec) for _ in range(dec_layers))
        self.decoder_norm = nn.LayerNorm(hidden_dim)
        self.query_embed = nn.Embedding(num_queries, hidden_dim)
        self.class_embed = nn.Linear(hidden_dim, num_classes + 1)
        self.bbox_embed = MLP(hidden_dim, hidden_dim, 4, 3)
        # Xavier on the transformer's matrices, as in the paper's code: the default MHA/Linear
        # inits give a badly scaled residual stream at 6+6 layers.
        for module in (self.encoder, self.decoder):
            for p in module.parameters():
                if p.dim() > 1:
                    nn.init.xavier_uniform_(p)

    def encode_image(self, images: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Images [B,3,H,W] + padding mask [B,H,W] -> projected features [B,D,h,w] + mask [B,h,w]."""
        if mask.shape != (images.shape[0], *images.shape[-2:]):
            raise ValueError(f"mask must be [B,H,W] = {(images.shape[0], *images.shape[-2:])}, got {tuple(mask.shape)}")
        feat = self.backbone(images)
        return self.input_proj(feat), downsample_mask(mask, feat.shape[-2:])

    def forward_features(self, feat: Tensor, mask: Tensor) -> dict:
        """Transformer + heads from projected features [B,D,h,w] and their padding mask [B,h,w].

        Split from :meth:`forward` so the mask handling of the transformer can be checked (and
        features reused) without running the backbone.
        """
        b = feat.shape[0]
        pos = sine_position_encoding(mask, self.hidden_dim).to(feat.dtype).flatten(2).transpose(1, 2)
        src = feat.flatten(2).transpose(1, 2)  # [B,hw,D]
        pad = mask.flatten(1)  # [B,hw]
        for layer in self.encoder:
            src = layer(src, pos, pad)
        query_pos = self.query_embed.weight[None].expand(b, -1, -1)
        tgt = torch.zeros_like(query_pos)  # the decoder starts from zero targets; queries are positions
        hs = []
        for layer in self.decoder:
            tgt = layer(tgt, src, query_pos, pos, pad)
            hs.append(self.decoder_norm(tgt))  # the shared final norm feeds every layer's heads
        h = torch.stack(hs)  # [L,B,Q,D]
        logits, boxes = self.class_embed(h), self.bbox_embed(h).sigmoid()
        return {"pred_logits": logits[-1], "pred_boxes": boxes[-1],
                "aux_outputs": [{"pred_logits": lg, "pred_boxes": bx} for lg, bx in zip(logits[:-1], boxes[:-1])]}

    def forward(self, images: Tensor, mask: Tensor | None = None) -> dict:
        """``mask`` [B,H,W], True = padding; None means no padding anywhere."""
        if mask is None:
            mask = torch.zeros((images.shape[0], *images.shape[-2:]), dtype=torch.bool, device=images.device)
        return self.forward_features(*self.encode_image(images, mask))

    @staticmethod
    def postprocess(outputs: dict, orig_sizes: Tensor) -> list[dict[str, Tensor]]:
        """See :func:`postprocess`."""
        return postprocess(outputs, orig_sizes)


@torch.no_grad()
def postprocess(outputs: dict, orig_sizes: Tensor) -> list[dict[str, Tensor]]:
    """Model outputs -> per image ``{"scores": [K], "labels": [K], "boxes": [K,4]}``, one entry per
    query (K = Q) except queries whose box is degenerate, which are dropped (K < Q then).

    Scores are the softmax probability of the best real class (the no-object column is dropped
    after the softmax, so it still takes probability mass); boxes are absolute ``xyxy`` pixels of
    the original image, ``orig_sizes`` [B,2] giving (height, width), clipped to it (a box is in
    the image it was predicted for; the centre always is).  No score threshold: evaluation (COCO
    mAP) wants every query ranked by score.
    """
    logits, boxes = outputs["pred_logits"], outputs["pred_boxes"]
    if orig_sizes.shape != (logits.shape[0], 2):
        raise ValueError(f"orig_sizes must be [B,2] (h, w) with B={logits.shape[0]}, got {tuple(orig_sizes.shape)}")
    scores, labels = logits.float().softmax(-1)[..., :-1].max(-1)
    h, w = orig_sizes.to(device=boxes.device, dtype=torch.float32).unbind(1)
    scale = torch.stack((w, h, w, h), dim=1)[:, None, :]  # [B,1,4]
    xyxy = box_convert(boxes.float(), in_fmt="cxcywh", out_fmt="xyxy") * scale
    out = []
    for s, lb, bx, (ih, iw) in zip(scores, labels, xyxy, orig_sizes.tolist()):  # host sync (evaluation only)
        bx = clip_boxes_to_image(bx, (int(ih), int(iw)))
        keep = remove_small_boxes(bx, MIN_BOX_SIZE)
        out.append({"scores": s[keep], "labels": lb[keep], "boxes": bx[keep]})
    return out
