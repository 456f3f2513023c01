"""Image operations on whole batches with a parameter per sample: crop-and-resize, flip, colour
jitter, grayscale, Gaussian blur, solarize.

Each is what the torchvision.transforms.v2 kernel of the same name does to one float image in
[0, 1], done to a batch [B, C, H, W] in a fixed number of tensor ops, whatever the parameters:
nothing branches on a value, so no op reads the device on the host and a batch on a GPU stays there.
A sample that an operation skips gets its identity parameter (a factor of 1, a delta kernel), or
keeps its input through ``torch.where``. Used by DINO's batched multi-crop (``multicrop_batched``).
"""
from __future__ import annotations

import torch
from torch import Tensor
import torch.nn.functional as F

GRAY_WEIGHTS = (0.2989, 0.587, 0.114)  # torchvision's rgb_to_grayscale (ITU-R 601-2 luma)


def channels_last(images: Tensor) -> Tensor:
    """A [B, C, H, W] batch with NHWC strides, one channel too. For C = 1 both layouts hold the same
    bytes, so ``contiguous(memory_format=channels_last)`` keeps the NCHW strides it has; a
    convolution then takes its input, and the layers after it theirs, for NCHW while their weights
    are channels_last, and converts at every layer (on an H200, ResNet-50 on grey images ran at 0.82
    of the hand-written loop, whose input was made NHWC). Re-striding a one-channel batch is a view."""
    images = images.contiguous(memory_format=torch.channels_last)
    if images.shape[1] == 1 and images.stride(1) != 1:
        b, _, h, w = images.shape
        images = images.as_strided(images.shape, (h * w, 1, w, 1))
    return images


def _cubic_aa(x: Tensor) -> Tensor:
    """The bicubic filter of PIL and of torch's antialiased interpolation (a = -0.5), support 2."""
    a, x = -0.5, x.abs()
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def resize_weights(start: Tensor, length: Tensor, out_size: int, in_size: int, flip: Tensor | None = None) -> Tensor:
    """[B, out_size, in_size]: row i holds the weights of output pixel i over the input pixels, for
    the window ``[start, start + length)`` of each sample resized to ``out_size`` pixels.

    The weights are those of ``F.interpolate(mode="bicubic", antialias=True)`` applied to the cropped
    window (torchvision's ``resized_crop``): PIL's antialiased bicubic, whose filter widens by the
    down-scaling factor, truncated at the window's edges and renormalised. ``flip`` (bool [B])
    reverses the output pixels: a horizontal flip after the resize, for free."""
    scale = (length / out_size).unsqueeze(-1)                                   # [B, 1]
    out = torch.arange(out_size, device=start.device, dtype=scale.dtype)
    if flip is not None:
        out = torch.where(flip.unsqueeze(-1), out_size - 1 - out, out)         # [B, out]
    center = start.unsqueeze(-1) + (out + 0.5) * scale                          # [B, out] in input pixels
    stretch = scale.clamp(min=1.0).unsqueeze(-1)                                # [B, 1, 1]
    pixel = torch.arange(in_size, device=start.device, dtype=scale.dtype) + 0.5
    w = _cubic_aa((pixel - center.unsqueeze(-1)) / stretch)                     # [B, out, in]
    inside = (pixel >= start.view(-1, 1, 1)) & (pixel < (start + length).view(-1, 1, 1))
    w = w * inside
    return w / w.sum(-1, keepdim=True)


def crop_resize(images: Tensor, boxes: Tensor, size: int, flip: Tensor | None = None) -> Tensor:
    """Each sample's box ``(x0, y0, w, h)`` in its own pixels (whole pixels: torchvision's crops)
    resized to ``size`` x ``size`` with antialiased bicubic weights, optionally flipped: two batched
    matrix products. ``images`` float [B, C, H, W]; a padded batch is fine (the boxes stay inside
    each image, and no weight reaches outside its box). Values are clamped to the input's range
    [0, 1], as the uint8 crop of the per-sample path is."""
    x0, y0, w, h = boxes.unbind(-1)
    wy = resize_weights(y0, h, size, images.shape[-2])
    wx = resize_weights(x0, w, size, images.shape[-1], flip)
    rows = torch.matmul(images, wx.transpose(1, 2).unsqueeze(1))               # [B, C, H, size]
    return torch.matmul(wy.unsqueeze(1), rows).clamp_(0.0, 1.0)                 # [B, C, size, size]


def _per_sample(v: Tensor) -> Tensor:
    return v.view(-1, 1, 1, 1)


def grayscale(x: Tensor) -> Tensor:
    """Luma [B, 1, H, W] of RGB images; a 1-channel image is its own."""
    if x.shape[1] == 1:
        return x
    r, g, b = x.unbind(1)
    return (r * GRAY_WEIGHTS[0] + g * GRAY_WEIGHTS[1] + b * GRAY_WEIGHTS[2]).unsqueeze(1)


def blend(x: Tensor, other: Tensor | float, factor: Tensor) -> Tensor:
    """torchvision's ``_blend``: factor * x + (1 - factor) * other, clamped to [0, 1]; a factor of
    exactly 1 leaves x as it is."""
    f = _per_sample(factor)
    return (f * x + (1.0 - f) * other).clamp_(0.0, 1.0)


