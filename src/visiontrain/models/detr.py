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
from dataclasses import dataclass

from visiontrain.core._tv_compat import ensure_torchvision

ensure_torchvision()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torchvision  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torchvision.models._utils import IntermediateLayerGetter  # noqa: E402
from torchvision.ops import FrozenBatchNorm2d, box_convert, clip_boxes_to_image, remove_small_boxes  # noqa: E402

from visiontrain.models import MIN_BOX_SIZE, cached_torch_hub_weights  # noqa: E402
from visiontrain.models.detr_deformable import deformable_layers  # noqa: E402
from visiontrain.models.detr_queries import (  # noqa: E402
    MLP, QueryOptions, ReferenceQueries, query_attention_mask, sine_embedding)

__all__ = ["DETR", "DetrSpec", "postprocess", "sine_position_encoding", "downsample_mask"]

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
                 feature_layer: str = "layer4", frozen_bn: bool = True, fine_level: bool = False) -> None:
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
        # ``fine_level``: also the layer before feature_layer (twice the resolution), for deformable attention
        fine = _LAYERS[_LAYERS.index(feature_layer) - 1]
        self.body = IntermediateLayerGetter(trunk, return_layers={fine: "fine", feature_layer: "out"} if fine_level
                                            else {feature_layer: "out"})
        self.num_channels = _BACKBONES[name][2] // (2 if feature_layer == "layer3" else 1)
        self.fine_channels = self.num_channels // 2
        prefixes = tuple(f"{layer}." for layer in train_layers if layer != "stem")
        prefixes += ("conv1.", "bn1.") if "stem" in train_layers else ()
        for pname, p in self.body.named_parameters():
            if not pname.startswith(prefixes):
                p.requires_grad_(False)

    def forward(self, images: Tensor) -> Tensor:
        return self.body(images)["out"]

    def levels(self, images: Tensor) -> tuple[Tensor, Tensor]:
        """(fine, out) feature maps; needs ``fine_level``."""
        features = self.body(images)
        return features["fine"], features["out"]


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
    return torch.cat((sine_embedding(y, half, temperature), sine_embedding(x, half, temperature)),
                     dim=3).permute(0, 3, 1, 2)


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

    def forward(self, tgt: Tensor, memory: Tensor, query_pos: Tensor, pos: Tensor, pad: Tensor,
                attn_mask: Tensor | None = None) -> Tensor:
        """``attn_mask`` [Q,Q] (True = may not attend) keeps query groups and denoising copies apart."""
        qk = tgt + query_pos
        sa = self.self_attn(qk, qk, tgt, attn_mask=attn_mask, need_weights=False)[0]
        tgt = self.norm1(tgt + self.drop1(sa))
        att = self.cross_attn(tgt + query_pos, memory + pos, memory, key_padding_mask=pad, need_weights=False)[0]
        tgt = self.norm2(tgt + self.drop2(att))
        return self.norm3(tgt + self.drop3(self.ff(tgt)))


@dataclass(frozen=True)
class DetrSpec:
    """A DETR's network: the paper's by default (ResNet-50, 6 + 6 layers of width 256, 100 queries),
    with the query options of :mod:`visiontrain.models.detr_queries` all off. The names are the
    ``task`` keys of the DETR recipes."""
    backbone: str = "resnet50"
    hidden_dim: int = 256
    nheads: int = 8
    enc_layers: int = 6
    dec_layers: int = 6
    dim_feedforward: int = 2048
    dropout: float = 0.1
    num_queries: int = 100
    pretrained_backbone: bool = False
    train_backbone_layers: Sequence[str] = ("layer2", "layer3", "layer4")
    feature_layer: str = "layer4"
    frozen_bn: bool = True
    sigmoid_class: bool = False
    queries: QueryOptions = QueryOptions()


