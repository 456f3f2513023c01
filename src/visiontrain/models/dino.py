"""DINO's network: a timm backbone, the projection head, and the multi-crop wrapper.

Only what timm lacks lives here. The backbone is any timm model built with ``num_classes=0`` (its
pooled features: a ViT's class token, a ResNet's global average); a ViT is made with
``dynamic_img_size`` so that one network sees both the global and the smaller local crops.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from visiontrain.models import _timm, suggest_models


def build_backbone(name: str, *, in_channels: int, image_size: int, patch_size: int | None,
                   drop_path_rate: float, extra: dict[str, Any]) -> nn.Module:
    """A timm feature extractor (``num_classes=0``). ViT-style models get ``img_size``,
    ``patch_size`` and ``dynamic_img_size=True`` (position embeddings resampled for the local crops)."""
    timm = _timm()
    if not timm.is_model(name):
        hints = suggest_models(name)
        raise ValueError(f"task.backbone: unknown timm model {name!r}"
                         + (f"; close names: {', '.join(hints)}" if hints else ""))
    args: dict[str, Any] = dict(pretrained=False, num_classes=0, in_chans=in_channels, **extra)
    if drop_path_rate:
        args["drop_path_rate"] = drop_path_rate
    vit_args = dict(img_size=image_size, dynamic_img_size=True)
    if patch_size is not None:
        vit_args["patch_size"] = patch_size
    try:
        return timm.create_model(name, **args, **vit_args)
    except TypeError as e:  # not a ViT: no img_size / patch_size / dynamic_img_size
        if patch_size is not None:
            raise ValueError(f"task.patch_size={patch_size} but timm model {name!r} takes no patch size "
                             f"({e}); set task.patch_size=null") from e
        return timm.create_model(name, **args)


def set_fused_attention(module: nn.Module, fused: bool) -> int:
    """Switch timm's attention layers (those with a ``fused_attn`` flag) between
    ``F.scaled_dot_product_attention`` and the plain ``softmax(q k^T) v``: the same function, but on
    the CPU the fused kernel's backward is the slower one for short token sequences. Returns how
    many layers were switched."""
    switched = 0
    for m in module.modules():
        if hasattr(m, "fused_attn"):
            m.fused_attn = fused
            switched += 1
    return switched


class DinoHead(nn.Module):
    """MLP (``layers`` linear layers, GELU) to a bottleneck, L2 normalisation, then a weight-normalised
    linear layer to ``out_dim`` prototypes. With ``norm_last_layer`` the weight norm's magnitude is
    fixed at 1 (not trained): the paper's choice for stability."""

    def __init__(self, in_dim: int, out_dim: int, *, hidden_dim: int = 2048, bottleneck_dim: int = 256,
                 layers: int = 3, use_bn: bool = False, norm_last_layer: bool = True) -> None:
        super().__init__()
        if layers < 1:
            raise ValueError(f"task.head_layers must be >= 1, got {layers}")
        dims = [in_dim] + [hidden_dim] * (layers - 1) + [bottleneck_dim]
        mods: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
            mods.append(nn.Linear(a, b))
            if i < layers - 1:
                if use_bn:
                    mods.append(nn.BatchNorm1d(b))
                mods.append(nn.GELU())
        self.mlp = nn.Sequential(*mods)
        self.apply(self._init)
        self.last_layer = nn.utils.parametrizations.weight_norm(nn.Linear(bottleneck_dim, out_dim, bias=False))
        magnitude = self.last_layer.parametrizations.weight.original0
        with torch.no_grad():
            magnitude.fill_(1.0)
        magnitude.requires_grad_(not norm_last_layer)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.normalize(self.mlp(x), dim=-1, p=2)
        return self.last_layer(x)


class MultiCropWrapper(nn.Module):
    """Runs a list of crops through backbone + head, one backbone forward per run of crops with the
    same resolution (the two global crops together, then the local ones), and the head once."""

    def __init__(self, backbone: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, crops: Sequence[torch.Tensor] | torch.Tensor, features_only: bool = False) -> torch.Tensor:
        """Head outputs; or, with ``features_only``, the backbone's features (k-NN evaluation: through
        this forward rather than ``self.backbone``, so an FSDP-sharded wrapper gathers its parameters)."""
        if isinstance(crops, torch.Tensor):
            crops = [crops]
        feats, start = [], 0
        while start < len(crops):  # shapes are host-side ints: no device read
            end = start + 1
            while end < len(crops) and crops[end].shape[-2:] == crops[start].shape[-2:]:
                end += 1
            feats.append(self.backbone(torch.cat(list(crops[start:end]))))
            start = end
        return torch.cat(feats) if features_only else self.head(torch.cat(feats))


def dino_loss(student_out: torch.Tensor, teacher_out: torch.Tensor, center: torch.Tensor, *,
              student_temp: float, teacher_temp: float, n_global: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy between the teacher's centred, sharpened distribution of each global crop and
    the student's distribution of every *other* crop, averaged over those pairs.

    ``student_out`` [n_crops * B, K] (globals first), ``teacher_out`` [n_global * B, K] (no grad).
    Returns ``(loss, teacher_probs [n_global, B, K])``.
    """
    batch = teacher_out.shape[0] // n_global
    n_crops = student_out.shape[0] // batch
    log_p = F.log_softmax(student_out.float() / student_temp, dim=-1).view(n_crops, batch, -1)
    q = F.softmax((teacher_out.float() - center) / teacher_temp, dim=-1).view(n_global, batch, -1)
    cross = -torch.einsum("tbk,sbk->ts", q, log_p) / batch           # [n_global, n_crops] mean over batch
    same = torch.eye(n_global, n_crops, dtype=torch.bool, device=cross.device)  # a crop vs itself
    return cross.masked_fill(same, 0.0).sum() / (n_global * n_crops - n_global), q


@torch.no_grad()
def update_center(center: torch.Tensor, teacher_out: torch.Tensor, momentum: float) -> None:
    """center <- m * center + (1 - m) * mean teacher output, the mean taken over every rank's batch
    (an all-reduce: a collective, not a host read)."""
    batch_sum = teacher_out.float().sum(0, keepdim=True)
    count = teacher_out.shape[0]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(batch_sum)
        count *= torch.distributed.get_world_size()
    center.mul_(momentum).add_(batch_sum, alpha=(1.0 - momentum) / count)
