"""visiontrain.core.config: recipes, typed overrides, errors that name the key, docs, dump round trip."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import pytest
import yaml

from visiontrain.core import config as C
from visiontrain.core.config import ConfigError, load_config
from visiontrain.data.datasets.sources import FashionMnistDataConfig
from visiontrain.engine.optim.schedules import ScheduleConfig
from visiontrain.engine.protocols.task import registered_task
from visiontrain.tasks.classification import ClassificationConfig
from visiontrain.core.typed_config import all_keys

FASHION = "classify-fashion"


def err(recipe: str, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(recipe, overrides)
    return str(info.value)


def dotted(tree: dict, key: str):
    node = tree
    for part in key.split("."):
        assert isinstance(node, dict) and part in node, key
        node = node[part]
    return node


# --- loading and overrides ---------------------------------------------------------------

def test_load_builtin_recipe_values_from_yaml() -> None:
    cfg = load_config(FASHION)
    raw = yaml.safe_load((C.RECIPES_DIR / f"{FASHION}.yaml").read_text())
    assert isinstance(cfg, C.Config)
    assert isinstance(cfg.task, ClassificationConfig)
    assert cfg.task.model == raw["task"]["model"] == "plain_cnn" and cfg.task.model_args == {}
    assert cfg.optim.name == "adamw" and cfg.optim.lr == 0.003 and cfg.optim.weight_decay == 0.05
    assert cfg.data.batch_size == 256 and cfg.trainer.epochs == 14
    assert cfg.data.augment == "flip" and cfg.trainer.precision == "auto"
    assert cfg.schedules["lr"] == ScheduleConfig(shape="cosine", warmup=0.3, unit="run", warmup_shape="cosine",
                                                 warmup_start=1.2e-4, end=1.2e-8)
    # keys the recipe leaves out keep their dataclass defaults
    assert cfg.trainer.max_steps is None and cfg.ema.enabled is False and cfg.optim.beta2 == 0.999


def test_overrides_apply_with_types() -> None:
    cfg = load_config(FASHION, ["optim.lr=0.0003", "data.batch_size=64", "trainer.max_steps=null",
                                "schedules.lr.end=0.001", "optim.weight_decay=0", "schedules.lr.warmup=2",
                                "optim.lr_mult={backbone: 1}", "optim.freeze=[stem, 'layer1\\.']",
                                "task.drop_rate=0"])
    assert cfg.optim.lr == 0.0003 and type(cfg.optim.lr) is float
    assert cfg.data.batch_size == 64 and type(cfg.data.batch_size) is int
    assert cfg.trainer.max_steps is None
    assert cfg.schedules["lr"].end == 0.001 and cfg.schedules["lr"].shape == "cosine"  # rest kept
    # int -> float for float-typed keys (the only conversion)
    for value in (cfg.optim.weight_decay, cfg.schedules["lr"].warmup, cfg.optim.lr_mult["backbone"],
                  cfg.task.drop_rate):
        assert type(value) is float
    assert cfg.optim.weight_decay == 0.0 and cfg.schedules["lr"].warmup == 2.0
    assert cfg.optim.freeze == ["stem", "layer1\\."]
    # a null override of an optional key, and a new schedule
    cfg = load_config(FASHION, ["trainer.max_steps=100", "schedules.weight_decay.shape=linear",
                                "schedules.weight_decay.end=0.99"])
    assert cfg.trainer.max_steps == 100
    assert cfg.schedules["weight_decay"] == ScheduleConfig(shape="linear", end=0.99)


def test_override_exponent_float_without_dot() -> None:
    cfg = load_config(FASHION, ["optim.lr=3e-4", "data.batch_size=64", "trainer.max_steps=null",
                                "schedules.lr.end=0.001"])
    assert cfg.optim.lr == 3e-4 and type(cfg.optim.lr) is float


def test_override_syntax_errors() -> None:
    assert "expected key=value" in err(FASHION, ["seed"])
    msg = err(FASHION, ["seed.x=1"])
    assert "seed.x" in msg and "not a section" in msg


# --- errors that name the key ------------------------------------------------------------

def test_unknown_key_suggests_close_key() -> None:
    msg = err(FASHION, ["optim.lrr=1"])
    assert "'optim.lrr'" in msg
    assert "did you mean" in msg and "optim.lr," in msg.split("did you mean", 1)[1]


def test_unknown_top_level_section() -> None:
    msg = err(FASHION, ["optimizer.lr=1"])
    assert "unknown config key 'optimizer'" in msg
    assert "optim" in msg and "top level" in msg


def test_unknown_task_key_suggests_task_model() -> None:
    msg = err(FASHION, ["task.mdoel=x"])
    assert "'task.mdoel'" in msg and "task.model" in msg.split("did you mean", 1)[1]


def test_unknown_schedule_key() -> None:
    msg = err(FASHION, ["schedules.lr.shap=cosine"])
    assert "'schedules.lr.shap'" in msg and "schedules.lr.shape" in msg


def test_wrong_type_names_key_and_type() -> None:
    msg = err(FASHION, ["data.batch_size=abc"])
    assert "data.batch_size" in msg and "int" in msg and "'abc'" in msg
    msg = err(FASHION, ["optim.lr=fast"])
    assert "optim.lr" in msg and "float" in msg
    msg = err(FASHION, ["optim.freeze=conv"])
    assert "optim.freeze" in msg and "list" in msg


def test_a_negative_optimizer_setting_names_the_key() -> None:
    """optim.lr=-0.1 once passed the config and reached torch's optimizer; like data.batch_size=0 it is
    refused naming the key, as is every other optimizer setting torch refuses below zero."""
    for key in ("optim.lr", "optim.weight_decay", "optim.momentum", "optim.beta2", "optim.eps"):
        assert f"{key}: expected a number >= 0, got -0.1" in err(FASHION, [f"{key}=-0.1"])
    assert C.load_config(FASHION, ["optim.lr=0"]).optim.lr == 0.0  # a frozen-weights run is a valid request


def test_bool_refused_for_int_and_float_and_int_for_bool() -> None:
    msg = err(FASHION, ["data.batch_size=true"])
    assert "data.batch_size" in msg and "int" in msg
    msg = err(FASHION, ["optim.lr=false"])
    assert "optim.lr" in msg and "float" in msg
    msg = err(FASHION, ["data.download=1"])
    assert "data.download" in msg and "bool" in msg
    msg = err(FASHION, ["data.batch_size=2.5"])  # no float -> int conversion
    assert "data.batch_size" in msg and "int" in msg


def test_literal_lists_allowed_values() -> None:
    msg = err(FASHION, ["trainer.precision=fp8"])
    assert "trainer.precision" in msg and "'fp8'" in msg
    for allowed in ("'fp32'", "'bf16'", "'fp16'"):
        assert allowed in msg
    msg = err(FASHION, ["optim.name=adamm"])
    assert "optim.name" in msg and "did you mean 'adam" in msg


def test_unknown_task_name() -> None:
    msg = err(FASHION, ["task.name=clasification"])
    assert "task.name" in msg and "'clasification'" in msg and "did you mean 'classification'" in msg


def test_unknown_recipe_suggests_close_names() -> None:
    msg = err("classify-fashon")
    assert "unknown recipe 'classify-fashon'" in msg and "did you mean classify-fashion" in msg
    assert "does not exist" in err("/nonexistent/dir/recipe.yaml")


@pytest.mark.parametrize("text,kind", [("- a\n- b\n", "list"), ("just a string\n", "str")])
def test_recipe_file_not_a_mapping(tmp_path: Path, text: str, kind: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    msg = err(str(path))
    assert str(path) in msg and "expected a mapping" in msg and kind in msg


def test_recipe_file_not_a_mapping_with_override(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("- a\n- b\n")
    msg = err(str(path), ["seed=1"])
    assert "expected a mapping" in msg


def test_recipe_file_invalid_yaml(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("optim: {lr: [1, 2\n")
    msg = err(str(path))
    assert str(path) in msg and "not valid YAML" in msg


def test_config_from_dict_error_prefix_and_empty_tree() -> None:
    with pytest.raises(ConfigError, match=r"^src\.yaml: data\.batch_size"):
        C.config_from_dict({"data": {"batch_size": "x"}}, source="src.yaml")
    cfg = C.config_from_dict({})
    assert cfg == C.Config(task=ClassificationConfig())


# --- built-in recipes, docs, dump round trip ---------------------------------------------

REQUIRED = ["seed", "trainer.epochs", "trainer.max_steps", "trainer.log_every", "trainer.precision",
            "data.name", "data.batch_size", "optim.lr"]


def test_list_recipes() -> None:
    names = C.list_recipes()
    assert FASHION in names and names == sorted(names)
    assert names == sorted(p.stem for p in C.RECIPES_DIR.glob("*.yaml"))


#: The recipes that ship a precision other than auto, each with its reason in a comment beside it.
WRITES_ITS_PRECISION = {"detect-faster-rcnn", "segment-mask-rcnn", "segment-panoptic", "segment-semantic"}


@pytest.mark.parametrize("recipe", C.list_recipes())
def test_every_builtin_recipe_loads(recipe: str) -> None:
    cfg = load_config(recipe)
    text = (C.RECIPES_DIR / f"{recipe}.yaml").read_text()
    tree = C.config_to_dict(cfg)
    for key in REQUIRED:
        dotted(tree, key)
    assert type(cfg.seed) is int and type(cfg.optim.lr) is float and cfg.optim.lr > 0
    assert type(cfg.data.batch_size) is int and cfg.data.batch_size > 0
    # the hardware chooses (engine/step/precision.py), unless the recipe says why it does not
    assert cfg.trainer.precision == "auto" or (recipe in WRITES_ITS_PRECISION and "fp32, not auto: " in text)
    assert type(cfg.task) is registered_task(cfg.task.name).config_class


def test_describe_keys_every_key_documented() -> None:
    cfg = load_config(FASHION)
    rows = C.describe_keys(cfg)
    keys = [k for k, _, _ in rows]
    assert len(keys) == len(set(keys))
    # every dataclass field, the task's own keys included
    sections = {name: getattr(cfg, name) for name in C.SECTIONS}
    want = ["seed", *sections] + [key for name, value in sections.items() if dataclasses.is_dataclass(value)
                                  for key in all_keys(type(value), f"{name}.")]
    want += [f"task.{f.name}" for f in dataclasses.fields(ClassificationConfig)]
    want += [f"data.{f.name}" for f in dataclasses.fields(FashionMnistDataConfig)]  # the source's own keys
    assert set(want) <= set(keys)
    assert "task.model" in keys and "optim.lr" in keys
    undocumented = [k for k, _, text in rows if not text.strip()]
    assert undocumented == []
    types = dict((k, t) for k, t, _ in rows)
    assert types["data.batch_size"] == "int" and types["trainer.max_steps"] == "int or null"


def test_describe_keys_documents_schedule_fields() -> None:
    cfg = load_config(FASHION)
    docs = {k: text for k, _, text in C.describe_keys(cfg)}
    for f in dataclasses.fields(ScheduleConfig):
        assert docs.get(f"schedules.lr.{f.name}", "").strip(), f"schedules.lr.{f.name}"


@pytest.mark.parametrize("recipe,overrides", [
    (FASHION, []),
    (FASHION, ["optim.lr_mult={'^backbone': 0.1}", "optim.freeze=[stem]", "schedules.lr.milestones=[1, 2.5]",
               "trainer.max_steps=7", "task.loss_weights={ce: 1}", "optim.eps=1.0e-7"]),
    ("classify-mobilevit-imagenet", []),
])
def test_dump_yaml_round_trip(recipe: str, overrides: list[str]) -> None:
    cfg = load_config(recipe, overrides)
    text = C.dump_config(cfg)
    again = C.config_from_dict(yaml.safe_load(text), source="dump")
    assert again == cfg
    assert type(again.task) is type(cfg.task)
    assert C.dump_config(again) == text


def test_override_reaches_a_dotted_schedule_name() -> None:
    cfg = load_config("ssl-dino", ["schedules.task.teacher_temp.warmup=3", "schedules.loss.dino.shape=cosine",
                                   "schedules.task.student_temp={shape: linear, end: 0.2}"])
    assert cfg.schedules["task.student_temp"].end == 0.2
    assert cfg.schedules["task.teacher_temp"].warmup == 3 and cfg.schedules["task.teacher_temp"].warmup_start == 0.04
    assert cfg.schedules["loss.dino"].shape == "cosine"


@dataclasses.dataclass
class _OwnerKeys:
    every: int = C.doc("the owner's key", 1, minimum=0)


@dataclasses.dataclass
class _AddedKeys:
    backend: Literal["fast", "slow"] = C.doc("a key another module adds", "fast")


def test_extend_section_adds_typed_documented_keys_from_another_module(monkeypatch):
    """``extend_section`` (how ``eval.coco_backend`` reaches the engine's ``eval`` section): the added key
    is set, checked and documented like the owner's, the owner's dataclass still types the value, two
    loads compare equal, a value pickles; registering the owner after the extension keeps the key."""
    import pickle

    C.extend_section("probe", _AddedKeys)  # before its owner registers it
    C.register_section("probe", _OwnerKeys, "a section of the test")
    cfg = C.config_from_dict({"probe": {"backend": "slow", "every": 3}})
    assert isinstance(cfg.probe, _OwnerKeys) and (cfg.probe.every, cfg.probe.backend) == (3, "slow")
    assert C.config_from_dict({}).probe.backend == "fast" and C.config_from_dict({}) == C.config_from_dict({})
    assert pickle.loads(pickle.dumps(cfg.probe)) == cfg.probe
    assert C.dump_config(cfg).splitlines()[-3:] == ["probe:", "  every: 3", "  backend: slow"]  # owner first
    assert ("probe.backend", "'fast' | 'slow'", "a key another module adds") in C.describe_keys(cfg)
    with pytest.raises(ConfigError, match=r"^config: probe.backend: expected one of 'fast' \| 'slow', got 'quick'$"):
        C.config_from_dict({"probe": {"backend": "quick"}})
    with pytest.raises(ValueError, match="probe already has every"):
        C.extend_section("probe", _OwnerKeys)
    with pytest.raises(ValueError, match="typed by its name"):
        C.extend_section("task", _AddedKeys)


def test_eval_coco_backend_is_an_eval_key_the_engine_does_not_name():
    from visiontrain.engine.parts.evaluator import EvalConfig

    cfg = load_config("detect-faster-rcnn", ["eval.coco_backend=pycocotools"])
    assert isinstance(cfg.eval, EvalConfig) and cfg.eval.coco_backend == "pycocotools"
    assert "coco_backend" not in {f.name for f in dataclasses.fields(EvalConfig)}
    assert load_config(FASHION).eval.coco_backend == "faster-coco-eval"
    assert "eval.coco_backend" in err("detect-faster-rcnn", ["eval.coco_backend=fast"])
