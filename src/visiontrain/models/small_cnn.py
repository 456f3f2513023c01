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
    """Blocks of conv3x3+BN+ReLU, each followed by a 2x2 max-pool unless that would take the feature
    map below 2x2; then the head: global average pool, dropout, linear (``head="avgpool"``), or
    flatten, dropout, linear (``head="flatten"``: the spatial layout reaches the classifier, which
    on 28 px inputs learns as well with fewer convolutions). ``double_last``: the last block has a
    second conv. ``init``: "kaiming" draws the convolutions from He et al.'s normal (fan-out, for
    ReLU); "torch" keeps PyTorch's layer defaults (uniform, smaller), as a hand-written model has.

    Works for any input side >= 8 (an 8x8 input pools 8 -> 4 -> 2, and the last pool is skipped);
    ``head="flatten"`` needs the input side, ``image_size``, to size the classifier.
    """

    def __init__(self, in_channels: int, num_classes: int, widths: Sequence[int] = (32, 64, 128),
                 dropout: float = 0.2, *, double_last: bool = True, head: str = "avgpool",
                 image_size: int | None = None, init: str = "kaiming") -> None:
        super().__init__()
        if in_channels < 1 or num_classes < 1 or not widths:
            raise ValueError(f"SmallCNN needs in_channels>=1, num_classes>=1 and widths; got "
                             f"{in_channels}, {num_classes}, {tuple(widths)}")
        if head not in ("avgpool", "flatten"):
            raise ValueError(f"task.model_args.head: expected avgpool or flatten, got {head!r}")
        if init not in ("kaiming", "torch"):
            raise ValueError(f"task.model_args.init: expected kaiming or torch, got {init!r}")
        if head == "flatten" and not image_size:
            raise ValueError("SmallCNN with head=flatten needs the input size (image_size)")
        blocks, c = [], in_channels
        for i, w in enumerate(widths):
            layers = [_conv_bn_relu(c, w)]
            if double_last and i == len(widths) - 1:
                layers.append(_conv_bn_relu(w, w))
            blocks.append(nn.Sequential(*layers))
            c = w
        self.blocks = nn.ModuleList(blocks)
        self.flatten = head == "flatten"
        side = image_size or 0
        for _ in widths:
            side = side // 2 if side // 2 >= 2 else side  # the pooling rule of forward_features
        self.dropout = nn.Dropout(dropout)
        self.num_features = c * side * side if self.flatten else c
        self.head = nn.Linear(self.num_features, num_classes)
        for m in self.modules():
            if init == "kaiming" and isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward_features(self, x: Tensor) -> Tensor:
        """Features [B, num_features]: pooled over space, or flattened with ``head="flatten"``."""
        for block in self.blocks:
            x = block(x)
            if min(x.shape[-2], x.shape[-1]) // 2 >= 2:
                x = F.max_pool2d(x, 2)
        return x.flatten(1) if self.flatten else x.mean(dim=(-2, -1))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.dropout(self.forward_features(x)))
