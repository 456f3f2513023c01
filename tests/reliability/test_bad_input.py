"""The bad-input catalogue: every way a user's input can be wrong, driven through the CLI as a user
runs it. Each error exits 2 with one line on stderr naming the key, value, file or annotation and
what was expected; nothing already written (a run dir's checkpoints, metrics, weights) is lost.
Bad data under ``data.on_bad_annotation=skip`` is dropped and counted instead. RELIABILITY.md lists
these cases with the messages observed.

A command refused before any training runs ``visiontrain.app.cli.main`` in this process (``refused``):
its subject is the message, the exit code and the files left, and a process of its own would cost
5-9 s of start-up for each. What only a real ``python -m visiontrain`` shows runs in one: that the
whole of stderr is one line from the real entry point (a config error,
``test_unknown_key_suggests_the_closest``; a checkpoint torch cannot read, whose C++ reader could
print on its own, ``test_truncated_checkpoint_other_commands[validate]``), an error raised in a
DataLoader worker, and every command that trains."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import build_once
from dataset_trees import broken_inside_jpeg, build_coco, build_voc
from detection_helpers import vt
from procs import cli_here, in_process
from visiontrain.core import config as C
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.engine.state.checkpoint import load_checkpoint

# Bad input is this file's subject; the runs load in-process where the data is small (the errors a
# worker raises are tested where they differ: test_image_folder_corrupt_image_in_a_worker_is_one_line).
# trainer.plots=false: the figures at a run's end cost about 2 s of CPU and are not what is tested here
# (tests/engine/test_plots.py, test_report.py and the recipes' runs draw them)
DIGITS = ["data.name=digits", "data.limit_train=64", "data.limit_val=32", "data.batch_size=16",
          "trainer.epochs=1", "trainer.progress=plain", "trainer.plots=false"]
FOLDER = ["data.name=image-folder", "data.image_size=8", "data.batch_size=4", "trainer.epochs=1",
          "trainer.progress=plain", "trainer.plots=false"]
YOLO = ["data.name=coco", "data.batch_size=2", "data.num_workers=0", "trainer.epochs=1", "trainer.progress=plain",
        "trainer.plots=false",
        "trainer.precision=fp32", "task.backbone=darknet21", "task.backbone_width=0.125",
        "task.neck_channels=[16,16,8]", "task.size=64", "task.val_size=64", "task.multiscale_sizes=[64]"]
W, H = 64, 48  # detection images
GOOD_BOX = [8, 8, 16, 20]  # COCO [x, y, w, h]


# ------------------------------------------------------------------------------------ helpers

def error_line(proc) -> str:
    """The CLI's error line: exit code 2, no traceback, 'visiontrain: error: ...' on stderr."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("visiontrain: error: ")]
    assert lines, proc.stderr[-3000:]
    return lines[-1]


def only_line(proc) -> str:
    """``error_line`` of a real process whose stderr is that line and nothing else."""
    line = error_line(proc)
    assert proc.stderr.strip().splitlines() == [line], proc.stderr[-3000:]
    return line


def refused(capfd: pytest.CaptureFixture, *args: str) -> str:
    """``error_line`` of ``visiontrain ARGS`` run in this process: exit 2, one error line on stderr,
    no traceback."""
    code, _, err = in_process(capfd, *args)
    assert code == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("visiontrain: error: ")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def digest(run: Path) -> dict[str, str]:
    """Every file under a run dir and its content hash: what must survive a refused command."""
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


def kept(before: dict[str, str], run: Path, *, ignore: tuple[str, ...] = ()) -> None:
    after = digest(run)
    lost = {k for k, v in before.items() if after.get(k) != v and k not in ignore}
    assert not lost, f"changed or removed: {sorted(lost)}"


def rgb_image(seed: int = 0, w: int = W, h: int = H) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def mode_image(mode: str, w: int = W, h: int = H) -> Image.Image:
    """An image of a given PIL mode; I;16 is a 16-bit ramp up to 60000 (PIL's convert would clip it)."""
    if mode == "I;16":
        ramp = np.linspace(0, 60000, w * h).reshape(h, w).astype(np.uint16)
        return Image.fromarray(ramp)
    img = rgb_image(1, w, h)
    return img.convert("RGBA") if mode == "RGBA" else img.convert(mode, colors=16) if mode == "P" \
        else img.convert(mode)


def truncated_jpeg(path: Path, w: int = W, h: int = H) -> Path:
    """A JPEG whose header is intact (its size can be read) but whose pixel data stops half-way."""
    rgb_image(2, w, h).save(path, quality=95)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    return path


