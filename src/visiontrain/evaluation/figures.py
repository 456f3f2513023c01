"""What an evaluation looks like, as matplotlib Figures: a confusion matrix (classification's, or
detection's with its background class), precision-recall curves per class, validation images with
the predicted boxes (or instance masks) drawn over the ground truth, and a contact sheet of
classified images (`visiontrain predict --sheet`). Built with ``matplotlib.figure.Figure`` (no
pyplot state); the engine's plot hook writes them to RUN_DIR/plots/ and TensorBoard."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from visiontrain.evaluation.fonts import use_fonts_with_glyphs
from visiontrain.evaluation.panels import panel_grid
from visiontrain.evaluation.previews import PALETTE, paint_masks

MAX_TICK_LABELS = 40  # above this many classes the axes are left unlabelled (ImageNet's 1000)
MAX_LEGEND = 20  # above this many classes the PR curves are not named one by one (COCO's 80)


def confusion_figure(counts: torch.Tensor | np.ndarray, class_names: Sequence[Any], *,
                     title: str | None = None) -> Any:
    """Rows: the true class, normalised to 1 (each row shows where that class's images went, so
    a rare class reads as clearly as a common one); the counts are written in when they fit.
    ``title`` replaces the classification one (top-1 over the images), e.g. for detection's."""
    from matplotlib.figure import Figure

    counts = torch.as_tensor(counts).to(torch.float64)
    c = counts.shape[0]
    share = (counts / counts.sum(1, keepdim=True).clamp_min(1)).numpy()
    size = min(4.0 + 0.45 * c, 14.0)
    fig = Figure(figsize=(size + 1.5, size), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(share, cmap="Blues", vmin=0.0, vmax=1.0)
    fig.colorbar(image, ax=ax, fraction=0.046, label="share of the true class")
    if title is None:
        accuracy = float(counts.diag().sum() / counts.sum().clamp_min(1))
        title = f"confusion matrix (top-1 {100 * accuracy:.2f} %, {int(counts.sum())} images)"
    ax.set_title(title)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if c <= MAX_TICK_LABELS:
        names = [str(n) for n in class_names][:c]
        ax.set_xticks(range(c), names, rotation=60, ha="right", fontsize=8)
        ax.set_yticks(range(c), names, fontsize=8)
    if c <= 20:
        for i in range(c):
            for j in range(c):
                if counts[i, j] > 0:
                    ax.text(j, i, int(counts[i, j]), ha="center", va="center", fontsize=7,
                            color="white" if share[i, j] > 0.5 else "black")
    return use_fonts_with_glyphs(fig)


def pr_curves_figure(recall: np.ndarray, curves: dict[str, np.ndarray], ap: dict[str, float], *,
                     title: str, legend_title: str = "AP") -> Any:
    """Precision against recall, one thin curve per class and their mean (the all-class curve, whose
    mean precision is the mAP) thick; each class's AP (``ap``, named ``legend_title``) in the legend
    up to ``MAX_LEGEND`` classes, above that the class curves are grey and only the mean is named."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5 if len(curves) <= MAX_LEGEND else 6.0, 5.0), layout="constrained")
    ax = fig.subplots()
    named = len(curves) <= MAX_LEGEND
    colors = [None] * len(curves) if named else ["0.7"] * len(curves)
    for (name, precision), color in zip(curves.items(), colors):
        ax.plot(recall, precision, linewidth=1.0, color=color, label=f"{name} {ap[name]:.3f}" if named else None)
    if curves:
        mean = np.mean(np.stack(list(curves.values())), axis=0)
        ax.plot(recall, mean, linewidth=3.0, color="black" if named else "tab:blue",
                label=f"all classes {float(np.mean(mean)):.3f}")
        ax.legend(fontsize=7, title=legend_title, title_fontsize=8, loc="center left" if named else "lower left",
                  bbox_to_anchor=(1.01, 0.5) if named else None, frameon=False)
    else:
        ax.text(0.5, 0.5, "no class with ground truth", ha="center", va="center", transform=ax.transAxes)
    ax.set(xlim=(0, 1), ylim=(0, 1.02), xlabel="recall", ylabel="precision", title=title)
    ax.grid(alpha=0.3)
    return use_fonts_with_glyphs(fig)


@dataclass
class ShownImage:
    """One validation image and its boxes, all in the image's own pixel coordinates (XYXY), with
    the instance masks of both where there are masks (bool, at the image's size)."""
    image: torch.Tensor         # uint8 [3, H, W]
    gt_boxes: torch.Tensor      # [G, 4]
    gt_labels: list[int]
    boxes: torch.Tensor         # [P, 4] predictions, highest score first
    scores: list[float]
    labels: list[int]
    gt_masks: np.ndarray | None = None   # [G, H, W]
    masks: np.ndarray | None = None      # [P, H, W]


def _prediction_label(ax: Any, box: Sequence[float], text: str, colour: str) -> None:
    """A prediction's class and score on its box's top-left corner."""
    ax.text(box[0], box[1], text, color="white", fontsize=6, va="bottom",
            bbox=dict(facecolor=colour, alpha=0.7, pad=1, linewidth=0))


def detections_figure(shown: list[ShownImage], class_names: Sequence[str], *, title: str) -> Any:
    """Ground truth dashed green, predictions solid red with class and score."""
    from matplotlib.patches import Rectangle

    fig, axes = panel_grid(len(shown), title=title, width=4.2, height=3.8)
    for ax, s in zip(axes, shown):
        ax.imshow(np.ascontiguousarray(s.image.permute(1, 2, 0).numpy()))
        for box, label in zip(s.gt_boxes.tolist(), s.gt_labels):
            x1, y1, x2, y2 = box
            ax.add_patch(Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, edgecolor="lime", linewidth=1.2,
                                   linestyle="--"))
        for box, score, label in zip(s.boxes.tolist(), s.scores, s.labels):
            x1, y1, x2, y2 = box
            ax.add_patch(Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, edgecolor="red", linewidth=1.2))
            _prediction_label(ax, box, f"{class_names[label]} {score:.2f}", "red")
        ax.set_title(f"{len(s.gt_labels)} true, {len(s.labels)} predicted", fontsize=8)
        ax.set_axis_off()
    return use_fonts_with_glyphs(fig)


