"""The semantic task's network and loss: torchvision's heads on a ResNet of any depth at the output
stride asked for, logits at the input's size, a cross-entropy that leaves out the ignore index and
weighs classes as torch does, and segment-semantic's training (random resize, crop and flip drawn
from torch's RNG, a DataLoader worker) resumed bit-exactly after a crash and after kill -9."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import procs
from resume_checks import assert_bit_identical, fit_and_crash_resume, state_of
from visiontrain.core import config as C
from visiontrain.models.segmentation import FlipAveraged, SegmenterSpec, build_segmenter
from visiontrain.tasks.semantic import SemanticTask


@pytest.mark.parametrize("head, stride, aux", [("deeplabv3", 16, True), ("fcn", 8, False), ("deeplabv3", 32, False),
                                               ("deeplabv3plus", 16, True), ("fpn", 32, True)])
def test_the_network_gives_logits_at_the_input_size_from_features_at_the_stride(head, stride, aux):
    model = build_segmenter(SegmenterSpec("resnet18", head=head, output_stride=stride, atrous_rates=(1, 2, 3),
                                          aux_head=aux), 5).eval()
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        out, features = model(x), model.backbone(x)
    assert out["out"].shape == (1, 5, 64, 96) and ("aux" in out) == aux
    # the summary and the report name the network by its class
    assert type(model).__name__ == {"deeplabv3": "DeepLabV3", "fcn": "FCN", "deeplabv3plus": "DeepLabV3Plus",
                                    "fpn": "SemanticFPN"}[head]
    stages = features["out"] if isinstance(features["out"], dict) else {"high": features["out"]}
    assert list(stages.values())[-1].shape[-2:] == (64 // stride, 96 // stride)  # the last stage
    if head != "deeplabv3" and head != "fcn":  # DeepLabV3+'s decoder and the FPN take the first stage too, stride 4
        assert list(stages.values())[0].shape[-2:] == (16, 24)


def test_the_fpn_head_is_as_wide_as_task_fpn_channels_and_task_head_width_say():
    model = build_segmenter(SegmenterSpec("resnet18", head="fpn", output_stride=32, fpn_channels=32, head_width=16), 5)
    head = model.classifier
    assert {conv.out_channels for conv in head.fpn.layer_blocks.modules() if isinstance(conv, torch.nn.Conv2d)} == {32}
    assert head.fusion.classifier.in_channels == 16
    assert head.fusion.levels[0][0][0].in_channels == 32
    assert model(torch.randn(1, 3, 64, 64))["out"].shape == (1, 5, 64, 64)


class LeftRight(torch.nn.Module):
    """Logits that tell left from right: each pixel's class-1 logit is its column, so a mirrored
    image gives other logits unless they are mirrored back and averaged."""

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        columns = torch.arange(images.shape[-1], dtype=images.dtype).expand(*images.shape[-2:])
        return {"out": torch.stack([images[:, 0], images[:, 0] * 0 + columns], 1)}


@pytest.mark.parametrize("flip", [False, True])
def test_task_val_flip_averages_the_mirrored_images_logits_in_evaluation_predict_and_the_export(flip):
    """Under task.val_flip (segment-semantic's) the logits evaluation and predict read, and the
    exported network's, are the mean of the image's and its mirror's mirrored back; without it, the
    network's own."""
    task = SemanticTask(C.load_config("segment-semantic", [f"task.val_flip={str(flip).lower()}"]))
    model = LeftRight()
    images = torch.randn(2, 3, 4, 6)
    mirrored = torch.stack([images[:, 0].flip(-1).flip(-1), torch.arange(6.).flip(-1).expand(2, 4, 6)], 1)
    want = (model(images)["out"] + mirrored) / 2 if flip else model(images)["out"]
    assert torch.equal(FlipAveraged(model)(images)["out"], (model(images)["out"] + mirrored) / 2)
    assert torch.equal(task.logits(model, images), want)
    exported = task.export_spec(model, {"num_classes": 2, "class_names": ["a", "b"]})
    assert torch.equal(exported.module(images)[0], want)
    assert ("task.val_flip" in exported.metadata["output"]) == flip
    assert torch.equal(task.logits(model, images)[..., 1, :, :].mean(-1), torch.full((2, 4), 2.5))


def test_the_loss_leaves_out_the_ignore_index_and_weighs_classes_as_torch_does():
    task = SemanticTask(C.load_config("segment-semantic", ["task.class_weights=[1,2,0.5]"]))
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 3, 8, 8), torch.randint(0, 3, (2, 8, 8))
    labels[0, :4] = 255
    want = F.cross_entropy(logits, labels, weight=torch.tensor([1, 2, 0.5]), ignore_index=255)
    assert torch.allclose(task.pixel_loss(logits, labels), want)
    assert task.pixel_loss(logits, torch.full_like(labels, 255)) == 0  # no labelled pixel: 0, not 0 / 0


def test_segment_semantic_resumes_bit_exact_after_a_crash(tmp_path):
    """segment-semantic as shipped (its transforms, one worker, the poly schedule's warmup, the aux
    head), on 16 images in batches of 4 and 64 px crops, crashed after step 4's checkpoint."""
    cfg = C.load_config("segment-semantic", [
        "data.limit_train=16", "data.limit_val=4", "data.batch_size=4", "task.crop=64", "task.train_sizes=[64,96]",
        "trainer.max_steps=6", "eval.every=0", "checkpoint.every=2", "checkpoint.unit=steps", "trainer.progress=plain"])
    full, resumed = fit_and_crash_resume(cfg, tmp_path, crash_at=4)
    assert resumed.step == full.step == 6
    assert_bit_identical(state_of(full), state_of(resumed))


def test_segment_semantic_killed_with_sigkill_resumes_auto_to_the_uninterrupted_weights(tmp_path):
    """`visiontrain fit segment-semantic` as shipped (its transforms, one forkserver worker, the poly
    schedule), small: SIGKILL to its whole process tree as soon as its first checkpoint is on disk,
    then `--resume auto` to the end gives the weights of a run never interrupted, bit for bit."""
    args = ["data.limit_train=16", "data.limit_val=4", "data.batch_size=4", "task.crop=64", "task.train_sizes=[64,96]",
            "trainer.max_steps=24", "eval.every=0", "checkpoint.every=2", "checkpoint.unit=steps"]
    fit = [sys.executable, "-m", "visiontrain", "fit", "segment-semantic", *args, "--run-dir"]
    whole = procs.run([*fit, tmp_path / "whole"], timeout=300)
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = procs.popen([*fit, tmp_path / "killed"])
    last = tmp_path / "killed" / "checkpoints" / "last.pt"
    procs.wait_for(last.is_file, "first checkpoint", killed)
    procs.kill_everything(killed)
    assert killed.returncode == -9 and not (tmp_path / "killed" / "model.safetensors").exists()  # killed mid-run
    resumed = procs.run([*fit, tmp_path / "killed", "--resume", "auto"], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = (load_file(str(tmp_path / run / "model.safetensors")) for run in ("whole", "killed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
