"""`visiontrain predict`: a checkpoint's predictions on image files, through ``visiontrain.use.inference``.

A detector's boxes are drawn on each image and written as COCO results (detections.json), an
instance segmenter's masks too (filled in their class's colour under the boxes; each result's
``segmentation`` as compressed RLE); a classifier's top-k classes are written to
predictions.json, with an optional contact sheet (sheet.png: each input with its top class and
probability). A semantic segmenter's label maps are written as palette PNGs (each pixel's value its
class id) with a drawing of each over its image. ``--tile S``: a detector runs on overlapping tiles
of each image, merged back (``visiontrain.use.tiled``)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from visiontrain.core._tv_compat import ensure_torchvision
from visiontrain.core.panoptic_format import id2rgb
from visiontrain.data.detection.tiles import check_tiling
from visiontrain.engine.protocols.task import Prediction, PredictUnsupported
from visiontrain.evaluation.coco import to_coco_results
from visiontrain.evaluation.figures import image_sheet
from visiontrain.evaluation.previews import MASK_ALPHA, PALETTE, class_rgb
from visiontrain.evaluation.segmentation import background_classes, painted_classes
from visiontrain.use.inference import CLASSIFICATION_BATCH, Predictor
from visiontrain.use.onnx_predictor import OnnxPredictor
from visiontrain.use.tiled import predict_tiled


def load_predictor(target: str, *, ema: bool = False, device: str | None = None) -> Any:
    """What ``predict`` runs: ``Predictor.load`` on a checkpoint or a run dir, and for an ``.onnx``
    file an ``OnnxPredictor``, which computes with onnxruntime (``use.onnx_runner``) and answers the
    same calls, so both give the same files. Either refuses a task that makes no predictions."""
    if not target.lower().endswith(".onnx"):
        return Predictor.load(target, ema=ema, device=device)
    if not os.path.isfile(target):
        raise FileNotFoundError(f"{target}: no such ONNX file")
    if ema:
        raise ValueError(f"--ema: {target} is an ONNX file, which holds one set of weights "
                         f"(visiontrain export --ema writes the EMA's)")
    predictor = OnnxPredictor(target, device=device)
    if predictor.prediction is Prediction.NONE:
        raise PredictUnsupported(f"{target}: task {predictor.task_name!r} makes no predictions on images; predict "
                                 f"works for classification, detection and segmentation models (its features: "
                                 f"python -m visiontrain.use.onnx_runner)")
    return predictor


def output_names(images: list[str]) -> list[Path]:
    """The drawn file of each input, relative to the output directory: the input's path relative to
    the inputs' deepest common directory, with a ``.png`` suffix.

    Inputs from one directory (the usual case) give ``<stem>.png``; ``a/img.png b/img.png`` give
    ``a/img.png`` and ``b/img.png``, mirroring the inputs' own tree, so that a user finds each
    drawing where the input sits and no input overwrites another's. A clash left after that (the
    same file twice, or ``x.jpg`` and ``x.png``) takes ``-2``, ``-3``... in argument order."""
    resolved = [Path(os.path.abspath(p)) for p in images]
    try:
        root = Path(os.path.commonpath([p.parent for p in resolved])) if resolved else Path()
    except ValueError:  # no common root at all (e.g. two Windows drives): the names alone
        root = None
    names: list[Path] = []
    taken: set[str] = set()
    for path in resolved:
        rel = path.relative_to(root) if root is not None else Path(path.name)
        name = rel.with_suffix(".png")
        n = 1
        while name.as_posix().lower() in taken:  # lower: case-insensitive file systems clash too
            n += 1
            name = rel.with_name(f"{rel.stem}-{n}.png")
        taken.add(name.as_posix().lower())
        names.append(name)
    return names


def drawn_detections(pixels: torch.Tensor, det: Any) -> torch.Tensor:
    """uint8 [3, H, W]: ``pixels`` with each detection's mask (when it has one) filled in its class's
    colour at ``previews.MASK_ALPHA`` (as train_batch.png and val_masks.png fill them), then its box,
    class name and score in red over it."""
    from torchvision.utils import draw_bounding_boxes, draw_segmentation_masks

    if not len(det):  # torchvision warns on an empty box list; an image with nothing detected is a normal result
        return pixels
    if det.masks is not None:
        colours = [PALETTE[label % len(PALETTE)] for label in det.labels.tolist()]
        pixels = draw_segmentation_masks(pixels, det.masks.cpu(), alpha=MASK_ALPHA, colors=colours)
    captions = [f"{name} {float(s):.2f}" for name, s in zip(det.names, det.scores)]
    return draw_bounding_boxes(pixels, det.boxes, labels=captions, colors="red", width=2)


def predict_images(predictor: Any, images: list[str], out: Path, *, score_threshold: float | None = None,
                   tile: int | None = None, tile_overlap: float = 0.2, whole_image: bool = True) -> int:
    """Writes one drawing per input (masks, boxes, class names, scores; named by :func:`output_names`)
    and OUT/detections.json (COCO results format; image_id = position in the argument list, 1-based;
    each result also names its input, ``file_name`` as given, and its drawing, ``drawn``, relative to
    OUT; an instance segmenter's results carry their mask as ``segmentation``, COCO's compressed RLE
    at the input's size). ``predictor``: a detection ``visiontrain.use.inference.Predictor``;
    ``score_threshold`` None: the task's ``predict_threshold``. ``tile``: sliced prediction on tiles
    of that side overlapping by ``tile_overlap``, and on the whole image unless ``whole_image`` is
    False (``visiontrain.use.tiled.predict_tiled``). Returns the detection count."""
    ensure_torchvision()  # nothing before this point need have loaded torchvision (e.g. the rcnn task)
    if tile is not None:
        check_tiling(tile, tile_overlap, ("--tile", "--tile-overlap"))

    out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    for image_id, (path, drawn_name) in enumerate(zip(images, output_names(images)), start=1):
        pixels = predictor.read(path)
        det = predictor(pixels, threshold=score_threshold) if tile is None else \
            predict_tiled(predictor, pixels, tile, tile_overlap, threshold=score_threshold, whole_image=whole_image)
        found = to_coco_results(det.boxes, det.scores, det.labels, image_id, predictor.info["category_ids"])
        for result, segmentation in zip(found, det.segmentations()):
            result["segmentation"] = segmentation
        results += [{**r, "file_name": str(path), "drawn": drawn_name.as_posix()} for r in found]
        drawn = drawn_detections(pixels, det)
        target = out / drawn_name
        target.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(drawn.permute(1, 2, 0).numpy()).save(target)
    (out / "detections.json").write_text(json.dumps(results, indent=1))
    return len(results)


def classify_images(predictor: Any, images: list[str], out: Path, *, top_k: int | None = None,
                    sheet: bool = False) -> dict[str, Any]:
    """OUT/predictions.json: per input, in argument order, its ``file_name`` as given and its
    ``top`` classes (``class_id``, ``name``, ``probability``), most probable first; with ``sheet``,
    OUT/sheet.png: each input with its top class and probability. Images are read and classified
    a batch at a time. Returns what was written."""
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    shown: list[tuple[torch.Tensor, str]] = []
    for start in range(0, len(images), CLASSIFICATION_BATCH):
        paths = images[start:start + CLASSIFICATION_BATCH]
        pixels = [predictor.read(p) for p in paths]
        for path, image, result in zip(paths, pixels, predictor(pixels, top_k=top_k)):
            rows.append({"file_name": str(path), **result.to_dict()})
            if sheet:
                shown.append((image, f"{Path(path).name}\n{result.name} {result.probability:.2f}"))
    written = {"predictions": str(out / "predictions.json"), "sheet": None}
    (out / "predictions.json").write_text(json.dumps(rows, indent=1))
    if sheet:
        figure = image_sheet([img for img, _ in shown], [c for _, c in shown], title="top class and probability")
        figure.savefig(out / "sheet.png")
        written["sheet"] = str(out / "sheet.png")
    return written


#: Where ``segment_images`` puts each label map's drawing over its image, under OUT.
OVERLAYS = "overlays"


def label_map_png(labels: torch.Tensor, class_count: int) -> Image.Image:
    """A label map [H, W] as a palette PNG, as VOC writes its own: each pixel's value is its class id
    (PIL and every segmentation tool read the values, not the colours), the palette the figures' class
    colours, so that an image viewer shows the classes apart."""
    image = Image.fromarray(labels.numpy().astype(np.uint8), mode="P")
    colours = [round(255 * v) for k in range(class_count) for v in class_rgb(k)]
    image.putpalette(colours + [0] * (768 - len(colours)))
    return image


def segment_images(predictor: Any, images: list[str], out: Path) -> dict[str, Any]:
    """For each input (named by :func:`output_names`): OUT/NAME.png, its label map as a palette PNG
    (``label_map_png``), and OUT/overlays/NAME.png, its classes filled over the image in the figures'
    colours (a class named background left unpainted); OUT/segmentation.json: per input, in argument
    order, its ``file_name`` as given, both files relative to OUT, its size and each present class's
    pixel count. ``predictor``: a semantic segmentation ``Predictor``. Returns what was written."""
    rows: list[dict[str, Any]] = []
    names = predictor.class_names
    unpainted = background_classes(names)
    for path, name in zip(images, output_names(images)):
        pixels = predictor.read(path)
        result = predictor(pixels)
        overlay = painted_classes(pixels.permute(1, 2, 0).numpy() / 255.0, result.labels.numpy(), unpainted)
        for folder, picture in ((out, label_map_png(result.labels, len(names))),
                                (out / OVERLAYS, Image.fromarray(np.round(255 * overlay).astype(np.uint8)))):
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            picture.save(folder / name)
        rows.append({"file_name": str(path), "label_map": name.as_posix(), "overlay": f"{OVERLAYS}/{name.as_posix()}",
                     **result.to_dict()})
    (out / "segmentation.json").write_text(json.dumps(rows, indent=1))
    return {"segmentation": str(out / "segmentation.json"), "label_maps": len(rows)}


def panoptic_images(predictor: Any, images: list[str], out: Path) -> dict[str, Any]:
    """For each input (named by :func:`output_names`): OUT/NAME.png, its segment ids as COCO's panoptic
    PNG, and OUT/overlays/NAME.png, each segment filled over the image in its category's colour;
    OUT/panoptic.json: COCO's panoptic results (``annotations``: per input, in argument order, its
    ``file_name`` as given, the PNG relative to OUT and its ``segments_info`` with category names;
    ``categories``). ``predictor``: a panoptic ``Predictor``. Returns what was written."""
    categories = predictor.info["categories"]
    order = [int(c["id"]) for c in categories]
    annotations: list[dict[str, Any]] = []
    for path, name in zip(images, output_names(images)):
        pixels = predictor.read(path)
        result = predictor(pixels)
        ids = result.ids.numpy()
        classes = np.full(ids.shape, -1, dtype=np.int64)
        for s in result.segments:
            classes[ids == s["id"]] = order.index(s["category_id"])
        overlay = painted_classes(pixels.permute(1, 2, 0).numpy() / 255.0, classes, [-1])
        for folder, picture in ((out, Image.fromarray(id2rgb(ids))),
                                (out / OVERLAYS, Image.fromarray(np.round(255 * overlay).astype(np.uint8)))):
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            picture.save(folder / name)
        annotations.append({"file_name": str(path), "panoptic_png": name.as_posix(),
                            "overlay": f"{OVERLAYS}/{name.as_posix()}", **result.to_dict()})
    (out / "panoptic.json").write_text(json.dumps({"annotations": annotations, "categories": categories}, indent=1))
    return {"panoptic": str(out / "panoptic.json"), "segmentations": len(annotations)}