class DETR(nn.Module):
    """DETR detector; see the module docstring.  ``forward(images, mask)`` returns
    ``{"pred_logits": [B,Q,C+1], "pred_boxes": [B,Q,4] (cxcywh in [0,1]), "aux_outputs": [...]}``
    where ``aux_outputs`` holds the same two entries for every decoder layer but the last.

    The options that shorten training (see :mod:`visiontrain.models.detr_queries`) change only what
    they must: ``sigmoid_class`` gives C class logits (no no-object column; a focal-loss head, its
    bias set so every class starts at probability 0.01); ``queries`` may add, in training only,
    ``enc_outputs`` (two-stage proposals), ``dn_outputs`` (denoising queries, with ``dn_slots``)
    and ``groups`` query sets side by side in ``pred_*``.  All off, the model, its parameter names
    and its outputs are the paper's.
    """

    def __init__(self, num_classes: int, spec: DetrSpec = DetrSpec()) -> None:
        super().__init__()
        s, queries = spec, spec.queries
        width, heads, ff, dropout = s.hidden_dim, s.nheads, s.dim_feedforward, s.dropout
        if num_classes < 1 or s.num_queries < 1 or s.dec_layers < 1 or s.enc_layers < 0:
            raise ValueError(f"DETR needs num_classes>=1, num_queries>=1, dec_layers>=1, enc_layers>=0; got "
                             f"{num_classes}, {s.num_queries}, {s.dec_layers}, {s.enc_layers}")
        if width % heads or width % 2:
            raise ValueError(f"hidden_dim ({width}) must be even and divisible by nheads ({heads})")
        if queries.reference_boxes and width % 4:
            raise ValueError(f"reference boxes need hidden_dim divisible by 4 (a sine pair per coordinate), "
                             f"got {width}")
        self.num_classes, self.num_queries, self.hidden_dim = num_classes, s.num_queries, width
        self.sigmoid_class, self.options = s.sigmoid_class, queries
        two_levels = queries.deformable_levels == 2
        self.backbone = Backbone(s.backbone, s.pretrained_backbone, tuple(s.train_backbone_layers),
                                 feature_layer=s.feature_layer, frozen_bn=s.frozen_bn, fine_level=two_levels)
        self.input_proj = nn.Conv2d(self.backbone.num_channels, width, kernel_size=1)
        if two_levels:  # the finer map joins the decoder's deformable attention only (not the encoder)
            self.fine_proj = nn.Sequential(nn.Conv2d(self.backbone.fine_channels, width, kernel_size=1),
                                           nn.GroupNorm(32 if width % 32 == 0 else 1, width))
        enc = EncoderLayer(width, heads, ff, dropout)
        self.encoder = nn.ModuleList(copy.deepcopy(enc) for _ in range(s.enc_layers))
        if queries.deformable_levels:
            self.decoder = deformable_layers(s.dec_layers, width, heads, ff, dropout,
                                             queries.deformable_levels, queries.deformable_points)
        else:
            dec = DecoderLayer(width, heads, ff, dropout)
            self.decoder = nn.ModuleList(copy.deepcopy(dec) for _ in range(s.dec_layers))
        self.decoder_norm = nn.LayerNorm(width)
        class_outputs = num_classes if s.sigmoid_class else num_classes + 1
        if queries.reference_boxes:
            self.queries = ReferenceQueries(queries, s.num_queries, num_classes, class_outputs, width, s.dec_layers)
        else:
            self.query_embed = nn.Embedding(s.num_queries * queries.groups, width)
        self.class_embed = nn.Linear(width, class_outputs)
        if not queries.reference_boxes:  # (created after class_embed: a seed gives the paper model's weights)
            self.bbox_embed = MLP(width, width, 4, 3)
        self._init_weights()

    def _init_weights(self) -> None:
        # Xavier on the transformer's matrices, as in the paper's code: the default MHA/Linear
        # inits give a badly scaled residual stream at 6+6 layers.
        for module in (self.encoder, self.decoder) if not self.options.deformable_levels else (self.encoder,):
            for p in module.parameters():
                if p.dim() > 1:
                    nn.init.xavier_uniform_(p)
        if self.sigmoid_class:  # focal-loss heads start every class at p = 0.01 (RetinaNet's prior)
            prior = -math.log((1 - 0.01) / 0.01)
            for head in (self.class_embed, getattr(getattr(self, "queries", None), "enc_class", None)):
                if head is not None:
                    nn.init.constant_(head.bias, prior)

    def encode_image(self, images: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Images [B,3,H,W] + padding mask [B,H,W] -> projected features [B,D,h,w] + mask [B,h,w]."""
        if mask.shape != (images.shape[0], *images.shape[-2:]):
            raise ValueError(f"mask must be [B,H,W] = {(images.shape[0], *images.shape[-2:])}, got {tuple(mask.shape)}")
        feat = self.backbone(images)
        return self.input_proj(feat), downsample_mask(mask, feat.shape[-2:])

    def forward_features(self, feat: Tensor, mask: Tensor, targets: Sequence[dict[str, Tensor]] | None = None,
                         fine: tuple[Tensor, Tensor] | None = None) -> dict:
        """Transformer + heads from projected features [B,D,h,w] and their padding mask [B,h,w];
        ``targets`` (normalised cxcywh) feed the denoising queries when training; ``fine`` (a
        projected finer map and its mask) is the second level of two-level deformable attention.

        Split from :meth:`forward` so the mask handling of the transformer can be checked (and
        features reused) without running the backbone.
        """
        pos = sine_position_encoding(mask, self.hidden_dim).to(feat.dtype).flatten(2).transpose(1, 2)
        src = feat.flatten(2).transpose(1, 2)  # [B,hw,D]
        pad = mask.flatten(1)  # [B,hw]
        for layer in self.encoder:
            src = layer(src, pos, pad)
        if not self.options.reference_boxes:
            return self._learned_queries(src, pos, pad)
        levels = None
        if self.options.deformable_levels:
            levels = [(src.transpose(1, 2).reshape(feat.shape), mask)]
            levels = [fine, *levels] if fine is not None else levels
        return self._reference_queries(src, pos, pad, feat.shape[-2:], targets, levels)

    def _learned_queries(self, src: Tensor, pos: Tensor, pad: Tensor) -> dict:
        """The paper's decoder: learned positions, zero targets (and query groups when training)."""
        groups = self.options.groups if self.training else 1
        query_pos = self.query_embed.weight[None, :groups * self.num_queries].expand(src.shape[0], -1, -1)
        tgt = torch.zeros_like(query_pos)  # the decoder starts from zero targets; queries are positions
        attn_mask = query_attention_mask([self.num_queries] * groups, src.device) if groups > 1 else None
        hs = []
        for layer in self.decoder:
            tgt = layer(tgt, src, query_pos, pos, pad, attn_mask)
            hs.append(self.decoder_norm(tgt))  # the shared final norm feeds every layer's heads
        h = torch.stack(hs)  # [L,B,Q,D]
        return _layer_outputs(self.class_embed(h), self.bbox_embed(h).sigmoid())

    def _reference_queries(self, src: Tensor, pos: Tensor, pad: Tensor, shape: Sequence[int],
                           targets: Sequence[dict[str, Tensor]] | None, levels: list | None) -> dict:
        """Reference-box decoder: [denoising copies] + matching queries (one block per group)."""
        content, refs, enc_outputs = self.queries.matching_queries(src, pad, shape)
        groups = self.options.groups if self.training else 1
        sizes = [content.shape[1] // groups] * groups
        dn = None
        if self.training and targets is not None and self.options.dn_groups:
            dn = self.queries.denoising_queries(targets, src.device)
        if dn is not None:
            content, refs = torch.cat([dn[0], content], dim=1), torch.cat([dn[1], refs], dim=1)
            sizes = [dn[2]] * self.options.dn_groups + sizes
        attn_mask = query_attention_mask(sizes, src.device) if len(sizes) > 1 else None
        logits, boxes = self.queries.decode(self.decoder, self.decoder_norm, self.class_embed, src, pos, pad,
                                            content.to(src.dtype), refs, attn_mask, levels)
        n_dn = sum(sizes[:self.options.dn_groups]) if dn is not None else 0
        out = _layer_outputs(logits[:, :, n_dn:], boxes[:, :, n_dn:])
        if dn is not None:
            out["dn_outputs"] = {**_layer_outputs(logits[:, :, :n_dn], boxes[:, :, :n_dn]), "dn_slots": dn[2]}
        if enc_outputs is not None:
            out["enc_outputs"] = enc_outputs
        return out

    def forward(self, images: Tensor, mask: Tensor | None = None,
                targets: Sequence[dict[str, Tensor]] | None = None) -> dict:
        """``mask`` [B,H,W], True = padding; None means no padding anywhere. ``targets``: only the
        denoising queries read them (training only)."""
        if mask is None:
            mask = torch.zeros((images.shape[0], *images.shape[-2:]), dtype=torch.bool, device=images.device)
        if self.options.deformable_levels != 2:
            return self.forward_features(*self.encode_image(images, mask), targets)
        if mask.shape != (images.shape[0], *images.shape[-2:]):
            raise ValueError(f"mask must be [B,H,W] = {(images.shape[0], *images.shape[-2:])}, got {tuple(mask.shape)}")
        fine, feat = self.backbone.levels(images)
        feat = self.input_proj(feat)
        fine = (self.fine_proj(fine), downsample_mask(mask, fine.shape[-2:]))
        return self.forward_features(feat, downsample_mask(mask, feat.shape[-2:]), targets, fine)

    @staticmethod
    def postprocess(outputs: dict, orig_sizes: Tensor, *, sigmoid: bool = False) -> list[dict[str, Tensor]]:
        """See :func:`postprocess`."""
        return postprocess(outputs, orig_sizes, sigmoid=sigmoid)


def _layer_outputs(logits: Tensor, boxes: Tensor) -> dict:
    """Per-layer heads [L,B,Q,*] -> the last layer's as ``pred_*`` and the others' as ``aux_outputs``."""
    return {"pred_logits": logits[-1], "pred_boxes": boxes[-1],
            "aux_outputs": [{"pred_logits": lg, "pred_boxes": bx} for lg, bx in zip(logits[:-1], boxes[:-1])]}


SIGMOID_TOP_K = 100  # (query, class) pairs a sigmoid head keeps per image, as Deformable DETR


@torch.no_grad()
def postprocess(outputs: dict, orig_sizes: Tensor, *, sigmoid: bool = False, top_k: int = SIGMOID_TOP_K
                ) -> list[dict[str, Tensor]]:
    """Model outputs -> per image ``{"scores": [K], "labels": [K], "boxes": [K,4]}``, minus boxes
    that are degenerate after clipping.

    Softmax heads (the paper): one entry per query (K = Q), scored by the softmax probability of the
    best real class (the no-object column is dropped after the softmax, so it still takes
    probability mass).  Sigmoid heads (``sigmoid``, the focal-loss option): the ``top_k`` best
    (query, class) pairs over all Q x C sigmoid scores, as Deformable DETR does, so a query unsure
    between two classes can offer both.  Boxes are absolute ``xyxy`` pixels of the original image,
    ``orig_sizes`` [B,2] giving (height, width), clipped to it (a box is in the image it was
    predicted for; the centre always is).  No score threshold: evaluation (COCO mAP) wants every
    candidate ranked by score.
    """
    logits, boxes = outputs["pred_logits"], outputs["pred_boxes"]
    if orig_sizes.shape != (logits.shape[0], 2):
        raise ValueError(f"orig_sizes must be [B,2] (h, w) with B={logits.shape[0]}, got {tuple(orig_sizes.shape)}")
    if sigmoid:
        num_classes = logits.shape[-1]
        flat = logits.float().sigmoid().flatten(1)  # [B, Q*C]
        scores, index = flat.topk(min(top_k, flat.shape[1]), dim=1)
        labels = index % num_classes
        boxes = boxes.gather(1, (index // num_classes)[..., None].expand(-1, -1, 4))
    else:
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