def random_bytes(path: Path) -> Path:
    path.write_bytes(np.random.default_rng(3).integers(0, 256, 600, dtype=np.uint8).tobytes())
    return path


def image_folder(root: Path, n: int = 4, modes: tuple[str, ...] = ("RGB",)) -> Path:
    """ROOT/{train,val}/{a,b}/*.png, n small images per class (cycling through ``modes``)."""
    for split in ("train", "val"):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                mode = modes[i % len(modes)]
                img = rgb_image(i + 10 * ord(c), 10, 12) if mode == "RGB" else mode_image(mode, 10, 12)
                img.save(root / split / c / f"{i}.png")
    return root


def coco(root: Path, split: str, images: list[tuple[str, Image.Image | None]],
         annotations: list[dict] | None = None) -> Path:
    """ROOT/annotations/instances_SPLIT.json and ROOT/SPLIT/*: images (None = already written by the
    caller), one good box per image unless ``annotations`` is given; categories 1 'cat' and 2 'dog'."""
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    (root / split).mkdir(parents=True, exist_ok=True)
    entries = []
    for i, (name, img) in enumerate(images, start=1):
        if img is not None:
            img.save(root / split / name)
        entries.append({"id": i, "file_name": name, "height": H, "width": W})
    if annotations is None:
        annotations = [{"id": 100 + i, "image_id": i, "category_id": 1 + i % 2, "bbox": GOOD_BOX}
                       for i in range(1, len(images) + 1)]
    data = {"images": entries, "annotations": annotations,
            "categories": [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}]}
    (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(data))
    return root


def good_coco(root: Path, train: int = 4, val: int = 2) -> Path:
    coco(root, "train", [(f"{i}.png", rgb_image(i)) for i in range(1, train + 1)])
    return coco(root, "val", [(f"{i}.png", rgb_image(50 + i)) for i in range(1, val + 1)])


@pytest.fixture(scope="module")
def digits_run(shared_dir: Path) -> Path:
    """A finished 4-step digits run (10 classes, grey 8x8, batch 16): checkpoints to misuse. Trained
    once a session (tests/reliability/test_unwritable.py trains the same command line); read only."""
    def fit(out: Path) -> None:
        # in this process: no DataLoader workers to start (data.num_workers 0)
        proc = cli_here("fit", "classify-fashion", *DIGITS, "--run-dir", str(out / "run"))
        assert proc.returncode == 0, proc.stderr[-3000:]

    return build_once(shared_dir, f"digits-run-{hashlib.sha256(' '.join(DIGITS).encode()).hexdigest()[:12]}",
                      fit) / "run"


@pytest.fixture
def run_copy(digits_run: Path, tmp_path: Path) -> Path:
    """A private copy of the finished run, for commands that are to be refused on it."""
    return Path(shutil.copytree(digits_run, tmp_path / "run"))


# ------------------------------------------------------------------------ 1-2: config keys, types

def test_unknown_key_suggests_the_closest(tmp_path: Path) -> None:
    """Through a real process: a config error from the real entry point is the whole of stderr."""
    line = only_line(vt("fit", "classify-fashion", *DIGITS, "optim.lrr=0.1", "--run-dir", str(tmp_path / "r")))
    assert "unknown config key 'optim.lrr'; did you mean optim.lr" in line
    assert not (tmp_path / "r").exists()  # refused before anything is written


@pytest.mark.parametrize("override, expected", [
    ("trainer.epochs=abc", "trainer.epochs: expected int, got 'abc' (str)"),
    ("data.batch_size=1.5", "data.batch_size: expected int, got 1.5 (float)"),
    ("data.batch_size=0", "data.batch_size: expected an integer >= 1, got 0"),
], ids=["epochs=abc", "batch_size=1.5", "batch_size=0"])
def test_wrong_type_or_range_names_key_and_expected(tmp_path: Path, capfd, override: str, expected: str) -> None:
    line = refused(capfd, "fit", "classify-fashion", *DIGITS, override, "--run-dir", str(tmp_path / "r"))
    assert expected in line
    assert not (tmp_path / "r").exists()


# --------------------------------------------------------------------- 3-4: missing or empty data

def test_image_folder_root_missing(tmp_path: Path, capfd) -> None:
    root = tmp_path / "nope"
    line = refused(capfd, "fit", "classify-fashion", *FOLDER, f"data.root={root}", "--run-dir", str(tmp_path / "r"))
    assert f"image-folder directory {root} does not exist; expected the layout ROOT/train/<class>/" in line
    assert not (tmp_path / "r" / "checkpoints" / "last.pt").exists()


