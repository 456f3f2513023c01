"""`visiontrain predict`: a detection checkpoint's boxes drawn on image files, plus COCO results."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


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


def predict_images(task: Any, model: Any, info: dict[str, Any], images: list[str], out: Path, *,
                   score_threshold: float | None = None) -> int:
    """Writes one drawing per input (boxes, class names, scores; named by :func:`output_names`) and
    OUT/detections.json (COCO results format; image_id = position in the argument list, 1-based;
    each result also names its input, ``file_name`` as given, and its drawing, ``drawn``, relative to
    OUT). ``score_threshold`` None: the task's ``predict_threshold``. Returns the detection count."""
    from visiontrain._tv_compat import ensure_torchvision

    ensure_torchvision()  # nothing before this point need have loaded torchvision (e.g. the rcnn task)
    from torchvision.utils import draw_bounding_boxes
    from PIL import Image

    from visiontrain.data.detection.images import read_rgb
    from visiontrain.evaluation.coco import to_coco_results

    score_threshold = task.predict_threshold if score_threshold is None else score_threshold
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    names = info["class_names"]
    for image_id, (path, drawn_name) in enumerate(zip(images, output_names(images)), start=1):
        pixels = read_rgb(path)
        pred = task.predict(model, [pixels], torch.device("cpu"))[0]
        keep = pred["scores"] >= score_threshold
        boxes, scores, labels = pred["boxes"][keep], pred["scores"][keep], pred["labels"][keep]
        results += [{**r, "file_name": str(path), "drawn": drawn_name.as_posix()} for r in
                    to_coco_results(boxes, scores, labels, image_id, info["category_ids"])]
        captions = [f"{names[int(l)]} {float(s):.2f}" for l, s in zip(labels, scores)]
        # torchvision warns on an empty box list; an image with nothing detected is a normal result
        drawn = draw_bounding_boxes(pixels, boxes, labels=captions, colors="red", width=2) if len(boxes) else pixels
        target = out / drawn_name
        target.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(drawn.permute(1, 2, 0).numpy()).save(target)
    (out / "detections.json").write_text(json.dumps(results, indent=1))
    return len(results)
