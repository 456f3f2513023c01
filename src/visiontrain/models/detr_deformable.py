"""Deformable cross-attention (Zhu et al. 2021, "Deformable DETR"), in plain PyTorch via ``grid_sample``.

Why DETR's decoder learns slowly: each query's cross-attention starts uniform over every cell of
the image, so early on a query's features are the mean of the whole image and carry nothing about
its object; learning to look at the right cells takes most of the paper's 500 epochs. Deformable
attention instead samples a few points (``points`` per head and level) around the query's
reference box, at offsets and with weights predicted from the query, from one or more feature
maps: like RoIAlign, a query sees its box from the first step.

Sampling locations are ``centre + offset / points * size / 2`` (box-relative, as Deformable DETR
does with box references), in coordinates normalised by each image's *real* extent; ``valid``
ratios map them into the padded feature map. Padding cells hold zero values.
"""
from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["DeformableCrossAttention", "DeformableDecoderLayer", "valid_ratios"]

Levels = Sequence[tuple[Tensor, Tensor]]  # (values [B,D,h,w], padding mask [B,h,w]) per level, fine to coarse


def valid_ratios(pad: Tensor) -> Tensor:
    """[B,h,w] padding mask -> [B,2] (real width / w, real height / h)."""
    real = ~pad
    h, w = pad.shape[1:]
    return torch.stack([real[:, 0, :].sum(1).float() / w, real[:, :, 0].sum(1).float() / h], dim=-1)


class DeformableCrossAttention(nn.Module):
    """Multi-scale deformable attention of queries [B,Q,D] to ``levels`` around boxes [B,Q,4]."""

    def __init__(self, d: int, heads: int, levels: int, points: int) -> None:
        super().__init__()
        if d % heads:
            raise ValueError(f"deformable attention: hidden_dim ({d}) must be divisible by nheads ({heads})")
        self.heads, self.levels, self.points = heads, levels, points
        self.sampling_offsets = nn.Linear(d, heads * levels * points * 2)
        self.attention_weights = nn.Linear(d, heads * levels * points)
        self.value_proj, self.output_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Deformable DETR's start: head k samples along direction 2*pi*k/heads, point i at distance
        i+1, with uniform weights; value and output projections Xavier."""
        nn.init.zeros_(self.sampling_offsets.weight)
        theta = torch.arange(self.heads, dtype=torch.float32) * (2 * math.pi / self.heads)
        grid = torch.stack([theta.cos(), theta.sin()], -1)
        grid = (grid / grid.abs().max(-1, keepdim=True).values)[:, None, None, :]
        grid = grid.repeat(1, self.levels, self.points, 1) * torch.arange(1, self.points + 1)[None, None, :, None]
        with torch.no_grad():
            self.sampling_offsets.bias.copy_(grid.flatten())
        nn.init.zeros_(self.attention_weights.weight)
        nn.init.zeros_(self.attention_weights.bias)
        for proj in (self.value_proj, self.output_proj):
            nn.init.xavier_uniform_(proj.weight)
            nn.init.zeros_(proj.bias)

    def forward(self, query: Tensor, boxes: Tensor, levels: Levels) -> Tensor:
        b, q, d = query.shape
        h_, l_, p_ = self.heads, self.levels, self.points
        if len(levels) != l_:
            raise ValueError(f"deformable attention built for {l_} levels, given {len(levels)}")
        offsets = self.sampling_offsets(query).view(b, q, h_, l_, p_, 2)
        weights = self.attention_weights(query).view(b, q, h_, l_ * p_).softmax(-1).view(b, q, h_, l_, p_)
        centre, size = boxes[..., None, None, None, :2], boxes[..., None, None, None, 2:]
        locations = centre + offsets / p_ * size * 0.5  # [B,Q,H,L,P,2], normalised by the real extent
        sampled = []
        for level, (values, pad) in enumerate(levels):
            hl, wl = values.shape[-2:]
            v = self.value_proj(values.flatten(2).transpose(1, 2)).masked_fill(pad.flatten(1)[..., None], 0.0)
            v = v.view(b, hl * wl, h_, d // h_).permute(0, 2, 3, 1).reshape(b * h_, d // h_, hl, wl)
            loc = locations[:, :, :, level] * valid_ratios(pad)[:, None, None, None, :]  # into the padded map
            grid = (2 * loc - 1).transpose(1, 2).reshape(b * h_, q, p_, 2).to(v.dtype)
            sampled.append(F.grid_sample(v, grid, mode="bilinear", padding_mode="zeros", align_corners=False))
        stacked = torch.stack(sampled, dim=-2)  # [B*H, D/H, Q, L, P]
        w = weights.transpose(1, 2).reshape(b * h_, 1, q, l_, p_).to(stacked.dtype)
        out = (stacked * w).sum((-1, -2)).view(b, d, q).transpose(1, 2)  # heads back to channels
        return self.output_proj(out)


class DeformableDecoderLayer(nn.Module):
    """Post-norm query self-attention (positions on queries and keys), deformable cross-attention
    around each query's reference box, FFN: the paper's decoder layer with the cross-attention
    swapped."""

    def __init__(self, d: int, nheads: int, ff: int, dropout: float, levels: int, points: int) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d, nheads, dropout=dropout, batch_first=True)
        self.cross_attn = DeformableCrossAttention(d, nheads, levels, points)
        self.ff = nn.Sequential(nn.Linear(d, ff), nn.ReLU(inplace=True), nn.Dropout(dropout), nn.Linear(ff, d))
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.drop1, self.drop2, self.drop3 = nn.Dropout(dropout), nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, tgt: Tensor, query_pos: Tensor, boxes: Tensor, levels: Levels,
                attn_mask: Tensor | None = None) -> Tensor:
        qk = tgt + query_pos
        tgt = self.norm1(tgt + self.drop1(self.self_attn(qk, qk, tgt, attn_mask=attn_mask, need_weights=False)[0]))
        tgt = self.norm2(tgt + self.drop2(self.cross_attn(tgt + query_pos, boxes, levels)))
        return self.norm3(tgt + self.drop3(self.ff(tgt)))


def deformable_layers(n: int, d: int, nheads: int, ff: int, dropout: float, levels: int, points: int
                      ) -> nn.ModuleList:
    """``n`` decoder layers; self-attention and FFN Xavier-initialised like the paper's decoder, the
    deformable attention keeping its own start."""
    layer = DeformableDecoderLayer(d, nheads, ff, dropout, levels, points)
    for name, p in layer.named_parameters():
        if p.dim() > 1 and not name.startswith("cross_attn."):
            nn.init.xavier_uniform_(p)
    return nn.ModuleList(copy.deepcopy(layer) for _ in range(n))