def test_coco_root_without_annotation_file(tmp_path: Path, capfd) -> None:
    root = good_coco(tmp_path / "coco")
    (root / "annotations" / "instances_val.json").unlink()
    line = refused(capfd, "fit", "detect-yolov3", *YOLO, f"data.root={root}", "--run-dir", str(tmp_path / "r"))
    assert f"annotation file {root / 'annotations' / 'instances_val.json'} does not exist" in line


@pytest.mark.parametrize("case", ["class folders without images", "no class folders"])
def test_image_folder_empty_val_split(tmp_path: Path, capfd, case: str) -> None:
    root = image_folder(tmp_path / "imgs")
    for f in (root / "val").rglob("*.png"):
        f.unlink()
    if case == "no class folders":
        for d in (root / "val").iterdir():
            d.rmdir()
    line = refused(capfd, "fit", "classify-fashion", *FOLDER, f"data.root={root}", "--run-dir", str(tmp_path / "r"))
    if case == "no class folders":
        assert f"no class sub-directories in {root / 'val'}; expected the layout" in line
    else:
        assert f"image-folder split {root / 'val'}: Found no valid file for the classes a, b" in line
        assert "Supported extensions are: .jpg" in line


def test_coco_split_with_zero_images(tmp_path: Path, capfd) -> None:
    root = good_coco(tmp_path / "coco")
    coco(root, "val", [], [])
    line = refused(capfd, "fit", "detect-yolov3", *YOLO, f"data.root={root}", "--run-dir", str(tmp_path / "r"))
    assert f"coco: split 'val' ({root / 'annotations' / 'instances_val.json'}) has no usable images" in line


# ---------------------------------------------------------------------- 5: corrupt image files

@pytest.mark.parametrize("bad, problem", [("truncated.jpg", "cannot be decoded (corrupt or truncated): image file is "
                                                            "truncated"),
                                          ("random.png", "is not an image: no image format PIL reads")])
def test_image_folder_corrupt_image_names_the_file(tmp_path: Path, capfd, bad: str, problem: str) -> None:
    root = image_folder(tmp_path / "imgs", n=2)
    path = (truncated_jpeg if bad.endswith(".jpg") else random_bytes)(root / "train" / "a" / bad)
    run = tmp_path / "r"
    line = refused(capfd, "fit", "classify-fashion", *FOLDER, "data.batch_size=5", f"data.root={root}",
                   "--run-dir", str(run))
    assert f"image-folder split {root / 'train'}: 1 of 5 image files cannot be read: {path} {problem}" in line
    assert not run.exists()  # found before the first step: nothing written


def test_image_folder_corrupt_image_in_a_worker_is_one_line(tmp_path: Path) -> None:
    """A file whole to the up-front check that fails when decoded stops the run from the worker (a real
    process: the error crosses from the worker process, and the workers must be gone at the exit)."""
    root = image_folder(tmp_path / "imgs", n=2)  # batch 5: the 4 good train images and the bad one, in step 1
    path = broken_inside_jpeg(root / "train" / "a" / "broken.jpg")
    proc = vt("fit", "classify-fashion", *FOLDER, "data.batch_size=5", "data.num_workers=1", f"data.root={root}",
              "--run-dir", str(tmp_path / "r"))
    assert proc.returncode == 2 and str(path) in proc.stderr  # what holds already
    assert f"visiontrain: error: image file {path} cannot be decoded" in error_line(proc)


def test_coco_truncated_image_error_names_the_file(tmp_path: Path, capfd) -> None:
    root = good_coco(tmp_path / "coco", train=3)
    truncated_jpeg(root / "train" / "t.jpg")
    coco(root, "train", [*[(f"{i}.png", None) for i in (1, 2, 3)], ("t.jpg", None)])
    line = refused(capfd, "fit", "detect-yolov3", *YOLO, "data.batch_size=4", f"data.root={root}",
                   "--run-dir", str(tmp_path / "r"))
    assert f"1 image file cannot be read: image file {root / 'train' / 't.jpg'} cannot be decoded (corrupt or " \
           f"truncated)" in line
    assert "set data.on_bad_image=skip to drop it" in line


# ------------------------------------------------ 7-8 (and 5, 6 under skip): bad COCO annotations