def masks_figure(shown: list[ShownImage], class_names: Sequence[str], *, title: str) -> Any:
    """Instance segmentation's view of the same images: each predicted mask filled semi-transparent
    in its class's colour (``previews.paint_masks``, the colours of train_batch.png) with its class
    and score, each ground-truth mask outlined in its class's colour over them, so that a mask
    predicted right shows as a fill inside an outline of the same colour."""
    fig, axes = panel_grid(len(shown), title=title, width=4.2, height=3.8)
    for ax, s in zip(axes, shown):
        pixels = s.image.permute(1, 2, 0).numpy() / 255.0
        predicted = None if s.masks is None else s.masks[::-1]  # the highest score painted last, on top
        pixels = paint_masks(paint_masks(pixels, predicted, s.labels[::-1]), s.gt_masks, s.gt_labels, outline=True)
        ax.imshow(pixels, interpolation="nearest")
        for box, score, label in zip(s.boxes.tolist(), s.scores, s.labels):
            _prediction_label(ax, box, f"{class_names[label]} {score:.2f}", PALETTE[label % len(PALETTE)])
        ax.set_title(f"{len(s.gt_labels)} true, {len(s.labels)} predicted", fontsize=8)
        ax.set_axis_off()
    return use_fonts_with_glyphs(fig)


SHEET_COLUMNS = 8


def image_sheet(images: Sequence[torch.Tensor], captions: Sequence[str], *, title: str) -> Any:
    """One panel per image (uint8 [C, H, W], grey or RGB) with its caption above it, up to
    ``SHEET_COLUMNS`` a row: a contact sheet of inputs and what the model said about each."""
    fig, axes = panel_grid(len(images), title=title, width=2.2, height=2.4, columns=SHEET_COLUMNS)
    for ax, image, caption in zip(axes, images, captions):
        pixels = np.ascontiguousarray(image.permute(1, 2, 0).numpy())
        if pixels.shape[-1] == 1:
            ax.imshow(pixels[..., 0], cmap="gray", vmin=0, vmax=255)
        else:
            ax.imshow(pixels)
        ax.set_title(caption, fontsize=7)
        ax.set_axis_off()
    return use_fonts_with_glyphs(fig)
