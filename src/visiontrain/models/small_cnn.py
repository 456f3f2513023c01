"""A small CNN for 8x8 .. ~64x64 images (Fashion-MNIST, digits, CIFAR-sized inputs)."""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor, nn


def _conv_bn_relu(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel_size=3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(inplace=True),
    )


class SmallCNN(nn.Module):
    """Blocks of conv3x3+BN+ReLU (the last block has two convs), each followed by a 2x2 max-pool
    unless that would take the feature map below 2x2; then global average pool, dropout, linear.

    Works for any input side >= 8 (an 8x8 input pools 8 -> 4 -> 2, and the last pool is skipped).
    """

    def __init__(self, in_channels: int, num_classes: int, widths: Sequence[int] = (32, 64, 128),
                 dropout: float = 0.2) -> None:
        super().__init__()
        if in_channels < 1 or num_classes < 1 or not widths:
            raise ValueError(f"SmallCNN needs in_channels>=1, num_classes>=1 and widths; got "
                             f"{in_channels}, {num_classes}, {tuple(widths)}")
        blocks, c = [], in_channels
        for i, w in enumerate(widths):
            layers = [_conv_bn_relu(c, w)]
            if i == len(widths) - 1:
                layers.append(_conv_bn_relu(w, w))
            blocks.append(nn.Sequential(*layers))
            c = w
        self.blocks = nn.ModuleList(blocks)
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(c, num_classes)
        self.num_features = c
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward_features(self, x: Tensor) -> Tensor:
        """Pooled features [B, widths[-1]]."""
        for block in self.blocks:
            x = block(x)
            if min(x.shape[-2], x.shape[-1]) // 2 >= 2:
                x = F.max_pool2d(x, 2)
        return x.mean(dim=(-2, -1))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.dropout(self.forward_features(x)))