def bad_coco(root: Path) -> Path:
    """Train: four good images of every odd mode (L, RGBA, P, I;16) with one good box each, plus a
    degenerate box (ann 201), a box outside the image (202), an unknown category (203), a file of
    random bytes named .png and a truncated JPEG."""
    images = [(f"{i}.png", mode_image(mode)) for i, mode in enumerate(("L", "RGBA", "P", "I;16"), start=1)]
    (root / "train").mkdir(parents=True)
    random_bytes(root / "train" / "5.png")
    truncated_jpeg(root / "train" / "6.jpg")
    images += [("5.png", None), ("6.jpg", None)]
    anns = [{"id": 100 + i, "image_id": i, "category_id": 1 + i % 2, "bbox": GOOD_BOX} for i in range(1, 7)]
    anns += [{"id": 201, "image_id": 2, "category_id": 1, "bbox": [10, 10, 0, 5]},
             {"id": 202, "image_id": 3, "category_id": 1, "bbox": [50, 10, 40, 20]},
             {"id": 203, "image_id": 4, "category_id": 99, "bbox": GOOD_BOX}]
    coco(root, "train", images, anns)
    return coco(root, "val", [("1.png", rgb_image(7)), ("2.png", rgb_image(8))])


def test_coco_bad_data_error_names_file_and_annotation(tmp_path: Path, capfd) -> None:
    root = bad_coco(tmp_path / "coco")
    line = refused(capfd, "fit", "detect-yolov3", *YOLO, "data.batch_size=5", f"data.root={root}",
                   "data.on_bad_annotation=error", "--run-dir", str(tmp_path / "r"))
    ann_file = root / "annotations" / "instances_train.json"
    assert (f"{ann_file}: {root / 'train' / '2.png'} annotation id 201: degenerate box [10.0, 10.0, 10.0, 15.0] "
            f"(needs x2 > x1 and y2 > y1) (set data.on_bad_annotation=skip to drop it)") in line


@pytest.mark.parametrize("keep, expected", [
    (202, "3.png annotation id 202: box [50.0, 10.0, 90.0, 30.0] is outside the 64x48 image"),
    (203, "4.png annotation id 203: unknown category id 99 (valid ids: 1, 2)"),
    (5, "image file {train}/5.png is not an image: no image format PIL reads"),
    (6, "image file {train}/6.jpg cannot be decoded (corrupt or truncated): image file is truncated"),
], ids=["box-outside", "unknown-category", "random-bytes-png", "truncated-jpeg"])
def test_coco_each_bad_kind_error_message(tmp_path: Path, keep: int, expected: str) -> None:
    """The error of each kind alone, through the task's data build (the CLI run above stops at the first)."""
    from visiontrain.tasks import build_task

    root = bad_coco(tmp_path / "coco")
    ann_file = root / "annotations" / "instances_train.json"
    data = json.loads(ann_file.read_text())
    images = {1, 2, 3, 4, keep}
    data["images"] = [i for i in data["images"] if i["id"] in images]
    data["annotations"] = [a for a in data["annotations"]
                           if a["image_id"] in images and (a["id"] < 200 or a["id"] == keep)]
    ann_file.write_text(json.dumps(data))
    cfg = C.load_config("detect-yolov3", [*YOLO, f"data.root={root}"])
    with pytest.raises(ValueError) as info:
        build_task(cfg).build_data()  # every image file is opened whole here: a truncated one too
    message = str(info.value)
    assert str(ann_file) in message and expected.format(train=root / "train") in message
    assert f"set data.on_bad_{'image' if keep in (5, 6) else 'annotation'}=skip" in message


def test_coco_bad_data_skip_drops_counts_and_trains(tmp_path: Path) -> None:
    root = bad_coco(tmp_path / "coco")
    run = tmp_path / "r"
    # a third of the images and three of seven boxes are bad here: more than the 10 % that stops a
    # run by default (test_skipped_share.py), so the share is raised to what this test is about
    proc = vt("fit", "detect-yolov3", *YOLO, "data.batch_size=4", f"data.root={root}",
              "data.on_bad_annotation=skip", "data.max_skipped_share=0.5", "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("coco train: skipped bad data (data.on_bad_annotation=skip): 1 box outside image, "
            "1 degenerate box, 1 unknown category, 2 unreadable image; "
            f"image file {root / 'train' / '5.png'} is not an image: no image format PIL reads; "
            f"image file {root / 'train' / '6.jpg'} cannot be decoded") in proc.stderr
    assert "skipping image file" not in proc.stderr  # the truncated JPEG was dropped up front, not per load
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 1 and (run / "checkpoints" / "last.pt").is_file()


# ------------------------------------------------------------- 6: grey, RGBA, palette, 16-bit images

