"""DINO's batched multi-crop: each op equals torchvision's kernel on the same parameters, the drawn
parameters follow the per-view distributions (fixed seed, tolerances from the sample size), a batch
seed fixes the crops, and the per-sample path stays selectable."""
from __future__ import annotations

import math

import pytest
import torch

from visiontrain.core._tv_compat import ensure_torchvision
from visiontrain.data import batch_ops as B
from visiontrain.data import multicrop_batched as M
from visiontrain.data.multicrop import MultiCropSpec, blur_kernel_size
from visiontrain.data.samplers import SeededDataset

RGB_SPEC = MultiCropSpec(global_size=24, local_size=12, local_crops=3, blur_sigma=(0.1, 1.0),
                         mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))


def tv_functional():
    ensure_torchvision()
    from torchvision.transforms import v2
    from torchvision.transforms.v2 import functional

    return v2, functional


def sigmas(p: float, n: int) -> float:
    """Four standard errors of a rate p over n draws: the tolerance of an observed frequency."""
    return 4.0 * math.sqrt(p * (1.0 - p) / n)


def reference_view(v2, TF, image: torch.Tensor, p: torch.Tensor, size: int, kernel: int, spec: MultiCropSpec
                   ) -> torch.Tensor:
    """One view of one float image made by torchvision's own kernels with the drawn parameters."""
    x0, y0, w, h = (int(t) for t in p[M.X0:M.H + 1].tolist())
    y = TF.resized_crop(image, y0, x0, h, w, [size, size], v2.InterpolationMode.BICUBIC, antialias=True)
    y = y.clamp(0, 1)
    if p[M.FLIP]:
        y = TF.horizontal_flip(y)
    if p[M.JITTER]:
        f = p[M.FACTORS:M.FACTORS + 4].tolist()
        y = v2.ColorJitter(*spec.jitter).transform(y, dict(
            fn_idx=p[M.ORDER:M.ORDER + 4].long(), brightness_factor=f[0], contrast_factor=f[1],
            saturation_factor=f[2], hue_factor=f[3]))
    if p[M.GRAY]:
        y = TF.rgb_to_grayscale(y, num_output_channels=y.shape[0])
    if p[M.SIGMA] > 0:
        y = TF.gaussian_blur(y, [kernel, kernel], [float(p[M.SIGMA])] * 2)
    if p[M.SOLARIZE]:
        y = TF.solarize(y, 0.5)
    return TF.normalize(y, list(spec.mean), list(spec.std))


@pytest.mark.parametrize("channels", [3, 1])
def test_every_view_equals_torchvisions_kernels_with_the_same_parameters(channels):
    """Images of different sizes padded into one batch; each view of each sample against the
    per-sample torchvision ops (bicubic antialiased crop, flip, ColorJitter in the drawn order,
    grayscale, blur, solarize, normalise) with its drawn parameters."""
    v2, TF = tv_functional()
    g = torch.Generator().manual_seed(3)
    spec = RGB_SPEC if channels == 3 else MultiCropSpec(24, 12, 3, blur_sigma=(0.1, 1.0))
    images = [torch.randint(0, 256, (channels, 30 + 7 * i, 41 - 5 * i), generator=g, dtype=torch.uint8)
              for i in range(6)]
    ds = M.RawMultiCropDataset(type("Src", (), {"raw_item": lambda self, i: (images[i], i),
                                                 "__len__": lambda self: 6})(), spec)
    torch.manual_seed(0)
    batch, labels, params = M.collate_raw(ds.__getitems__(range(6)))
    assert labels.tolist() == list(range(6)) and batch.shape == (6, channels, 65, 41)
    crops = M.BatchedMultiCrop(spec)(batch, params)
    assert [tuple(c.shape) for c in crops] == [(6, channels, 24, 24)] * 2 + [(6, channels, 12, 12)] * 3
    sizes = [24, 24, 12, 12, 12]
    for i, image in enumerate(images):
        for v, size in enumerate(sizes):
            ref = reference_view(v2, TF, image.float() / 255, params[i, v], size,
                                 blur_kernel_size(spec.blur_sigma[1], size), spec)
            torch.testing.assert_close(crops[v][i], ref, atol=2e-5, rtol=0, msg=f"sample {i} view {v}")


