"""The Task protocol: what the engine asks of a model family. The engine defines it; each file in
``visiontrain.tasks`` implements it, so the engine never imports a task.

A task builds its data and model, turns a batch into a dict of named, unweighted losses, and
evaluates. The engine weights the losses (``loss_weights``, overridable by ``task.loss_weights``
and schedulable as ``schedules.loss.<term>``), steps, logs and checkpoints, knowing nothing of
images, labels or boxes.
"""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset

from visiontrain.core.config import Config, ConfigError, register_kind, register_section
from visiontrain.core.typed_config import did_you_mean, doc
from visiontrain.engine.protocols.hooks import Hook
from visiontrain.engine.step.eval_loop import EvalData


@dataclass
class TaskConfig:
    """Base of every task's `task` section; each task subclasses it with its own keys.

    ``unread_data_keys``: ``data.*`` keys the task never reads, each with what it reads instead. A
    recipe or an override that sets one is refused: a user coming from ``imgsz=640`` who writes
    data.image_size=640 for a detector would otherwise train at the task's own size unawares."""
    unread_data_keys: ClassVar[dict[str, str]] = {}
    name: str = doc("task: classification | ...", "classification")
    loss_weights: dict[str, float] = doc(
        "weight per loss term; a term without a weight is logged, not optimised", factory=dict)


register_section("task", TaskConfig, "task section, typed by task.name", typed_by_name="classification", noun="task")


@dataclass(frozen=True)
class RegisteredTask:
    """What ``task.name`` names: the class that builds the task and the dataclass that types its
    ``task:`` section."""
    task_class: type[Task]
    config_class: type[TaskConfig]


@dataclass(frozen=True)
class TaskInputs:
    """What a task reads of a run's config, and nothing more (``task.cfg``): its own section, the
    ``data`` and ``eval`` sections, the seed, and the device the run asks for (``trainer.device`` as
    written: ``auto``, ``cpu``, ``cuda:1``). The rest of the run reaches a task as an argument of the
    call that needs it (``device_transform``'s layout, ``param_groups``' optimizer rules) or as a
    declaration the build checks (``Task.needs_ema``), so a task cannot come to depend on the trainer's,
    the optimizer's or the EMA's settings unseen."""
    task: Any
    data: Any
    eval: Any
    seed: int
    device: str

    @classmethod
    def of(cls, cfg: Config) -> TaskInputs:
        return cls(cfg.task, cfg.data, cfg.eval, cfg.seed, cfg.trainer.device)


def check_needs(task_class: type[Task], cfg: Config) -> None:
    """What a task declares it needs of the rest of the run, checked before anything is built."""
    if task_class.needs_ema and not cfg.ema.enabled:
        raise ConfigError(f"task {task_class.name}: {task_class.needs_ema}; set ema.enabled=true")


#: task.name -> its task. Each built-in task registers itself, named in ``visiontrain.catalog``.
TASK_REGISTRY: dict[str, RegisteredTask] = {}


def registered_task(name: Any) -> RegisteredTask:
    """The task registered as ``name``; an unknown name names the close one and every known one."""
    found = TASK_REGISTRY.get(name)
    if found is None:
        raise ConfigError(f"task.name: unknown task {name!r}{did_you_mean(str(name), list(TASK_REGISTRY))}; "
                          f"expected one of {', '.join(sorted(TASK_REGISTRY))}")
    return found


@dataclass
class TaskData:
    train: Dataset
    val: Dataset
    info: dict[str, Any]                       # e.g. num_classes, class_names: goes to build_model
    random_transforms: bool = True              # train items draw from torch's RNG
    train_collate: Callable | None = None       # None: torch's default_collate
    eval_collate: Callable | None = None
    group_ids: list[int] | None = None          # batch only samples of one group (aspect ratio)
    # other datasets the task reads through DataLoader workers (DINO's k-NN bank), by name: checked
    # at start-up, like train and val, for what a forkserver or spawned worker cannot receive
    worker_datasets: dict[str, Dataset] = field(default_factory=dict)


@dataclass
class ExportSpec:
    """What ``visiontrain export`` traces: a module whose inputs and outputs are plain tensors (no
    dicts or lists, so ONNX/TorchScript/torch.export all accept it) and an example input.

    ``dynamic_axes`` and ``check_inputs`` are for ONNX, the format that declares free axes: the
    axes named there (a detector's height and width) stay free in the graph, and the written file is
    compared with PyTorch on each of ``check_inputs`` (e.g. another aspect ratio) as well as on the
    example, so a size baked into the graph fails the export instead of a user's first image.
    ``metadata`` is what a user needs to run the file without visiontrain (class names, input size,
    normalisation, box format...): written into the ONNX file's ``metadata_props``, a string or a
    JSON-encoded value per key."""
    module: nn.Module                           # in eval mode; e.g. the network up to its raw outputs
    example_inputs: tuple[torch.Tensor, ...]
    input_names: list[str]
    output_names: list[str]
    dynamic_batch: bool = True                  # batch dimension left free in the exported graph
    dynamic_axes: dict[str, dict[int, str]] = field(default_factory=dict)  # name -> {axis: label}, beyond batch
    check_inputs: list[tuple[torch.Tensor, ...]] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)