@pytest.fixture(scope="module")
def odd_modes_init_run(digits_run: Path, tmp_path_factory) -> tuple[Path, Path, object]:
    """One training process for two cases (each costs 10-30 s here): an image folder of grey, RGBA,
    palette and 16-bit PNGs (6a) trained from --init of the 10-class grey digits run (9c).
    (root, checkpoint given to --init, finished process)."""
    root = image_folder(tmp_path_factory.mktemp("modes") / "imgs", n=4, modes=("L", "RGBA", "P", "I;16"))
    ckpt = digits_run / "checkpoints" / "last.pt"
    # in this process: no DataLoader workers to start (data.num_workers 0)
    proc = cli_here("fit", "classify-fashion", *FOLDER, f"data.root={root}", "--run-dir", str(root.parent / "r"),
                    "--init", str(ckpt))
    return root, ckpt, proc


def test_image_modes_image_folder_fit_and_tensors(odd_modes_init_run) -> None:
    from visiontrain.data.datasets import ClassificationReader, build_classification_data
    from visiontrain.data.images import open_rgb

    root, _, proc = odd_modes_init_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (root.parent / "r" / "checkpoints" / "last.pt").is_file()
    data = build_classification_data("image-folder", ClassificationReader(root=str(root), image_size=8))
    assert data.in_channels == 3
    for i, (path, _) in enumerate(data.train.samples):
        x, _ = data.train[i]
        assert x.dtype == torch.float32 and tuple(x.shape) == (3, 8, 8) and torch.isfinite(x).all(), path
    ramp = root / "train" / "a" / "3.png"
    with Image.open(ramp) as im:
        assert im.mode == "I;16"
    wide = np.asarray(open_rgb(str(ramp)))
    assert wide.dtype == np.uint8 and wide.shape == (12, 10, 3)
    # scaled by the 16-bit range as torchvision does (60000 -> 233), not clipped to white by convert("RGB")
    assert wide.min() == 0 and wide.max() == round(60000 / 65535 * 255) and len(np.unique(wide)) > 100


def test_image_modes_coco_read_to_model_input(tmp_path: Path) -> None:
    """The skip run above trains on these images; here the tensors: uint8 [3, H, W] samples, and the
    float batch of 3-channel images the model takes."""
    from visiontrain.tasks import build_task

    root = tmp_path / "coco"
    modes = ("L", "RGBA", "P", "I;16")
    coco(root, "train", [(f"{i}.png", mode_image(m)) for i, m in enumerate(modes, start=1)])
    coco(root, "val", [("1.png", rgb_image(7))])
    cfg = C.load_config("detect-yolov3", [*YOLO, f"data.root={root}"])
    data = build_task(cfg).build_data()
    raw = data.train.with_transform(None)
    for i, mode in enumerate(modes):
        image, target = raw[i]
        assert image.dtype == torch.uint8 and tuple(image.shape) == (3, H, W), mode
        assert tuple(target["boxes"].shape) == (1, 4)
        if mode in ("L", "I;16"):
            assert torch.equal(image[0], image[1]) and torch.equal(image[1], image[2])
    assert int(raw[3][0].max()) == round(60000 / 65535 * 255) and len(raw[3][0].unique()) > 100  # 16 -> 8 bits
    images, _, _ = data.train_collate([data.train[i] for i in range(4)])  # letterboxed to task.size=64
    assert images.dtype == torch.float32 and tuple(images.shape) == (4, 3, 64, 64) and torch.isfinite(images).all()


# ------------------------------------------------- 9: a checkpoint of another class count / recipe

def test_resume_other_class_count_refused_suggests_init(digits_run: Path, tmp_path: Path, capfd) -> None:
    ckpt = digits_run / "checkpoints" / "last.pt"
    before = digest(digits_run)
    root = image_folder(tmp_path / "imgs")
    line = refused(capfd, "fit", "classify-fashion", *FOLDER, f"data.root={root}", "--run-dir", str(tmp_path / "r"),
                   "--resume", str(ckpt))
    assert f"--resume {ckpt}: the checkpoint is of another model or class count" in line
    assert "checkpoint: task classification (plain_cnn), 10 classes; this run: task classification " \
           "(plain_cnn), 2 classes" in line
    assert "head.weight (10, 512) vs (2, 512)" in line and f"use --init {ckpt}" in line
    kept(before, digits_run)