def analytic_crop_mean(height: int, width: int, scale: tuple[float, float], n: int = 1500) -> float:
    """The mean area fraction of torchvision's RandomResizedCrop sampler by quadrature: the area
    fraction uniform in ``scale``, the log aspect ratio uniform, each side rounded; a try whose box does
    not fit is drawn again (10 tries), after which the centre crop (the whole square image)."""
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    target = height * width * (scale[0] + (scale[1] - scale[0]) * u).view(-1, 1)
    ratio = torch.exp(math.log(3 / 4) + (math.log(4 / 3) - math.log(3 / 4)) * u).view(1, -1)
    w, h = torch.sqrt(target * ratio).round(), torch.sqrt(target / ratio).round()
    fits = ((w <= width) & (h <= height)).double()
    accept = fits.mean()
    fallback = (1 - accept) ** M.TRIES
    return float((1 - fallback) * (w * h * fits).mean() / accept / (height * width) + fallback * 1.0)


@pytest.mark.parametrize("scale", [(0.4, 1.0), (0.1, 0.4)])
def test_crop_boxes_follow_torchvisions_sampler(scale):
    n = 20000
    boxes = M.crop_boxes(torch.full((n, 2), 28), scale, torch.Generator().manual_seed(0))
    x0, y0, w, h = boxes.double().unbind(1)
    assert bool(((x0 >= 0) & (y0 >= 0) & (x0 + w <= 28) & (y0 + h <= 28) & (w >= 1) & (h >= 1)).all())
    frac = w * h / 784
    # each side is rounded from the drawn one (within half a pixel): the area moves by at most
    # (w + h) / 2 + 3/4 around the drawn target, the aspect ratio by at most 7/8 / h (below), 7/6 / (h - 1) (above)
    slack = (0.5 * (w + h) + 0.75) / 784
    assert bool(((frac + slack >= scale[0]) & (frac - slack <= scale[1])).all())
    assert bool(((w / h >= 3 / 4 - 0.875 / h) & (w / h <= 4 / 3 + (7 / 6) / (h - 1))).all())
    expected = analytic_crop_mean(28, 28, scale)
    assert abs(frac.mean().item() - expected) < 4 * frac.std().item() / math.sqrt(n), (frac.mean(), expected)
    # torchvision's own sampler agrees with the quadrature (its own sample size sets the tolerance)
    v2, _ = tv_functional()
    from torchvision.transforms import RandomResizedCrop

    torch.manual_seed(0)
    image, m = torch.zeros(1, 28, 28), 3000
    tv = torch.tensor([math.prod(RandomResizedCrop.get_params(image, list(scale), [3 / 4, 4 / 3])[2:]) / 784
                       for _ in range(m)], dtype=torch.float64)
    assert abs(tv.mean().item() - expected) < 4 * tv.std().item() / math.sqrt(m)


def test_a_box_that_never_fits_falls_back_to_the_centre_crop():
    boxes = M.crop_boxes(torch.tensor([[10, 40], [40, 10]]), (1.0, 1.0), torch.Generator().manual_seed(0))
    # wide 10 x 40: height 10, width round(10 * 4/3) = 13, centred; tall: width 10, height 13
    assert boxes.tolist() == [[13.0, 0.0, 13.0, 10.0], [0.0, 13.0, 10.0, 13.0]]