def rgb_to_hsv(x: Tensor) -> Tensor:
    """[B, 3, H, W] RGB -> HSV, each in [0, 1] (PIL's formulas, as torchvision's ``_rgb_to_hsv``)."""
    r, g, b = x.unbind(1)
    maxc, minc = x.amax(1), x.amin(1)
    span = maxc - minc
    flat = span == 0
    s = span / torch.where(flat, torch.ones_like(maxc), maxc)
    span = torch.where(flat, torch.ones_like(span), span)
    rc, gc, bc = (maxc - r) / span, (maxc - g) / span, (maxc - b) / span
    h = torch.where(maxc == r, bc - gc, torch.where(maxc == g, 2.0 + rc - bc, 4.0 + gc - rc))
    h = torch.where(flat, torch.zeros_like(h), h)
    return torch.stack(((h / 6.0 + 1.0).fmod(1.0), s, maxc), 1)


def hsv_to_rgb(x: Tensor) -> Tensor:
    """[B, 3, H, W] HSV -> RGB: each channel n in (5, 3, 1) is v - v s clamp(min(k, 4 - k), 0, 1)
    with k = (n + 6 h) mod 6, the closed form of the six-sector table torchvision indexes."""
    h, s, v = x[:, 0:1], x[:, 1:2], x[:, 2:3]
    n = (5.0 - 2.0 * torch.arange(3, device=x.device, dtype=x.dtype)).view(1, 3, 1, 1)  # made on the device
    k = (n + 6.0 * h).remainder(6.0)
    return v - v * s * torch.minimum(k, 4.0 - k).clamp(0.0, 1.0)


def adjust_hue(x: Tensor, shift: Tensor) -> Tensor:
    """Hue rotated by ``shift`` [B] (a fraction of the circle, torchvision's hue_factor); RGB only."""
    hsv = rgb_to_hsv(x)
    hue = (hsv[:, :1] + _per_sample(shift)).remainder(1.0)
    return hsv_to_rgb(torch.cat((hue, hsv[:, 1:]), 1))


def color_jitter(x: Tensor, factors: Tensor, order: Tensor, apply: Tensor) -> Tensor:
    """torchvision's ColorJitter with a draw per sample: ``factors`` [B, 4] (brightness, contrast,
    saturation, hue), ``order`` [B, 4] the permutation of the four ops (torchvision draws one per
    call: ``randperm(4)``), ``apply`` bool [B] (RandomApply). Each of the four positions applies
    every op with the factor of the samples whose op it is there and an identity factor for the
    others (exact: a blend with factor 1 returns its input). On 1-channel images saturation and hue
    are no-ops, as in torchvision."""
    rgb = x.shape[1] == 3
    identity = (torch.arange(4, device=x.device) < 3).to(x.dtype)  # 1, 1, 1, 0: made on the device
    ops = range(4) if rgb else range(2)
    for position in range(4):
        chosen = (order[:, position:position + 1] == torch.arange(4, device=x.device)) & apply.unsqueeze(-1)
        f = torch.where(chosen, factors, identity)                            # [B, 4]
        for op in ops:
            if op == 0:
                x = blend(x, 0.0, f[:, 0])
            elif op == 1:
                x = blend(x, grayscale(x).mean((1, 2, 3), keepdim=True), f[:, 1])
            elif op == 2:
                x = blend(x, grayscale(x), f[:, 2])
            else:
                x = torch.where(_per_sample(chosen[:, 3]), adjust_hue(x, f[:, 3]), x)
    return x


def random_grayscale(x: Tensor, apply: Tensor) -> Tensor:
    """RGB images of the samples in ``apply`` replaced by their luma on all channels; 1-channel
    images are unchanged (torchvision's RandomGrayscale)."""
    if x.shape[1] == 1:
        return x
    return torch.where(_per_sample(apply), grayscale(x).expand_as(x), x)


def gaussian_kernels(sigma: Tensor, kernel_size: int) -> Tensor:
    """[B, kernel_size] normalised Gaussian taps per sample; sigma 0 gives the delta kernel
    (the sample is left as it is: a convolution with it is exact)."""
    offsets = torch.arange(kernel_size, device=sigma.device, dtype=sigma.dtype) - (kernel_size - 1) / 2
    safe = sigma.clamp(min=1e-6).unsqueeze(-1)
    taps = torch.exp(-0.5 * (offsets / safe) ** 2)
    taps = taps / taps.sum(-1, keepdim=True)
    delta = (offsets == 0).to(sigma.dtype)
    return torch.where(sigma.unsqueeze(-1) > 0, taps, delta)


def gaussian_blur(x: Tensor, sigma: Tensor, kernel_size: int) -> Tensor:
    """torchvision's GaussianBlur (reflect padding) with a sigma per sample (0: not blurred), as a
    separable depthwise convolution: one conv per axis over the whole batch, a kernel per image
    channel."""
    if kernel_size <= 1:
        return x
    b, c, h, w = x.shape
    taps = gaussian_kernels(sigma, kernel_size).repeat_interleave(c, 0)      # [B*C, k]
    pad = kernel_size // 2
    y = F.pad(x.reshape(1, b * c, h, w), (pad, pad, pad, pad), mode="reflect")
    y = F.conv2d(y, taps.view(b * c, 1, kernel_size, 1), groups=b * c)
    y = F.conv2d(y, taps.view(b * c, 1, 1, kernel_size), groups=b * c)
    return y.view(b, c, h, w)


def solarize(x: Tensor, apply: Tensor, threshold: float = 0.5) -> Tensor:
    """Pixels at or above ``threshold`` inverted in the samples of ``apply`` (RandomSolarize)."""
    return torch.where(_per_sample(apply) & (x >= threshold), 1.0 - x, x)