def test_resume_other_recipe_refused_suggests_init(digits_run: Path, tmp_path: Path, capfd) -> None:
    ckpt = digits_run / "checkpoints" / "last.pt"
    root = good_coco(tmp_path / "coco")
    line = refused(capfd, "fit", "detect-yolov3", *YOLO, f"data.root={root}", "--run-dir", str(tmp_path / "r"),
                   "--resume", str(ckpt))
    assert "checkpoint: task classification (plain_cnn), 10 classes; this run: task yolo (darknet21), 2 classes" \
        in line
    assert "missing tensors: backbone." in line and f"use --init {ckpt}" in line


def test_init_skips_mismatched_tensors_and_reports_them(odd_modes_init_run) -> None:
    """The 10-class grey digits run's weights into a 2-class RGB image folder (the fit of 6a)."""
    _, ckpt, proc = odd_modes_init_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"--init {ckpt}: loaded 18/20 tensors; adapted blocks.0.0.0.weight 1 -> 3 input channels; "
            f"skipped 2 with another shape: head.weight (10, 512) -> (2, 512), head.bias (10,) -> (2,)") in proc.stdout


# ------------------------------------------------------ 10-11: truncated and pickled checkpoints

@pytest.fixture
def truncated_ckpt(digits_run: Path, tmp_path: Path) -> Path:
    data = (digits_run / "checkpoints" / "last.pt").read_bytes()
    path = tmp_path / "truncated.pt"
    path.write_bytes(data[:len(data) // 2])
    return path


def test_truncated_checkpoint_fit_resume(truncated_ckpt: Path, tmp_path: Path, capfd) -> None:
    data = truncated_ckpt.read_bytes()
    line = refused(capfd, "fit", "classify-fashion", *DIGITS, "--run-dir", str(tmp_path / "r"),
                   "--resume", str(truncated_ckpt))
    assert f"checkpoint {truncated_ckpt} is truncated or corrupt" in line
    assert truncated_ckpt.read_bytes() == data


@pytest.mark.parametrize("command", ["validate", "predict", "export", "init", "init-safetensors"])
def test_truncated_checkpoint_other_commands(truncated_ckpt: Path, digits_run: Path, tmp_path: Path, capfd,
                                            command: str) -> None:
    if command == "init-safetensors":
        weights = (digits_run / "model.safetensors").read_bytes()
        path = tmp_path / "model.safetensors"
        path.write_bytes(weights[:len(weights) // 2])
        line = refused(capfd, "fit", "classify-fashion", *DIGITS, "--run-dir", str(tmp_path / "r"), "--init", str(path))
        assert f"weights file {path} is truncated or corrupt" in line
        return
    if command == "validate":
        # one through a real process (the whole of its stderr is the line: torch's C++ reader printed
        # nothing of its own); the rest in this one
        line = only_line(vt("validate", str(truncated_ckpt)))
    else:
        args = {"predict": ["predict", str(truncated_ckpt), "x.png", "--out", str(tmp_path / "p")],
                "export": ["export", str(truncated_ckpt), "--format", "onnx"],
                "init": ["fit", "classify-fashion", *DIGITS, "--run-dir", str(tmp_path / "r"),
                         "--init", str(truncated_ckpt)]}[command]
        line = refused(capfd, *args)
    assert f"checkpoint {truncated_ckpt} is truncated or corrupt" in line


def damaged(digits_run: Path, tmp_path: Path, damage: str) -> Path:
    """The digits run's last.pt as a hostile or damaged file might have it: a tensor declaring 2^40
    elements (a zero-stride view: a few bytes on disk), a class count of 10^12, or a tensor the
    model has no place for. Each passes the weights_only load."""
    state = load_checkpoint(digits_run / "checkpoints" / "last.pt")
    weights = [fmt.model_weights(state), *([fmt.ema_weights(state)] if fmt.has_ema(state) else [])]
    for w in weights:
        if damage == "shape":
            w["head.weight"] = torch.zeros(1).as_strided((2 ** 20, 2 ** 20), (0, 0))
        elif damage == "extra":
            w["backdoor.weight"] = torch.zeros(3)
    if damage == "classes":
        fmt.data_info_of(state)["num_classes"] = 10 ** 12
    path = tmp_path / f"{damage}.pt"
    torch.save(state, path)
    return path


@pytest.mark.parametrize("command", ["validate", "predict", "export"])
@pytest.mark.parametrize("damage", ["shape", "classes", "extra"])
def test_a_checkpoint_whose_tensors_or_class_count_do_not_build_its_model_is_one_line(
        digits_run: Path, tmp_path: Path, capfd, damage: str, command: str) -> None:
    ckpt = damaged(digits_run, tmp_path, damage)
    image = tmp_path / "x.png"
    Image.new("L", (8, 8)).save(image)
    line = refused(capfd, *{"validate": ["validate", str(ckpt)],
                            "predict": ["predict", str(ckpt), str(image), "--out", str(tmp_path / "p")],
                            "export": ["export", str(ckpt), "--format", "onnx"]}[command])
    expected = {"shape": "weights do not fit the model its config builds (shapes differ: head.weight "
                         "(1048576, 1048576) vs (10, 512))",
                "classes": "its config and data_info do not build a model: ",
                "extra": "weights do not fit the model its config builds (tensors the model has no place for: "
                         "backdoor.weight)"}[damage]
    assert line.startswith(f"visiontrain: error: {ckpt}: ") and expected in line, line
    assert not (tmp_path / "p").exists() and not list(tmp_path.glob("*.onnx"))


NOT_CHECKPOINTS = {  # what a user hands over by mistake, and the words that must say what it is
    "text": (b"epoch 3: loss 0.41\nsaved the model in the cloud folder\n", "it looks like text"),
    "html": (b"<!DOCTYPE html>\n<html><head><title>Sign in</title></head><body>...</body></html>\n",
             "it is an HTML page"),
    "git-lfs": (b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"4d7a" * 16 + b"\nsize 1434087\n",
                "it is a git-LFS pointer, a small text file that stands for the real one: fetch the file itself "
                "with `git lfs pull`"),
    "empty": (b"", "it is empty (0 bytes)"),
}


@pytest.mark.parametrize("kind", sorted(NOT_CHECKPOINTS))
def test_a_file_that_is_no_checkpoint_says_what_it_is_in_every_command(kind: str, tmp_path: Path, capfd) -> None:
    """Each command that reads a checkpoint, given a text file, a web page, a git-LFS pointer or an
    empty file: one line naming the file and what it is, exit 2, nothing written (was a KeyError
    traceback, or 'holds objects other than tensors')."""
    content, words = NOT_CHECKPOINTS[kind]
    path = tmp_path / "model.pt"
    path.write_bytes(content)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(content)
    run, out = tmp_path / "r", tmp_path / "p"
    commands = {
        "validate": ["validate", str(path)],
        "export": ["export", str(path), "--format", "onnx"],
        "predict": ["predict", str(path), "x.png", "--out", str(out)],
        "--init": ["fit", "classify-fashion", *DIGITS, "--run-dir", str(run), "--init", str(path)],
        "--resume": ["fit", "classify-fashion", *DIGITS, "--run-dir", str(run), "--resume", str(path)],
        "--init safetensors": ["fit", "classify-fashion", *DIGITS, "--run-dir", str(run), "--init", str(weights)],
    }
    for name, args in commands.items():
        code, _, err = in_process(capfd, *args)
        named = weights if name == "--init safetensors" else path
        what = "a weights file" if name == "--init safetensors" else "a checkpoint"
        assert code == 2 and f"{named} is not {what}: {words}" in err, (name, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, (name, err)
        assert not run.exists() and not out.exists(), name  # nothing written, not even the run dir
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "model.safetensors"]


class _Payload:
    """Unpickling this would run ``open(MARKER, "w")``: the proof that a load ran the file's code."""

    marker = ""

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture
def pickled_ckpt(tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "code-ran"
    payload = _Payload()
    payload.marker = str(marker)
    path = tmp_path / "pickled.pt"
    torch.save({"model": payload, "config": {}}, path)
    return path, marker


def test_pickled_object_checkpoint_refused_validate(pickled_ckpt: tuple[Path, Path], capfd) -> None:
    path, marker = pickled_ckpt
    line = refused(capfd, "validate", str(path))
    assert f"checkpoint {path} holds objects other than tensors and plain containers and was refused " \
           f"(weights_only load; nothing in it was run): Unsupported global" in line
    assert not marker.exists()


@pytest.mark.parametrize("flag", ["--resume", "--init"])
def test_pickled_object_checkpoint_refused_fit(pickled_ckpt: tuple[Path, Path], tmp_path: Path, capfd,
                                               flag: str) -> None:
    path, marker = pickled_ckpt
    line = refused(capfd, "fit", "classify-fashion", *DIGITS, "--run-dir", str(tmp_path / "r"), flag, str(path))
    assert f"checkpoint {path} holds objects other than tensors" in line and "refused" in line
    assert "refused" in refused(capfd, "export", str(path), "--format", "onnx")
    assert not marker.exists()


# ------------------------------------------------------------ 12: another batch size, world size

def test_resume_of_a_checkpoint_without_its_split_with_another_batch_size_refused_run_dir_kept(
        run_copy: Path, capfd) -> None:
    """Through the CLI on a run dir whose checkpoint was written before a resume could change the
    batch split (its data entry records no accumulation): the message, and every file of the run dir
    as it was, config.yaml included (written only once the resume checks passed). A checkpoint that
    records its split resumes with another batch size by keeping its global batch
    (tests/engine/test_global_batch.py)."""
    last = run_copy / "checkpoints" / "last.pt"
    state = load_checkpoint(last)
    data = fmt.entry(state, fmt.DATA)
    del data["accum_steps"], data["follows_world_size"]  # as visiontrain wrote it before
    torch.save(state, last)
    before = digest(run_copy)
    line = refused(capfd, "fit", "classify-fashion", *DIGITS, "data.batch_size=8", "trainer.epochs=2",
                   "--run-dir", str(run_copy), "--resume", "auto")
    assert (f"--resume {last}: it was written with data.batch_size=16 on 1 process(es) x trainer.accum_steps=1; "
            f"this run has data.batch_size=8 on 1 x 1. An exact resume needs the global batch kept") in line
    assert "use --init" in line
    kept(before, run_copy)
    assert sorted(digest(run_copy)) == sorted(before)  # and nothing added (a config-N.yaml, a lock, a log)


# ------------------------------------------------------------------ file names that leave the dataset
def test_a_coco_file_name_outside_the_image_directory_is_bad_data_and_never_opened(tmp_path: Path, capfd) -> None:
    """A downloaded annotation file may name ``../x`` or ``/etc/...``: under ``error`` the run stops in
    one line naming it; under ``skip`` the image is dropped, and neither opens the file."""
    from visiontrain.data.detection.coco import read_coco

    root = tmp_path / "coco"
    build_coco(root)
    outside = tmp_path / "outside.jpg"
    shutil.copy(root / "train2017" / "000000.jpg", outside)  # a readable image: only the name is wrong
    ann_file = root / "annotations" / "instances_train2017.json"
    data = json.loads(ann_file.read_text())
    data["images"][0]["file_name"] = "../../outside.jpg"
    data["images"][1]["file_name"] = str(outside)
    ann_file.write_text(json.dumps(data))
    line = refused(capfd, "fit", "detect-yolov3", *YOLO, f"data.root={root}", "data.train_split=train2017",
                   "data.val_split=val2017", "--run-dir", str(tmp_path / "r"))
    assert (f"{ann_file}: image id 1: file_name '../../outside.jpg' is outside the image directory "
            f"{root / 'train2017'} (an absolute path or a '..' step; expected a path under it) "
            f"(set data.on_bad_annotation=skip to drop it)") in line
    kept = read_coco(str(ann_file), str(root / "train2017"), on_bad_annotation="skip")
    assert len(kept) == 6 and all(str(outside) not in r.path and ".." not in r.path for r in kept.records)
    assert not (tmp_path / "r").exists()


def test_a_voc_id_or_filename_outside_the_tree_is_bad_data(tmp_path: Path) -> None:
    from visiontrain.data.detection.voc import read_voc

    root = tmp_path / "voc"
    build_voc(root)
    split = root / "ImageSets" / "Main" / "trainval.txt"
    split.write_text("../../../etc/hostname\n" + split.read_text())
    xml = root / "Annotations" / "000001.xml"
    xml.write_text(xml.read_text().replace("<filename>000001.jpg</filename>", "<filename>/etc/hostname</filename>"))
    with pytest.raises(ValueError, match=r"line 1: image id '\.\./\.\./\.\./etc/hostname' is outside"):
        read_voc(str(root), "trainval")
    kept = read_voc(str(root), "trainval", on_bad_annotation="skip")
    assert len(kept) == 7 and all(r.path.startswith(str(root / "JPEGImages")) for r in kept.records)


def test_a_coco_file_nested_past_a_json_readers_depth_is_one_line(tmp_path: Path, capfd) -> None:
    root = tmp_path / "coco"
    build_coco(root)
    ann_file = root / "annotations" / "instances_train2017.json"
    ann_file.write_text('{"images": ' + "[" * 100_000 + "]" * 100_000 + "}")
    line = refused(capfd, "fit", "detect-yolov3", *YOLO, f"data.root={root}", "data.train_split=train2017",
                   "data.val_split=val2017", "--run-dir", str(tmp_path / "r"))
    assert f"{ann_file}: not valid COCO: nested too deeply for a JSON reader" in line
