"""Every built-in recipe, run through the CLI as a user runs it: `visiontrain fit RECIPE` with the
recipe's own data, DataLoader workers and their start method, precision, transforms and schedules.

What a run here changes is only its length and size (tests/support/shipped.py): three optimizer steps,
fewer evaluation images, and for a full-scale recipe a tiny fixture tree in its real on-disk format
(tests/support/dataset_trees.py) with smaller batches and image sizes. Any other override must be listed
in ``WHY`` with the reason; ``test_only_length_and_size_are_overridden`` holds the table to that,
and each run's config.yaml is compared with the recipe key by key. The runs go two at a time in
the background (each is mostly one thread and its workers), as the docs' commands do.
"""
from __future__ import annotations

import concurrent.futures
import json
import re
import threading
from html import escape
from pathlib import Path

import pytest
import yaml

from dataset_trees import build_coco, build_image_folder, build_voc
from panoptic_trees import write_coco_panoptic
from segmentation_dataset_trees import write_cityscapes
from procs import run_cli
from shipped import LENGTH_AND_SIZE
from visiontrain.core import config as C
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.engine.state.checkpoint import load_checkpoint

STEPS = 3
FIXTURES = {"coco": build_coco, "voc": build_voc, "image-folder": build_image_folder,
            "cityscapes": write_cityscapes,
            "coco-panoptic": lambda root: write_coco_panoptic(root, {"train2017": 6, "val2017": 3})}
SMALL_DETECTION = ["data.limit_val=8"]
DETECTION_SIZES = ["task.train_scales=[96,128]", "task.max_size=160", "task.val_size=96"]

# recipe -> (fixture tree for data.root or None, overrides besides trainer.max_steps)
RUNS: dict[str, tuple[str | None, list[str]]] = {
    "classify-fashion": (None, ["data.limit_val=256"]),
    "detect-detr": (None, SMALL_DETECTION),
    "detect-faster-rcnn": (None, SMALL_DETECTION),
    "detect-yolov3": (None, SMALL_DETECTION),
    "segment-mask-rcnn": (None, SMALL_DETECTION),
    "segment-semantic": (None, SMALL_DETECTION),
    "segment-panoptic": (None, SMALL_DETECTION),
    "ssl-dino": (None, ["task.knn_bank=256", "data.limit_val=100"]),  # the k-NN bank is the train set
    "classify-mobilevit-imagenet": ("image-folder", ["data.batch_size=4", "data.image_size=64"]),
    "detect-detr-r50-coco": ("coco", ["task.pretrained_backbone=false", *DETECTION_SIZES, "task.crop_resize=[96]",
                                      "task.crop_min=64", "task.crop_max=96"]),
    "detect-detr-fast-r50-coco": ("coco", ["task.pretrained_backbone=false", *DETECTION_SIZES, "task.crop_resize=[96]",
                                           "task.crop_min=64", "task.crop_max=96"]),
    "detect-faster-rcnn-r50-coco": ("coco", ["task.pretrained_backbone=false", *DETECTION_SIZES]),
    "segment-mask-rcnn-r50-coco": ("coco", ["task.pretrained_backbone=false", *DETECTION_SIZES]),
    # 4 images a batch, not 2: the fixture's flat grey scenes drawn two at a time make a train_batch.png under 10 kB
    "segment-panoptic-fpn-r50-coco": ("coco-panoptic", ["task.pretrained_backbone=false", *DETECTION_SIZES,
                                                         "data.batch_size=4"]),
    "detect-yolov3-darknet53-voc": ("voc", ["task.pretrained_backbone=false", "task.size=96", "task.val_size=96",
                                            "task.multiscale_sizes=[64,96,128]"]),
    "segment-deeplabv3plus-r50-cityscapes": ("cityscapes", ["task.pretrained_backbone=false", "task.crop=96",
                                                             "task.train_sizes=[64,96]", "task.val_size=64"]),
    "ssl-dino-vits16-imagenet": ("image-folder", ["data.batch_size=4", "data.eval_batch_size=8", "data.image_size=32",
                                                  "task.global_crop_size=32", "task.local_crop_size=16"]),
}
WHY = {
    # ImageNet weights cannot be downloaded here (tests run offline); the recipe as shipped then
    # refuses in one line, which test_a_pretrained_backbone_that_is_not_cached_is_refused_in_one_line runs.
    "task.pretrained_backbone": "no network for the ImageNet weights",
}