class ExportUnsupported(Exception):
    """A task/model that cannot be exported in a format; the message says why and what to do."""


class PredictUnsupported(ValueError):
    """A task that makes no predictions on images (DINO's features); the message says what to use."""


class Prediction(enum.Enum):
    """What a task's ``predict`` gives for an image. ``visiontrain.use.inference``, ``visiontrain predict``
    and the CLI read a task's predictions by this declaration, never by the task's class, so a new
    family (masks, later) is a new member here and a reader for it, not a switch on task types. The
    value is ``Predictor.kind``."""
    NONE = "none"                       # no predictions on images (DINO: its backbone is exported)
    CLASS_SCORES = "classification"     # {"probabilities": [C]}
    BOXES = "detection"                 # {"boxes" [N, 4] XYXY, "scores" [N], "labels" [N]}; predict_threshold
    LABEL_MAP = "segmentation"          # {"labels": int64 [H, W]}: each pixel's class, at the input's size
    PANOPTIC = "panoptic"               # {"ids": int32 [H, W] segment ids (0 VOID), "segments": segments_info}


class Task(abc.ABC):
    name: str = ""
    predicts: Prediction = Prediction.NONE      # a task that overrides ``predict`` says here what it returns
    default_loss_weights: dict[str, float] = {}
    metric: str = ""                            # default checkpoint metric
    mode: str = "max"
    # DDP's unused-parameter search costs a graph traversal every step: only a task whose forward
    # can skip parameters (e.g. a branch taken on some steps only) sets this
    find_unused_parameters: bool = False
    # A task whose training needs the engine's EMA says why here (DINO: its teacher is the EMA); the
    # build refuses a config without it (``check_needs``)
    needs_ema: str = ""

    def __init__(self, cfg: Config | TaskInputs) -> None:
        """``cfg``: the run's config, of which the task keeps what it reads (``self.cfg``, a
        :class:`TaskInputs`), or those inputs themselves."""
        self.cfg = cfg if isinstance(cfg, TaskInputs) else TaskInputs.of(cfg)

    @property
    def loss_weights(self) -> dict[str, float]:
        return {**self.default_loss_weights, **self.cfg.task.loss_weights}

    @abc.abstractmethod
    def build_data(self) -> TaskData:
        """Train and validation datasets plus what the model needs to know (class count...)."""

    @abc.abstractmethod
    def build_model(self, info: dict[str, Any]) -> nn.Module:
        """The model, sized from ``info`` (never a hard-coded class count)."""

    @abc.abstractmethod
    def losses(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        """Named, unweighted losses on the device; extra terms (e.g. accuracy) are logged only.
        Runs inside the step: it must not read device values on the host. At the start of a fresh
        run it is also called once under no_grad to count the model's FLOPs (``engine.records.first_look``),
        which puts back what ``state_dict`` holds: keep any state it changes there. The engine keeps the
        returned tensors (detached) until the next log point without copying them, so a term must
        not be a buffer the task later changes in place (return ``buf.clone()`` for such a one)."""

    @abc.abstractmethod
    def evaluate(self, model: nn.Module, data: EvalData) -> dict[str, Any]:
        """Metrics over the validation set (model already in eval mode, under no_grad): scalars, and
        optionally one per-class table under ``metrics_file.PER_CLASS``, ``{class name: {column:
        number}}`` in the order to show it (the engine logs it, prints it as a table, and keeps it
        out of curves, best checkpoints and ``compare``).

        ``data`` is the engine's side of the loop, so a task never handles devices or ranks itself:
        ``for batch, real in data`` gives this rank's batches on ``data.device`` (channels_last when
        configured) and the slice of each that is not the distributed sampler's padding (run the
        model on the whole batch, count ``outputs[real]``); ``data.sum_``, ``data.gather`` and
        ``data.gather_rows`` combine the ranks' counts or predictions. Every rank returns its
        metrics; a rank that holds no result (detections gathered to rank 0) may return ``{}``."""

    def eval_figures(self) -> dict[str, Any]:
        """Named matplotlib Figures drawn from what the last ``evaluate`` kept (a confusion matrix,
        detections against ground truth): written to RUN_DIR/plots/NAME.png and TensorBoard on
        rank 0. Kept data, not a second pass over the validation set: plots cost no extra inference."""
        return {}

    def preview_figures(self, batch: Any) -> dict[str, Any]:
        """Named matplotlib Figures (or RGB uint8 images [H, W, 3]) of the first training batch as the
        model receives it (after the
        loader's transforms and collate; before ``device_transform`` and what ``losses`` does on the
        device) and of the training labels: RUN_DIR/plots/train_batch.png, labels.png. Drawn at the
        start of a fresh run (``trainer.plots``) and by ``visiontrain preview``, after ``build_data``."""
        return {}

    def device_transform(self, *, channels_last: bool) -> Callable[[Any], Any] | None:
        """What the step does to a training batch once it is on the device, before ``losses``
        (e.g. uint8 -> normalised float under ``data.normalize_on_device``); None: nothing.
        ``channels_last``: the run's layout (``trainer.channels_last``), for images the transform makes."""
        return None

    def param_groups(self, model: nn.Module, rules: Callable[..., list[dict[str, Any]]]
                     ) -> list[dict[str, Any]] | None:
        """Custom optimizer groups; None lets the engine build them from the optim rules. ``rules(model,
        norms=...)`` are the engine's (``optim.weight_decay``, ``no_decay_bias_norm``, ``lr_mult``:
        ``engine.optim.param_groups.build_param_groups``): a task with groups of its own builds them
        through it, so every optim key keeps its meaning."""
        return None

    def init_weights(self, model: nn.Module) -> str | None:
        """Load pretrained parts the config names (e.g. a backbone file) at the start of a fresh
        run; returns a report line. Not called on resume, validate or predict, where the
        checkpoint holds every weight, so the file need not exist there."""
        return None

    def export_spec(self, model: nn.Module, info: dict[str, Any]) -> ExportSpec:
        """The traceable form of ``model`` for ``visiontrain export``; tasks that can be exported
        override this."""
        raise ExportUnsupported(f"task {self.name!r} does not support export")

    def predict(self, model: nn.Module, images: list[torch.Tensor], device: torch.device
                ) -> list[dict[str, torch.Tensor]]:
        """The model's prediction on each raw image (uint8 [C, H, W], or float in [0, 1]), prepared
        exactly as evaluation prepares a validation item: ``{"probabilities": [C]}`` from a
        classifier, ``{"boxes", "scores", "labels"}`` (XYXY in the image's own pixels) from a
        detector, ``{"labels": [H, W]}`` at the image's size from a semantic segmenter.
        ``visiontrain.use.inference`` and ``visiontrain predict`` call it; a task without
        predictions says so here."""
        raise PredictUnsupported(f"task {self.name!r} makes no predictions on images")

    def hooks(self) -> list[Hook]:
        return []

    def set_scalar(self, name: str, value: float) -> None:
        """Receives ``schedules.task.<name>`` values each step (e.g. a temperature)."""
        if not hasattr(self, name):
            raise ValueError(f"schedules.task.{name}: task {self.name!r} has no scalar {name!r}")
        setattr(self, name, value)

    def state_dict(self) -> dict[str, Any]:
        """Training state the task owns (e.g. DINO's centre); saved in every checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned; a task without training state has nothing to do."""


def register_task(name: str, task_class: type[Task], config_class: type[TaskConfig]) -> None:
    """Make ``task.name: NAME`` in a recipe mean this task: its ``task:`` section typed and checked by
    ``config_class``, and the task built as ``task_class(cfg)`` by every command. Called where the
    task is defined, at import; registering a name again replaces it (a built-in task's subclass
    under the built-in's name). A declaration the commands could not act on fails here, naming
    the class, rather than at a user's first ``visiontrain predict``."""
    if not (isinstance(task_class, type) and issubclass(task_class, Task)
            and isinstance(config_class, type) and issubclass(config_class, TaskConfig)):
        raise ValueError(f"register_task({name!r}): expected a subclass of Task and one of TaskConfig, "
                         f"got {task_class!r} and {config_class!r}")
    where = f"register_task({name!r}): {task_class.__name__}"
    if task_class.name != name:
        raise ValueError(f"{where}.name is {task_class.name!r}; a task registers under its own name")
    overrides_predict = task_class.predict is not Task.predict
    if overrides_predict != (task_class.predicts is not Prediction.NONE):
        kinds = "Prediction.CLASS_SCORES, Prediction.BOXES or Prediction.LABEL_MAP"
        raise ValueError(f"{where} overrides predict but declares predicts = Prediction.NONE; say what it "
                         f"returns ({kinds})" if overrides_predict else
                         f"{where} declares predicts = {task_class.predicts} but does not override predict")
    if task_class.predicts is Prediction.BOXES and not hasattr(task_class, "predict_threshold"):
        raise ValueError(f"{where} predicts boxes but has no predict_threshold (the default minimum score)")
    TASK_REGISTRY[name] = RegisteredTask(task_class, config_class)
    register_kind("task", name, config_class)


class DictOutputs(nn.Module):
    """``module(*inputs)`` returning a dict -> the tuple of ``keys``: the form every exporter accepts
    (e.g. DETR's pred_logits and pred_boxes without its aux_outputs)."""

    def __init__(self, module: nn.Module, keys: Sequence[str]) -> None:
        super().__init__()
        self.module, self.keys = module, tuple(keys)

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.module(*inputs)
        return tuple(out[k] for k in self.keys)
