"""One task registry: ``register_task(name, TaskClass, ConfigClass)`` types a recipe's ``task:``
section and builds the task in every command; a task declares what it predicts (``Task.predicts``),
and inference reads its predictions by that declaration, not by the task's class."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from visiontrain.core import config as C
from visiontrain.core.config import doc
from visiontrain.engine.protocols.task import (TASK_REGISTRY, Prediction, Task, TaskConfig, TaskData, TaskInputs,
                                              register_task)
from visiontrain.use.inference import Detections, Predictor
from visiontrain.tasks import build_task


@dataclass
class SquareConfig(TaskConfig):
    name: str = doc("task name", "square")
    side: int = doc("side of the one box every image gets, in pixels", 4, minimum=1)


class SquareTask(Task):
    """Boxes without being a DetectionTask: one box per image, its score 0.9, at the top left."""
    name = "square"
    predicts = Prediction.BOXES
    predict_threshold = 0.5
    default_loss_weights = {"l2": 1.0}

    def build_data(self) -> TaskData:
        data = torch.utils.data.TensorDataset(torch.zeros(4, 3))
        return TaskData(data, data, {"num_classes": 2, "class_names": ["cat", "dog"], "category_ids": [7, 9]})

    def build_model(self, info: dict[str, Any]) -> nn.Module:
        return nn.Linear(3, 1)

    def losses(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        return {"l2": model(batch[0]).pow(2).mean()}

    def evaluate(self, model: nn.Module, data: Any) -> dict[str, float]:
        return {}

    def predict(self, model: nn.Module, images: list[torch.Tensor], device: torch.device
                ) -> list[dict[str, torch.Tensor]]:
        s = float(self.cfg.task.side)
        return [{"boxes": torch.tensor([[0.0, 0.0, s, s], [1.0, 1.0, 2.0, 2.0]]), "scores": torch.tensor([0.9, 0.2]),
                 "labels": torch.tensor([1, 0])} for _ in images]


@pytest.fixture
def registered():
    """Registers the square task for one test (taken out again after it: tests/support/registries.py)."""
    register_task("square", SquareTask, SquareConfig)


def test_one_call_types_the_task_section_and_builds_the_task(registered):
    cfg = C.config_from_dict({"task": {"name": "square", "side": 6}})
    assert type(cfg.task) is SquareConfig and cfg.task.side == 6
    task = build_task(cfg)
    assert type(task) is SquareTask and task.cfg == TaskInputs.of(cfg)  # what it reads of the config
    with pytest.raises(C.ConfigError, match=r"task\.sid\b.*side"):  # the task's own keys, checked as the engine's
        C.config_from_dict({"task": {"name": "square", "sid": 6}})
    assert "task.side" in [row[0] for row in C.describe_keys(cfg)]  # show-config --docs


def test_an_unknown_task_names_the_close_one_and_every_registered_one(registered):
    with pytest.raises(C.ConfigError) as err:
        C.config_from_dict({"task": {"name": "squares"}}, source="r.yaml")
    assert str(err.value).startswith("r.yaml: task.name: unknown task 'squares' (did you mean 'square'?); "
                                     "expected one of ")
    assert all(name in str(err.value) for name in ("classification", "detr", "dino", "rcnn", "yolo", "square"))


def test_a_task_that_predicts_boxes_is_read_as_a_detector_whatever_its_class(registered):
    """The Predictor reads a task's predictions by what it declares: a task of one's own that
    predicts boxes gives Detections (its threshold, the class names and ids of its info)."""
    cfg = C.config_from_dict({"task": {"name": "square", "side": 5}})
    task = build_task(cfg)
    predictor = Predictor(task, task.build_model({}), task.build_data().info, device="cpu")
    assert predictor.prediction is Prediction.BOXES and predictor.kind == "detection"
    result = predictor(torch.zeros(3, 8, 8, dtype=torch.uint8))
    assert isinstance(result, Detections)
    assert result.boxes.tolist() == [[0.0, 0.0, 5.0, 5.0]]  # the 0.2 box is under predict_threshold
    assert result.names == ["dog"] and result.category_ids == [9] and result.image_size == (8, 8)
    assert len(predictor(torch.zeros(3, 8, 8, dtype=torch.uint8), threshold=0.1)) == 2
    with pytest.raises(ValueError, match="top_k applies to classification"):
        predictor(torch.zeros(3, 8, 8), top_k=2)


def test_the_built_in_tasks_declare_what_they_predict():
    kinds = {name: entry.task_class.predicts for name, entry in TASK_REGISTRY.items()}
    assert {k: kinds[k] for k in ("classification", "detr", "rcnn", "yolo", "dino", "semantic")} == {
        "classification": Prediction.CLASS_SCORES, "detr": Prediction.BOXES, "rcnn": Prediction.BOXES,
        "yolo": Prediction.BOXES, "dino": Prediction.NONE, "semantic": Prediction.LABEL_MAP}


class Unsaid(SquareTask):
    name = "unsaid"
    predicts = Prediction.NONE


class Thresholdless(Task):
    name = "thresholdless"
    predicts = Prediction.BOXES
    predict = SquareTask.predict


class ClaimsScores(Task):
    name = "claims"
    predicts = Prediction.CLASS_SCORES


@pytest.mark.parametrize("name, task_class, config_class, message", [
    ("squares", SquareTask, SquareConfig, r"SquareTask\.name is 'square'; a task registers under its own name"),
    ("unsaid", Unsaid, SquareConfig, r"Unsaid overrides predict but declares predicts = Prediction\.NONE"),
    ("claims", ClaimsScores, SquareConfig, r"ClaimsScores declares predicts = Prediction\.CLASS_SCORES but does not "
                                           r"override predict"),
    ("thresholdless", Thresholdless, SquareConfig, r"Thresholdless predicts boxes but has no predict_threshold"),
    ("square", SquareConfig, SquareConfig, r"expected a subclass of Task and one of TaskConfig"),
    ("square", SquareTask, dict, r"expected a subclass of Task and one of TaskConfig"),
])
def test_a_declaration_the_commands_cannot_act_on_fails_at_registration(name, task_class, config_class, message):
    with pytest.raises(ValueError, match=message):
        register_task(name, task_class, config_class)
    assert name not in TASK_REGISTRY or TASK_REGISTRY[name].task_class is not task_class


def test_a_task_reads_only_its_inputs():
    """Every built-in task reads of the config only what ``TaskInputs`` holds (its section, data, eval,
    the seed, the device): a read of ``cfg.trainer`` or ``self.cfg.optim`` in a task's file fails here,
    as tests/engine/test_parts.py holds the trainer to the parts' names."""
    import ast
    import dataclasses
    from pathlib import Path

    import visiontrain.tasks

    allowed = {f.name for f in dataclasses.fields(TaskInputs)}
    reads = []
    for path in sorted(Path(visiontrain.tasks.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                base = node.value
                if (base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)) == "cfg":
                    reads.append((f"{path.name}:{node.lineno}", node.attr))
    assert len(reads) > 30, reads  # the scan finds the tasks' reads (a scan that found none would prove nothing)
    assert not [f"{where}: cfg.{attr}" for where, attr in reads if attr not in allowed]
