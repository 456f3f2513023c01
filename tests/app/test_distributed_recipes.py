"""Every task family under torchrun with 2 gloo ranks (`fit --nproc 2`): it trains, evaluates sharded
(classification sums, COCO detections gathered to rank 0, the k-NN bank gathered), and the result
equals a one-process `validate` of the checkpoint it wrote; only rank 0 writes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from detection_helpers import vt
from tiny import DINO as DINO_TINY, DINO_NO_WARMUP as NO_WARMUP, RCNN as RCNN_TINY, YOLO as YOLO_TINY
from visiontrain.app import cli


@pytest.fixture(scope="module")
def coco_root(mosaic_coco) -> Path:
    return mosaic_coco(8, 4)  # 4 val images: 2 per rank, no padding duplicates


def cases(coco: Path) -> dict[str, tuple[list[str], str]]:
    # detection and k-NN evaluate one image per batch, so one process and two ranks compute the same
    # thing (a padded batch of other images would change border features); in-process loading: the
    # subject is rank equivalence, and test_recipes.py runs the recipes' own workers
    det = ["data.name=coco", f"data.root={coco}", "data.batch_size=2", "data.eval_batch_size=1",
           "data.num_workers=0", "trainer.epochs=1"]
    return {
        "classify-fashion": (["data.name=digits", "data.batch_size=64", "trainer.epochs=1", "data.limit_train=512",
                              "data.limit_val=100"], "top1"),
        "detect-detr": (det + ["task.backbone=resnet18", "task.hidden_dim=32", "task.dim_feedforward=64",
                        "task.enc_layers=1", "task.dec_layers=1", "task.num_queries=5", "task.train_scales=[96]",
                        "task.val_size=96", "task.max_size=128"], "AP"),
        # Faster R-CNN's path and the mask branch: masks pasted on each rank, their RLE gathered to rank 0
        "segment-mask-rcnn": (det + RCNN_TINY[:-2], "mask_AP"),
        "detect-yolov3": (det + YOLO_TINY + ["task.size=64", "task.val_size=64", "task.multiscale_sizes=[64]"],
                          "AP"),
        "ssl-dino": (DINO_TINY + ["data.batch_size=16", "trainer.epochs=1", "data.limit_train=128",
                                  "task.knn_bank=101", "data.limit_val=50", "eval.at_start=false",
                                  "data.eval_batch_size=1"] + NO_WARMUP,
                     "ema/knn_top1"),
        # FSDP: parameters, gradients and optimizer state sharded (a ResNet's bottlenecks and a ViT's
        # blocks each a unit); batch-norm statistics taken from rank 0, as under DDP
        # trainer.precision=fp32: the recipe's bf16 autocast under FSDP2 on the CPU (gloo) turns the
        # strided 3x3 convolutions of ResNet-18 (layer3.0.conv1, layer4.0.conv1) non-finite at the
        # first step while DDP and one process train the same config finitely (docs/distributed.md)
        "classify-fashion fsdp": (["task.model=resnet18", "data.name=digits", "data.batch_size=32",
                                   "trainer.epochs=1", "data.limit_train=128", "data.limit_val=50",
                                   "data.eval_batch_size=1", "distributed.strategy=fsdp",
                                   "trainer.precision=fp32"], "top1"),
        "ssl-dino fsdp": (DINO_TINY + ["task.backbone_args={embed_dim: 32, depth: 2, num_heads: 2}",
                                       "data.batch_size=16", "trainer.epochs=1", "data.limit_train=64",
                                       "task.knn_bank=101", "data.limit_val=50", "eval.at_start=false",
                                       "data.eval_batch_size=1", "distributed.strategy=fsdp"] + NO_WARMUP,
                          "ema/knn_top1"),
    }


@pytest.mark.parametrize("case", ["classify-fashion", "detect-detr", "segment-mask-rcnn", "detect-yolov3",
                                  "ssl-dino", "classify-fashion fsdp", "ssl-dino fsdp"])
def test_two_ranks_train_and_evaluate_like_one_process(case, coco_root, tmp_path, capsys):
    overrides, metric = cases(coco_root)[case]
    recipe = case.split()[0]
    run = tmp_path / "run"
    proc = vt("fit", recipe, *overrides, "trainer.progress=plain", "--run-dir", str(run), "--nproc", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] >= 1
    # the one process is this one (cli.main): the subject is the two ranks' result, and a process's
    # start-up would cost more than the evaluation
    capsys.readouterr()
    assert cli.main(["validate", str(run / "checkpoints" / "last.pt")]) == 0
    validated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in [metric, *(["AP"] if metric == "mask_AP" else [])]:  # the mask family: its boxes' AP too
        assert validated[key] == pytest.approx(summary["final"][key], abs=1e-6), key
    stray = [p.name for p in run.rglob("*") if p.is_file() and "rank" in p.name]
    assert not stray
    if case.endswith("fsdp"):  # each rank wrote its shards into the directory last.pt names
        assert len(list((run / "checkpoints").glob("step-*.dcp/*.distcp"))) >= 2