def test_view_parameters_have_the_configured_rates():
    n = 4000
    params = M.sample_views(torch.full((n, 2), 32), RGB_SPEC, torch.Generator().manual_seed(1))
    blur_p, solarize_p = zip(*M.view_probabilities(RGB_SPEC))
    for v in range(params.shape[1]):
        p = params[:, v]
        for column, rate in ((M.FLIP, 0.5), (M.JITTER, 0.8), (M.GRAY, 0.2), (M.SOLARIZE, solarize_p[v])):
            assert abs(p[:, column].mean().item() - rate) <= sigmas(rate, n) + 1e-9, (v, column)
        blurred = p[:, M.SIGMA] > 0
        assert abs(blurred.double().mean().item() - blur_p[v]) <= sigmas(blur_p[v], n) + 1e-9, v
        sigma = p[blurred, M.SIGMA]
        assert sigma.min() >= 0.1 and sigma.max() <= 1.0
        assert abs(sigma.mean().item() - 0.55) < 4 * (0.9 / math.sqrt(12)) / math.sqrt(len(sigma))
        factors = p[:, M.FACTORS:M.FACTORS + 4]
        for k, (lo, hi) in enumerate(((0.6, 1.4), (0.6, 1.4), (0.8, 1.2), (-0.1, 0.1))):
            assert factors[:, k].min() >= lo and factors[:, k].max() <= hi
            assert abs(factors[:, k].mean().item() - (lo + hi) / 2) < 4 * (hi - lo) / math.sqrt(12 * n)
        order = p[:, M.ORDER:M.ORDER + 4].long()
        assert torch.equal(order.sort(1).values, torch.arange(4).expand(n, 4))  # a permutation each
        first = torch.bincount(order[:, 0], minlength=4).double() / n
        assert (first - 0.25).abs().max() <= sigmas(0.25, n)


def test_grayscale_and_jitter_are_seen_in_the_crops_at_their_rates():
    """On RGB images of one saturated colour: a view is grey exactly when grayscale was drawn (no
    jitter factor removes all colour), and its colour changes exactly when jitter was drawn."""
    n = 2000
    colour = torch.tensor([200, 60, 30], dtype=torch.uint8).view(1, 3, 1, 1)
    images = colour.expand(n, 3, 20, 20).contiguous()
    spec = MultiCropSpec(8, 4, 0, blur_sigma=(0.1, 1.0), mean=(0.0,) * 3, std=(1.0,) * 3)
    params = M.sample_views(torch.full((n, 2), 20), spec, torch.Generator().manual_seed(2))
    view = M.BatchedMultiCrop(spec)(images, params)[0]
    grey = (view.amax(1) - view.amin(1)).amax((1, 2)) < 1e-6
    assert torch.equal(grey, params[:, 0, M.GRAY] > 0)
    assert abs(grey.double().mean().item() - 0.2) <= sigmas(0.2, n)
    # among the views in colour, brightness (a factor never exactly 1) moves the luma, which contrast
    # and saturation (blends that keep it) do not
    luma = B.grayscale(colour.float() / 255).view(())
    changed = (B.grayscale(view[~grey])[:, 0, 0, 0] - luma).abs() > 1e-5
    assert torch.equal(changed, params[~grey, 0, M.JITTER] > 0)
    assert abs(changed.double().mean().item() - 0.8) <= sigmas(0.8, len(changed))