def overrides(recipe: str, root: Path | None) -> list[str]:
    fixture, extra = RUNS[recipe]
    return [f"trainer.max_steps={STEPS}", *extra, *([f"data.root={root / fixture}"] if fixture else [])]


class RecipeRuns:
    """Starts every selected recipe's run at the first request, two at a time."""

    def __init__(self, base: Path, selected: list[str]) -> None:
        self.base, self.selected = base, selected
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
        self.futures: dict[str, concurrent.futures.Future] = {}
        self.lock = threading.Lock()

    def _run(self, recipe: str):
        fixture = RUNS[recipe][0]
        with self.lock:
            if fixture is not None and not (self.base / fixture).exists():
                FIXTURES[fixture](self.base / fixture)
        run_dir = self.base / "runs" / recipe
        return run_cli("fit", recipe, *overrides(recipe, self.base), "--run-dir", str(run_dir), timeout=600), run_dir

    def result(self, recipe: str):
        with self.lock:
            for name in [*self.selected, recipe]:
                if name not in self.futures:
                    self.futures[name] = self.pool.submit(self._run, name)
        return self.futures[recipe].result()


@pytest.fixture(scope="session")
def recipe_runs(tmp_path_factory, request):
    selected = [item.callspec.params["recipe"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_recipe_runs_as_shipped" and hasattr(item, "callspec")]
    runs = RecipeRuns(tmp_path_factory.mktemp("recipes"), selected)
    yield runs
    runs.pool.shutdown(wait=True)


def test_every_built_in_recipe_is_run():
    assert sorted(RUNS) == sorted(C.list_recipes())


def test_only_length_and_size_are_overridden():
    for recipe in RUNS:
        for override in overrides(recipe, Path("/data")):
            key = override.split("=", 1)[0]
            assert key in LENGTH_AND_SIZE or key in WHY, f"{recipe}: {key} is neither length/size nor explained"


def flat(tree: dict, prefix: str = "") -> dict[str, object]:
    """{"data": {"root": x}} -> {"data.root": x}"""
    out: dict[str, object] = {}
    for key, value in tree.items():
        out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


@pytest.mark.parametrize("recipe", list(RUNS))
def test_recipe_runs_as_shipped(recipe_runs, recipe):
    proc, run_dir = recipe_runs.result(recipe)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]

    # The run's config is the recipe's, but for the overridden keys.
    shipped = flat(C.config_to_dict(C.load_config(recipe, [])))
    ran = flat(yaml.safe_load((run_dir / "config.yaml").read_text()))
    changed = {k for k in shipped if shipped[k] != ran.get(k)}
    # data.num_workers=auto is written as the number it chose on this machine (the log says why)
    chosen = {k for k in changed if shipped[k] == "auto" and isinstance(ran.get(k), int)}
    assert changed - chosen <= {o.split("=", 1)[0] for o in overrides(recipe, Path("/data"))}, changed

    # A warmup longer than the three steps is a warning, one line a schedule, and the run trains
    # (a warmup given as a fraction of the run, unit "run", shrinks with it and never outlasts it).
    for name, spec in C.load_config(recipe, []).schedules.items():
        if spec.warmup > 0 and spec.unit != "run":
            assert f"visiontrain: warning: schedules.{name}.warmup (" in proc.stderr, proc.stderr[-3000:]

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows if r["kind"] == "train") == STEPS
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals and evals[-1]["step"] == STEPS
    assert fmt.step_of(load_checkpoint(run_dir / "checkpoints" / "last.pt")) == STEPS
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == STEPS

    # Instance segmentation trains its mask branch and is scored on masks as well as boxes.
    kind = C.load_config(recipe, []).task.name
    if kind == "mask_rcnn":
        assert all(r["loss_mask"] >= 0 for r in rows if r["kind"] == "train"), rows
        assert {"mask_AP", "mask_AP50", "AP"} <= set(evals[-1]), evals[-1]

    # The first look: the first batch drawn (and a detector's labels), the model's size counted.
    for name in ("train_batch", "labels") if kind in ("detr", "rcnn", "mask_rcnn", "yolo") else ("train_batch",):
        assert (run_dir / "plots" / f"{name}.png").stat().st_size > 10_000, name
    size = json.loads((run_dir / "model_summary.json").read_text())
    assert size["total"]["total"] == sum(m["total"] for m in size["modules"]) > 0
    assert size["flops_per_sample"] > 0, size["flops_note"]
    assert f"{size['total']['total']:,}" in proc.stdout  # the table is in the log


