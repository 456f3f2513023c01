"""`visiontrain predict`: a detection checkpoint's boxes drawn on image files, plus COCO results."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def predict_images(task: Any, state: dict[str, Any], images: list[str], out: Path, *,
                   score_threshold: float = 0.5, use_ema: bool = False) -> int:
    """Writes OUT/<stem>.png (boxes, class names, scores) and OUT/detections.json (COCO results
    format; image_id = position in the argument list, 1-based). Returns the detection count."""
    from visiontrain._tv_compat import ensure_torchvision

    ensure_torchvision()  # nothing before this point need have loaded torchvision (e.g. the rcnn task)
    from torchvision.utils import draw_bounding_boxes
    from PIL import Image

    from visiontrain.data.detection.images import read_rgb
    from visiontrain.evaluation.coco import to_coco_results

    info = state["data_info"]
    model = task.build_model(info)
    weights = state["ema"]["module"] if use_ema and state.get("ema") else state["model"]
    model.load_state_dict(weights)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    names = info["class_names"]
    for image_id, path in enumerate(images, start=1):
        pixels = read_rgb(path)
        pred = task.predict(model, [pixels], torch.device("cpu"))[0]
        keep = pred["scores"] >= score_threshold
        boxes, scores, labels = pred["boxes"][keep], pred["scores"][keep], pred["labels"][keep]
        results += [{**r, "file_name": str(path)} for r in
                    to_coco_results(boxes, scores, labels, image_id, info["category_ids"])]
        captions = [f"{names[int(l)]} {float(s):.2f}" for l, s in zip(labels, scores)]
        drawn = draw_bounding_boxes(pixels, boxes, labels=captions, colors="red", width=2)
        Image.fromarray(drawn.permute(1, 2, 0).numpy()).save(out / f"{Path(path).stem}.png")
    (out / "detections.json").write_text(json.dumps(results, indent=1))
    return len(results)