def test_a_samples_seed_fixes_its_crops_whatever_batch_it_is_in():
    """Through SeededDataset as the loader calls it: each (index, seed) key gives the same crops
    whatever ran before and whatever else its batch holds (a run resumed on another number of
    processes batches the samples differently); another seed gives others."""
    images = torch.randint(0, 256, (8, 1, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    src = type("Src", (), {"raw_item": lambda self, i: (images[i], 0), "__len__": lambda self: 8})()
    spec = MultiCropSpec(16, 8, 2)
    ds, crop = SeededDataset(M.RawMultiCropDataset(src, spec)), M.BatchedMultiCrop(spec)

    def crops(keys: list[tuple[int, int]]) -> list[torch.Tensor]:
        images, _, params = M.collate_raw(ds.__getitems__(keys))
        return crop(images, params)

    keys = [(i, 100 + i) for i in range(8)]
    first = crops(keys)
    torch.rand(100)  # the global stream moved on: nothing changes
    assert all(torch.equal(a, b) for a, b in zip(first, crops(keys)))
    back, front = crops(keys[4:]), crops(keys[:4])  # the same samples in two batches, the back half first
    assert all(torch.equal(a, torch.cat([f, b])) for a, f, b in zip(first, front, back))
    assert not any(torch.equal(a, b) for a, b in zip(first, crops([(i, 200 + i) for i in range(8)])))


def test_identity_parameters_leave_the_image_as_it_is():
    x = torch.rand(4, 3, 9, 9, generator=torch.Generator().manual_seed(0))
    keep = torch.zeros(4, dtype=torch.bool)
    factors = torch.tensor([[1.3, 0.7, 1.1, 0.05]]).expand(4, 4)
    assert torch.equal(B.color_jitter(x, factors, torch.arange(4).expand(4, 4), keep), x)
    assert torch.equal(B.gaussian_blur(x, torch.zeros(4), 5), x)
    assert torch.equal(B.random_grayscale(x, keep), x) and torch.equal(B.solarize(x, keep), x)
    full = torch.tensor([[0.0, 0.0, 9.0, 9.0]]).expand(4, 4)
    torch.testing.assert_close(B.crop_resize(x, full, 9), x, atol=1e-6, rtol=0)


BLUE, BLOCK = 140.0, 2  # the checkerboard's mean and its squares' side (what survives the local crops' resize)


def view_statistics(view: torch.Tensor) -> torch.Tensor:
    """[N, 3, S, S] normalised views of ``statistics_image`` -> [N, 8]: which way the red ramp runs (the
    flip), its rise (crop width, contrast), grey or not and the channel spread (grayscale, saturation,
    hue), the blue checkerboard's pixel-to-pixel change (the crop's scale, blur), how far the blue
    mean moved from the image's (brightness, contrast), the mean and spread of the values (solarize)."""
    s = view.shape[-1]
    rise = view[:, 0, :, s // 2:].mean((1, 2)) - view[:, 0, :, :s // 2].mean((1, 2))
    spread = (view.amax(1) - view.amin(1)).mean((1, 2))
    texture = (view[:, 2, :, 1:] - view[:, 2, :, :-1]).abs().mean((1, 2))
    blue = (view[:, 2].mean((1, 2)) - (BLUE / 255 - 0.5) / 0.5).abs()
    return torch.stack([rise > 0, rise.abs(), spread < 1e-4, spread, texture, blue, view.mean((1, 2, 3)),
                        view.std((1, 2, 3))], 1).double()


def statistics_image(size: int = 40) -> torch.Tensor:
    """uint8 [3, size, size]: red rises left to right, green top to bottom, blue a checkerboard."""
    ramp = (torch.arange(size).float() * 255 / (size - 1)).round()
    cells = torch.arange(size) // BLOCK
    checker = (cells.view(-1, 1) + cells) % 2
    return torch.stack([ramp.expand(size, size), ramp.view(-1, 1).expand(size, size),
                        BLUE - 40.0 + 80.0 * checker]).to(torch.uint8)


def test_views_match_the_per_sample_pipelines_statistics():
    """The same image through the per-sample v2 pipeline and the batched one, 600 times each: per
    view, every statistic of ``view_statistics`` has the same mean within four standard errors of
    the difference (a two-sample z-test at a fixed seed), so flips, crop sizes, jitter, grayscale,
    blur and solarize reach the crops at the per-sample path's rates and strengths. Each of a flip
    p of 0.35, grayscale 0.3, jitter 0.6, local blur 0.25 or solarize 0.4 in the batched draws fails it."""
    from visiontrain.data.multicrop import MultiCrop

    n, image = 600, statistics_image()
    spec = MultiCropSpec(global_size=24, local_size=12, local_crops=3, blur_sigma=(0.1, 1.0), mean=(0.5,) * 3,
                         std=(0.5,) * 3)
    torch.manual_seed(0)
    pipeline = MultiCrop(spec)
    per_sample = [pipeline(image) for _ in range(n)]
    params = M.sample_views(torch.tensor([image.shape[-2:]] * n), spec, torch.Generator().manual_seed(0))
    batched = M.BatchedMultiCrop(spec)(image.expand(n, *image.shape).contiguous(), params)
    for v, view in enumerate(batched):
        a, b = view_statistics(torch.stack([crops[v] for crops in per_sample])), view_statistics(view)
        z = (a.mean(0) - b.mean(0)) / (a.var(0) / n + b.var(0) / n).sqrt()
        assert z.abs().max() < 4.0, (v, z)