def test_validate_on_the_test_split(recipe_runs):
    """A split training never touched: fashion-mosaic's test images, evaluated on request only."""
    proc, run_dir = recipe_runs.result("detect-faster-rcnn")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli("validate", str(run_dir), "--split", "test")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["split"] == "test" and result["data_split"] == "test" and 0 <= result["AP50"] <= 1
    from visiontrain.use.trained import load_trained

    with pytest.raises(C.ConfigError, match="data.test_split=val is data.val_split, which training used"):
        load_trained(run_dir, ["data.test_split=val"], split="test")
    on_test = load_trained(recipe_runs.result("classify-fashion")[1], split="test")
    with pytest.raises(ValueError, match="fashion-mnist has no 'test' split .*: its two splits are fixed"):
        on_test.task.build_data()


def _drawn(path: Path) -> None:
    """A PNG that holds a drawing: big enough, and not one flat colour."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        pixels = np.asarray(image.convert("RGB"), dtype=np.float64)
    assert min(pixels.shape[:2]) > 300 and pixels.std() > 10, (path, pixels.shape, pixels.std())


def test_a_detector_reports_per_class_results(recipe_runs):
    """detect-yolov3's run above (no run of its own): the eval row's per-class table (COCO's columns
    and VOC07's) has a row per class, the log prints it, the PR curves and the detection confusion
    matrix are drawn, and the report holds the table."""
    proc, run_dir = recipe_runs.result("detect-yolov3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = fmt.data_info_of(load_checkpoint(run_dir / "checkpoints" / "last.pt"))["class_names"]
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["kind"] == "eval" and list(last["per_class"]) == names and len(names) == 10
    assert all(set(row) == {"AP", "AP50", "recall", "n_gt", "voc07_AP"} for row in last["per_class"].values())
    assert sum(row["n_gt"] for row in last["per_class"].values()) > 0
    assert json.loads((run_dir / "summary.json").read_text())["final"]["per_class"] == last["per_class"]
    log = proc.stdout[proc.stdout.index(f"[eval] per_class at step {STEPS}:"):]
    assert all(re.search(rf"^\s+{re.escape(name)}\s+(nan|\d\.\d{{4}})\s", log, re.M) for name in names), log[:3000]
    for name in ("pr_curves", "confusion_matrix", "val_detections"):
        _drawn(run_dir / "plots" / f"{name}.png")
    report = (run_dir / "report.html").read_text(encoding="utf-8")
    section = report[report.index("<h2>Per class</h2>"):]
    assert all(f"<tr><th>{escape(name)}</th>" in section for name in names)
    assert "<th>voc07_AP</th>" in section and "figcaption>pr_curves.png<" in report


def test_a_pretrained_backbone_that_is_not_cached_is_refused_in_one_line(tmp_path):
    """detect-detr-r50-coco as shipped on a machine without the ImageNet weights: one line naming the
    switch, exit 2, and no run dir left behind."""
    build_coco(tmp_path / "coco")
    run_dir = tmp_path / "runs" / "detr"
    proc = run_cli("fit", "detect-detr-r50-coco", f"data.root={tmp_path / 'coco'}", "--run-dir", str(run_dir),
                   env={"TORCH_HOME": str(tmp_path / "empty-torch-home")})
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("visiontrain: error:")]
    assert len(errors) == 1 and "task.pretrained_backbone=false" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists()
