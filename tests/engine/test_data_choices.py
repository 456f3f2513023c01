"""data.num_workers=auto, data.on_device=auto and data.decode=auto: each choice from a faked device,
core count and free memory (engine/setup/data_choices.py, tasks/classification.decodes_on_device),
and the line a run says it in."""
from __future__ import annotations

import pytest
import torch

from visiontrain.core import config as C
from visiontrain.core.config import ConfigError
from visiontrain.engine.setup import data_choices
from visiontrain.engine.setup.data_choices import auto_workers, choose_workers, keeps_on_device
from visiontrain.tasks.classification import decodes_on_device


@pytest.mark.parametrize("cores, device, processes, in_memory, expected", [
    (2, "cpu", 1, False, 1),     # this machine: the recipes keep their one worker
    (2, "cpu", 1, True, 0),      # classify-fashion keeps loading in the training process
    (16, "cpu", 1, False, 4),    # the step's threads keep three quarters of the cores
    (16, "cuda", 1, False, 15),  # a GPU: all but the core that launches the step
    (64, "cuda", 1, False, 16),  # capped
    (16, "cuda", 8, False, 1),   # torchrun's 8 processes share 16 cores: 2 each, 1 worker
    (96, "cuda", 8, False, 11),
    (16, "cuda", 1, True, 0),    # in memory: an index, and data.on_device keeps it on the GPU
])
def test_auto_workers(cores, device, processes, in_memory, expected):
    assert auto_workers(cores, device, processes, in_memory) == expected


def test_the_recipes_auto_is_resolved_once_with_its_line(monkeypatch):
    monkeypatch.setattr(data_choices, "usable_cores", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = C.load_config("detect-yolov3", [])
    assert cfg.data.num_workers == "auto"  # as shipped
    line = choose_workers(cfg, "cuda")
    assert cfg.data.num_workers == 7 and line == "data.num_workers=auto: 7 (16 cores, shared by 2 processes, a GPU)"
    assert choose_workers(cfg, "cuda") is None  # a number (now) is kept
    fashion = C.load_config("classify-fashion", [])
    assert "held in memory" in choose_workers(fashion, "cuda") and fashion.data.num_workers == 0
    forced = C.load_config("detect-yolov3", ["data.num_workers=3"])
    assert choose_workers(forced, "cuda") is None and forced.data.num_workers == 3


def test_on_device_auto_needs_a_gpu_no_workers_and_room():
    gpu, cpu, mb = torch.device("cuda", 0), torch.device("cpu"), 2**20
    assert keeps_on_device("auto", gpu, 0, 47 * mb, 100_000 * mb)
    assert not keeps_on_device("auto", gpu, 2, 47 * mb, 100_000 * mb)   # workers cannot reach it
    assert not keeps_on_device("auto", gpu, 0, 47 * mb, 100 * mb)       # more than a quarter of what is free
    assert not keeps_on_device("auto", cpu, 0, 47 * mb, None)           # nothing to move on a CPU
    assert keeps_on_device(True, cpu, 0, 47 * mb, None)                 # forced: the same code on the CPU
    with pytest.raises(ConfigError, match="data.on_device=true .* set data.num_workers=0 \\(got 2\\)"):
        keeps_on_device(True, gpu, 2, 47 * mb, 100_000 * mb)


def test_decode_auto_is_gpu_for_the_imagenet_crop_on_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    imagenet = C.load_config("classify-mobilevit-imagenet", [])
    assert imagenet.data.decode == "auto" and decodes_on_device(imagenet.data, "auto")
    assert not decodes_on_device(imagenet.data, "cpu")
    flip = C.load_config("classify-mobilevit-imagenet", ["data.augment=flip"])
    assert not decodes_on_device(flip.data, "auto")  # only the imagenet crop is done on the device
    forced = C.load_config("classify-mobilevit-imagenet", ["data.decode=gpu"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert decodes_on_device(forced.data, "auto") and not decodes_on_device(imagenet.data, "auto")
    assert not decodes_on_device(C.load_config("classify-fashion", []).data, "cuda")  # no files to decode
    shards = C.load_config("classify-mobilevit-imagenet", ["data.name=shards", "data.shards=s3://b/p"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not decodes_on_device(shards.data, "auto")  # a shard's members are decoded on the CPU path
    with pytest.raises(ConfigError, match="data.decode=gpu reads image files from data.name=image-folder"):
        decodes_on_device(C.load_config("classify-mobilevit-imagenet", ["data.name=shards", "data.decode=gpu"]).data,
                          "auto")
