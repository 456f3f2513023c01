"""Decoder queries that make DETR converge in thousands of steps instead of hundreds of thousands.

The paper's queries are learned positions that start anywhere and must discover, through the
Hungarian loss alone, where objects tend to be; on a few thousand images that takes longer than a
small budget has (facebookresearch/detr#125). Each option here gives the decoder a better start or
more supervision, and each is off unless asked for:

- **Reference boxes** (DAB-DETR; Deformable DETR's iterative refinement): every query carries a box;
  its positional query is an MLP of the box's sine embedding (the same frequencies as the memory's
  positions, so query and key positions are comparable), and each decoder layer predicts a
  correction in inverse-sigmoid space (``box = sigmoid(delta + logit(ref))``). With ``refine`` the
  corrected box, detached, is the next layer's reference; without it every layer starts from the
  same reference.
- **Two-stage query selection** (Deformable DETR two-stage, RT-DETR): every encoder token predicts
  a class and a box around an anchor at its cell; the top-k tokens by class score become the
  decoder's reference boxes and (detached) content. Their predictions are returned as
  ``enc_outputs`` so the criterion can supervise them like a one-stage detector.
- **Query groups** (Group DETR): ``groups`` copies of the query set during training, each matched
  one-to-one on its own and unable to see the others in self-attention, so every object trains
  ``groups`` queries; evaluation uses group 0 alone.
- **Denoising queries** (DN-DETR): during training, ``dn_groups`` copies of the ground truth, labels
  flipped with probability ``dn_label_noise`` and boxes jittered by up to ``dn_box_noise`` of
  their size, are reconstructed by extra queries whose target is known (no matching). An attention
  mask stops the matching queries from seeing them and the copies from seeing each other.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["QueryOptions", "ReferenceQueries", "inverse_sigmoid", "box_sine_embedding", "sine_embedding",
           "query_attention_mask", "cell_anchors"]


@dataclass(frozen=True)
class QueryOptions:
    """Which of the faster-converging query options a DETR uses (all off = the paper's DETR)."""

    box_refine: bool = False
    two_stage: bool = False
    groups: int = 1
    dn_groups: int = 0
    dn_label_noise: float = 0.2
    dn_box_noise: float = 0.4
    deformable_levels: int = 0
    deformable_points: int = 4

    def __post_init__(self) -> None:
        if self.deformable_levels not in (0, 1, 2) or self.deformable_points < 1:
            raise ValueError(f"deformable attention takes 0 (off), 1 or 2 levels and >= 1 points, got "
                             f"{self.deformable_levels}, {self.deformable_points}")
        if self.groups < 1 or self.dn_groups < 0:
            raise ValueError(f"query groups must be >= 1 and denoising groups >= 0, "
                             f"got {self.groups}, {self.dn_groups}")
        if not (0.0 <= self.dn_label_noise <= 1.0 and 0.0 <= self.dn_box_noise <= 1.0):
            raise ValueError(f"dn_label_noise and dn_box_noise must be in [0, 1], got "
                             f"{self.dn_label_noise}, {self.dn_box_noise}")

    @property
    def reference_boxes(self) -> bool:
        """Queries carry boxes: asked for directly, or needed by two-stage selection and denoising
        (a noised ground-truth box is a reference box)."""
        return self.box_refine or self.two_stage or self.dn_groups > 0 or self.deformable_levels > 0


def inverse_sigmoid(x: Tensor, eps: float = 1e-5) -> Tensor:
    """logit(x), clamped so boxes at 0 or 1 stay finite."""
    x = x.clamp(0, 1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


def sine_embedding(coord: Tensor, half: int, temperature: float = 10000.0) -> Tensor:
    """``coord`` [...] (already scaled, e.g. to [0, 2pi]) -> [..., half]: pairs of channels share the
    frequency ``temperature ** (2k/half)`` and hold (sin, cos)."""
    k = torch.arange(half, dtype=torch.float32, device=coord.device)
    freqs = temperature ** (2 * torch.div(k, 2, rounding_mode="floor") / half)
    phase = coord[..., None] / freqs
    return torch.stack((phase[..., 0::2].sin(), phase[..., 1::2].cos()), dim=-1).flatten(-2)


def box_sine_embedding(boxes: Tensor, dim: int) -> Tensor:
    """Normalised cxcywh boxes [..., 4] -> [..., 2*dim]: (cy, cx) encoded exactly as the memory's
    positions (``dim/2`` channels each, y first), then (w, h)."""
    scaled = boxes.float() * (2 * math.pi)
    cx, cy, w, h = scaled.unbind(-1)
    return torch.cat([sine_embedding(c, dim // 2) for c in (cy, cx, w, h)], dim=-1)


def query_attention_mask(sizes: Sequence[int], device: torch.device | None = None) -> Tensor:
    """Self-attention mask [Q, Q] (True = may not attend) for queries made of consecutive blocks of
    ``sizes``: each block (a denoising copy or a query group) sees only itself."""
    total = sum(sizes)
    mask = torch.ones(total, total, dtype=torch.bool, device=device)
    start = 0
    for n in sizes:
        mask[start:start + n, start:start + n] = False
        start += n
    return mask


ANCHOR_CELLS = 3  # side of the two-stage anchors, in feature cells


def cell_anchors(pad: Tensor) -> tuple[Tensor, Tensor]:
    """One anchor box per feature cell, normalised by each image's real extent: centre at the
    cell's centre, ``ANCHOR_CELLS`` cells a side (Deformable DETR's ``0.05 * 2**level`` boxes are
    5 cells at every level of an 800-px image; objects here span 1-5 cells of a stride-16 map).
    ``pad`` [B,h,w] (True = padding) -> (anchor logits [B,h*w,4], valid [B,h*w])."""
    real = ~pad
    rows = real[:, :, 0].sum(1).clamp(min=1).float()  # [B] real rows
    cols = real[:, 0, :].sum(1).clamp(min=1).float()
    h, w = pad.shape[1:]
    cy = (torch.arange(h, device=pad.device, dtype=torch.float32) + 0.5)[None, :, None] / rows[:, None, None]
    cx = (torch.arange(w, device=pad.device, dtype=torch.float32) + 0.5)[None, None, :] / cols[:, None, None]
    bw = (ANCHOR_CELLS / cols).clamp(max=1.0)[:, None, None].expand_as(cx * cy)
    bh = (ANCHOR_CELLS / rows).clamp(max=1.0)[:, None, None].expand_as(cx * cy)
    anchors = torch.stack(torch.broadcast_tensors(cx, cy, bw, bh), dim=-1).flatten(1, 2)  # [B,hw,4]
    valid = ((anchors[..., :2] > 0.01) & (anchors[..., :2] < 0.99)).all(-1) & real.flatten(1)
    return inverse_sigmoid(anchors), valid


class MLP(nn.Module):
    """Linear layers with ReLU between them."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int, num_layers: int) -> None:
        super().__init__()
        dims = [d_in] + [d_hidden] * (num_layers - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else F.relu(layer(x))
        return x


def _zero_last(mlp: MLP) -> MLP:
    """A box-correction head that starts at zero: the first boxes are the references themselves."""
    nn.init.zeros_(mlp.layers[-1].weight)
    nn.init.zeros_(mlp.layers[-1].bias)
    return mlp


class ReferenceQueries(nn.Module):
    """Builds the reference-box queries and runs the DETR decoder layers over them.

    ``class_head`` is the model's (shared by every layer and, for two-stage, not by the encoder:
    the encoder's tokens get their own head, as in Deformable DETR).
    """

    def __init__(self, options: QueryOptions, num_queries: int, num_classes: int, class_outputs: int,
                 hidden_dim: int, dec_layers: int) -> None:
        super().__init__()
        self.options, self.num_queries, self.num_classes = options, num_queries, num_classes
        self.hidden_dim = hidden_dim
        d = hidden_dim
        self.ref_point_head = MLP(2 * d, d, d, 2)
        self.box_heads = nn.ModuleList(_zero_last(MLP(d, d, 4, 3)) for _ in range(dec_layers))
        if options.two_stage:
            self.enc_output = nn.Sequential(nn.Linear(d, d), nn.LayerNorm(d))
            self.enc_class = nn.Linear(d, class_outputs)
            self.enc_box = _zero_last(MLP(d, d, 4, 3))
            self.group_embed = nn.Embedding(options.groups, d) if options.groups > 1 else None
        else:
            self.tgt_embed = nn.Embedding(num_queries * options.groups, d)
            self.ref_embed = nn.Embedding(num_queries * options.groups, 4)
            with torch.no_grad():  # centres spread over the image, boxes a tenth of its side
                self.ref_embed.weight[:, :2].uniform_(0, 1)
                self.ref_embed.weight[:, 2:] = 0.1
                self.ref_embed.weight.copy_(inverse_sigmoid(self.ref_embed.weight))
        if options.dn_groups:
            self.label_embed = nn.Embedding(num_classes + 1, d)  # the last entry pads absent objects

    def matching_queries(self, memory: Tensor, pad: Tensor, shape: Sequence[int]
                         ) -> tuple[Tensor, Tensor, dict | None]:
        """(content [B,G*Q,D], reference logits [B,G*Q,4], enc_outputs or None); G = groups when
        training, 1 when evaluating."""
        b, groups = memory.shape[0], self.options.groups if self.training else 1
        if not self.options.two_stage:
            n = groups * self.num_queries
            return (self.tgt_embed.weight[None, :n].expand(b, -1, -1),
                    self.ref_embed.weight[None, :n].expand(b, -1, -1), None)
        anchors, valid = cell_anchors(pad.view(b, *shape))
        feat = self.enc_output(memory.masked_fill(~valid[..., None], 0.0))
        logits = self.enc_class(feat)
        box_logits = self.enc_box(feat) + anchors.to(feat.dtype)
        # the best real class scores a token (a softmax head's last column is no-object); padding and
        # edge cells are never picked
        score = logits[..., :self.num_classes].max(-1).values.masked_fill(~valid, -1e4)
        top = score.topk(min(self.num_queries, score.shape[1]), dim=1).indices  # [B,Q] (or all cells)
        if top.shape[1] < self.num_queries:  # a map with fewer cells than queries: the best repeat
            top = top.repeat(1, -(-self.num_queries // top.shape[1]))[:, :self.num_queries]
        pick = lambda t: t.gather(1, top[..., None].expand(-1, -1, t.shape[-1]))  # noqa: E731
        top_logits, top_boxes, content = pick(logits), pick(box_logits), pick(feat).detach()
        enc_outputs = {"pred_logits": top_logits, "pred_boxes": top_boxes.sigmoid()}
        refs = top_boxes.detach()
        if groups > 1:  # every group starts from the same proposals, told apart by a learned embedding
            content = (content[:, None] + self.group_embed.weight[None, :, None]).flatten(1, 2)
            refs = refs.repeat(1, groups, 1)
        return content, refs, enc_outputs

    def denoising_queries(self, targets: Sequence[dict[str, Tensor]], device: torch.device
                          ) -> tuple[Tensor, Tensor, int] | None:
        """(content [B,G*S,D], reference logits [B,G*S,4], S) from noised copies of the targets, S
        the most targets of any image (shapes only: no host read); None if there are none."""
        counts = [t["labels"].shape[0] for t in targets]
        slots, groups, b = max(counts, default=0), self.options.dn_groups, len(targets)
        if slots == 0:
            return None
        labels = torch.full((b, slots), self.num_classes, dtype=torch.int64, device=device)
        boxes = torch.full((b, slots, 4), 0.5, device=device)
        for i, t in enumerate(targets):
            labels[i, :counts[i]] = t["labels"].to(device)
            boxes[i, :counts[i]] = t["boxes"].to(device=device, dtype=torch.float32)
        labels, boxes = labels.repeat(1, groups), boxes.repeat(1, groups, 1)  # [B,G*S], copy g at g*S
        flip = torch.rand(labels.shape, device=device) < self.options.dn_label_noise
        random_labels = torch.randint(0, self.num_classes, labels.shape, device=device)
        labels = torch.where(flip & (labels < self.num_classes), random_labels, labels)
        jitter = (torch.rand(boxes.shape, device=device) * 2 - 1) * self.options.dn_box_noise
        wh = boxes[..., 2:]
        noised = torch.cat([boxes[..., :2] + jitter[..., :2] * wh / 2, wh * (1 + jitter[..., 2:])], dim=-1)
        return self.label_embed(labels), inverse_sigmoid(noised.clamp(0.0, 1.0)), slots

    def decode(self, layers: nn.ModuleList, norm: nn.Module, class_head: nn.Module, memory: Tensor,
               pos: Tensor, pad: Tensor, content: Tensor, refs: Tensor, attn_mask: Tensor | None,
               levels: Sequence[tuple[Tensor, Tensor]] | None = None) -> tuple[Tensor, Tensor]:
        """Decoder layers over (content, reference logits) -> (logits [L,B,Q,C], boxes [L,B,Q,4]).
        With ``levels`` (feature maps and their padding) the layers are deformable: they sample
        around each reference box instead of attending to all of ``memory``."""
        ref = refs.sigmoid()
        tgt, hs, boxes = content, [], []
        for layer, box_head in zip(layers, self.box_heads):
            query_pos = self.ref_point_head(box_sine_embedding(ref, self.hidden_dim).to(memory.dtype))
            if levels is not None:
                tgt = layer(tgt, query_pos, ref, levels, attn_mask)
            else:
                tgt = layer(tgt, memory, query_pos, pos, pad, attn_mask)
            h = norm(tgt)
            box = (box_head(h) + inverse_sigmoid(ref)).sigmoid()
            if self.options.box_refine:
                ref = box.detach()
            hs.append(h)
            boxes.append(box)
        return class_head(torch.stack(hs)), torch.stack(boxes)
