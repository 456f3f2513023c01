"""The sections of a recipe, one typed dataclass each: ``data``, ``optim``, ``schedules.<name>``,
``trainer``, ``ema``, ``eval``, ``checkpoint``, ``distributed``, ``logging`` and the base of every
task's ``task`` section. Every key is a field with a type and a one-line doc (``doc``); ``config``
assembles them into the run's ``Config`` and loads recipes into it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

def doc(text: str, default: Any = dataclasses.MISSING, factory: Any = dataclasses.MISSING, *,
        minimum: int | None = None) -> Any:
    """A dataclass field with its documentation attached (shown by `show-config --docs`); ``minimum``
    bounds a number, so that e.g. ``data.batch_size=0`` is an error naming the key, not a crash later."""
    meta = {"doc": text} if minimum is None else {"doc": text, "min": minimum}
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


ScheduleShape = Literal["constant", "cosine", "linear", "step", "multistep", "poly"]
ScheduleUnit = Literal["steps", "epochs", "run"]
#: What ``schedules.<name>`` may name besides ``loss.<term>`` and ``task.<scalar>``: the engine's own scalars.
SCHEDULED_SCALARS: tuple[str, ...] = ("lr", "weight_decay", "momentum", "ema_decay", "bn_momentum")


@dataclass
class ScheduleConfig:
    """One named scalar's schedule, as written in YAML.

    ``schedules.<name>: {shape: cosine, end: 2e-4, warmup: 20000, warmup_start: 2e-4,
    unit: steps}``. Fields a shape does not use are ignored.
    """

    shape: ScheduleShape = doc("constant | cosine | linear | step | multistep | poly", "constant")
    end: float | None = doc("final value of cosine/linear/poly (default 0)", None)
    milestones: list[float] = doc("multistep: where value *= gamma, in `unit`", factory=list)
    step_size: float = doc("step: value *= gamma every step_size units", 0.0)
    gamma: float = doc("decay factor of step / multistep", 0.1)
    power: float = doc("exponent of poly", 0.9)
    warmup: float = doc("warmup length in `unit` (0 = none)", 0.0)
    warmup_min_steps: int = doc(
        "a warmup (warmup > 0) lasts at least this many optimizer steps: one given in epochs or as a fraction of "
        "the run shrinks with the data, and on a few dozen images it is over in a few steps (detectron2 and "
        "seamseg count theirs in iterations)", 0, minimum=0)
    warmup_shape: Literal["linear", "cosine"] = doc(
        "linear, or cosine: the half-cosine rise of OneCycleLR (anneal_strategy='cos')", "linear")
    warmup_start: float | None = doc("value at step 0 of the warmup (default 0)", None)
    warmup_factor: float | None = doc("warmup starts at this fraction of the value it ramps to (instead of "
                                      "warmup_start)", None)
    unit: ScheduleUnit = doc("steps | epochs | run (a fraction of the run's optimizer steps, as OneCycleLR's "
                             "pct_start): unit of warmup, milestones, step_size", "steps")
    base: float | None = doc("start value of the main schedule (default: the configured value, e.g. optim.lr)", None)
    warmup_inclusive: bool = doc("warmup = np.linspace(start, base, W): base at its last step W-1 (DINO), not at "
                                 "step W", False)
    per_epoch: bool = doc("one value per epoch, the formulas taken at the epoch index (needs unit: epochs)", False)


@dataclass
class DataConfig:
    name: str = doc("dataset: fashion-mnist | digits | image-folder (classification); coco | voc | yolo | "
                    "fashion-mosaic | neon-trees (detection)", "fashion-mnist")
    root: str | None = doc("dataset directory (image-folder: ROOT/train, ROOT/val)", None)
    batch_size: int = doc("batch size per process (per micro-step under accumulation)", 256, minimum=1)
    eval_batch_size: int | None = doc("evaluation batch size (default: 2 x batch_size)", None, minimum=1)
    num_workers: int = doc("DataLoader worker processes (0 = load in the main process)", 0, minimum=0)
    pin_memory: bool = doc("pin host memory for faster copies to the GPU", True)
    prefetch_to_device: bool = doc("copy the next batch to the GPU on a side stream while the current step "
                                   "computes (CUDA; nothing to do on the CPU)", True)
    normalize_on_device: bool = doc(
        "train images leave the loader as uint8 and are scaled and normalised on the device (detection, "
        "image-folder): no float pass on the CPU, a quarter of the bytes to collate, pin and copy", False)
    persistent_workers: bool = doc("keep workers alive across epochs", True)
    worker_start: Literal["forkserver", "fork", "spawn"] = doc(
        "how workers start. forkserver: forked from a single-threaded server process, so no worker "
        "inherits a lock held by another thread of the training process (a collective's, the "
        "pin-memory thread's): such a fork can hang a worker forever. fork: faster start, and the "
        "dataset need not be picklable", "forkserver")
    image_size: int | None = doc("model input side; None = the dataset's native size", None, minimum=1)
    augment: str = doc("train augmentation: none | flip | basic | imagenet", "none")

    def eval_batch(self) -> int:
        """The evaluation batch per process: ``eval_batch_size``, else twice the training batch
        (no gradients or optimizer state to hold, so twice fits where one trains)."""
        return self.eval_batch_size or 2 * self.batch_size
    download: bool = doc("allow torchvision to download the dataset if it is not found", False)
    limit_train: int | None = doc("use only the first N training samples (quick runs)", None, minimum=1)
    limit_val: int | None = doc("use only the first N validation samples", None, minimum=1)
    train_split: str = doc("split name of the training set (detection: coco train2017, voc trainval; image-folder: "
                           "the directory under data.root)", "train")
    val_split: str = doc("split name of the validation set (detection; image-folder: the directory under data.root)",
                         "val")
    test_split: str = doc("split name of the test set (detection; image-folder: the directory under data.root), "
                          "evaluated only by `visiontrain validate --split test`, never during training", "test")
    on_bad_annotation: Literal["error", "skip"] = doc(
        "detection: a bad box or category (or image file, unless data.on_bad_image says otherwise) is an error "
        "naming it, or is skipped and counted", "error")
    on_bad_image: Literal["error", "skip"] | None = doc(
        "every dataset read from files: an image file that is missing, not an image, or truncated (all are "
        "opened before the first step) is an error naming the files and their count, or is skipped and counted; "
        "null: as data.on_bad_annotation (error unless that is set)", None)
    max_skipped_share: float = doc(
        "under skip, the largest share of a split's images (or of its boxes) that may be dropped: above it the "
        "run stops with the count and the likely cause, since a split that loses that much is more often read "
        "wrongly than dirty (COCO boxes written as x1,y1,x2,y2); 1 accepts any share", 0.1, minimum=0)
    cache: Literal["none", "ram"] = doc(
        "detection: ram keeps each image's decoded pixels after its first decode, in one file per split that "
        "every DataLoader worker reads, so later epochs and evaluations decode nothing (3 x H x W bytes an image, "
        "checked against data.cache_gb before training); none decodes every image each time it is loaded", "none")
    cache_gb: float | None = doc(
        "data.cache=ram: the most the decoded images may take, in GiB (2^30 bytes), per training process; "
        "null: half of the memory available at the start, shared by torchrun's processes on a machine", None,
        minimum=0)
    cache_dir: str | None = doc(
        "data.cache=ram: the directory of the cache files; null: /dev/shm (memory) where it exists and has room "
        "for the images, else the temporary directory. On a disk the kernel's page cache keeps the files in "
        "memory while it can", None)

    def image_policy(self) -> str:
        """What an image file that cannot be read does: ``on_bad_image``, or where it is unset
        ``on_bad_annotation``, which says it for detection (classification leaves it at error)."""
        return self.on_bad_image or self.on_bad_annotation


@dataclass
class OptimConfig:
    name: Literal["sgd", "adam", "adamw"] = doc("optimizer", "adamw")
    lr: float = doc("base learning rate (before the batch-size rule)", 1e-3, minimum=0)
    weight_decay: float = doc("weight decay of the decayed parameter group", 0.0, minimum=0)
    momentum: float = doc("SGD momentum / Adam beta1", 0.9, minimum=0)
    beta2: float = doc("Adam beta2", 0.999, minimum=0)
    eps: float = doc("Adam epsilon", 1e-8, minimum=0)
    nesterov: bool = doc("SGD Nesterov momentum", False)
    impl: Literal["auto", "fused", "foreach", "loop"] = doc(
        "torch optimizer implementation; auto = fused where the device supports it", "auto")
    no_decay_bias_norm: bool = doc("no weight decay on biases, norm layers and 1-D params", True)
    lr_mult: dict[str, float] = doc("regex on parameter name -> lr multiplier (first match)", factory=dict)
    freeze: list[str] = doc("regexes of parameter names to freeze (requires_grad False)", factory=list)
    frozen_bn: bool = doc("replace BatchNorm in frozen modules by FrozenBatchNorm2d", True)
    base_batch: int | None = doc("if set, lr *= global_batch / base_batch", None)


@dataclass
class TrainerConfig:
    epochs: int = doc("number of epochs", 1, minimum=1)
    max_steps: int | None = doc("stop after this many optimizer steps (mid-epoch is fine)", None, minimum=1)
    log_every: int = doc("optimizer steps between log points (the only host syncs)", 50, minimum=1)
    precision: Literal["fp32", "bf16", "fp16"] = doc("autocast dtype; fp16 adds a GradScaler", "fp32")
    accum_steps: int = doc("micro-batches per optimizer step (gradient accumulation)", 1, minimum=1)
    accum_after_epoch: int = doc("use accum_steps from this epoch on; before it 1", 0, minimum=0)
    clip_grad: float | None = doc("gradient clipping threshold (None = off)", None)
    clip_mode: Literal["norm", "param"] = doc(
        "norm: global L2 norm (DETR, cvnets); param: each parameter's norm (DINO)", "norm")
    nonfinite: Literal["raise", "skip"] = doc(
        "on a non-finite loss: raise at the next log point, or skip the update and go on", "raise")
    device: str = doc("auto | cpu | cuda | cuda:N", "auto")
    channels_last: bool = doc("channels_last memory format for model and images (under FSDP the images only)", False)
    compile: bool = doc("torch.compile the model", False)
    threads: int | None = doc("torch intra-op threads (None = torch default)", None)
    sync_bn: bool = doc("under DDP, convert BatchNorm layers to SyncBatchNorm (batch statistics over all ranks)",
                        False)
    progress: Literal["auto", "bar", "plain"] = doc("rich bar on a terminal, plain lines otherwise", "auto")
    plots: bool = doc("after each evaluation and at the end, draw the curves and the task's figures into "
                      "RUN_DIR/plots/*.png (figures also to TensorBoard); at the start of a run, the first "
                      "training batch (train_batch.png) and the training labels (labels.png, detection)", True)
    summary: bool = doc("at the start of a run, log the parameters per top-level module and the FLOPs per sample "
                        "(also RUN_DIR/model_summary.json)", True)
    profile: bool = doc("write a torch.profiler trace of a few steps to RUN_DIR/profile (trace.json, summary.txt)",
                        False)
    profile_start: int = doc("profile: steps done before the window opens (warm-up)", 5, minimum=0)
    profile_steps: int = doc("profile: optimizer steps in the window", 5, minimum=1)
    hooks: list[str] = doc("hooks of your own, each 'package.module:ClassName': a subclass of visiontrain.Hook "
                           "built without arguments, found on sys.path or in the current directory; one with a "
                           "cadence runs periodically, one with state_dict is in every checkpoint "
                           "(docs/custom-task.md)", factory=list)


@dataclass
class EmaConfig:
    enabled: bool = doc("keep an exponential moving average of the weights", False)
    decay: float = doc("EMA decay (weight of the old average; cvnets momentum m = 1 - decay)", 0.9998)
    warmup: bool = doc("ramp the decay up from 0 early in training (timm ModelEmaV3)", False)
    every: int = doc("update the EMA every k optimizer steps", 1, minimum=1)


@dataclass
class EvalConfig:
    every: int = doc("evaluate every N units (0 = only at the end)", 1, minimum=0)
    unit: Literal["epochs", "steps"] = doc("unit of eval.every", "epochs")
    metric: str | None = doc("checkpoint metric (default: the task's)", None)
    mode: Literal["max", "min"] | None = doc("max or min for the checkpoint metric", None)
    models: Literal["both", "model", "ema"] = doc(
        "which weights to evaluate when an EMA is kept (ema: only the EMA, e.g. DINO's teacher)", "both")
    at_start: bool = doc("also evaluate before the first step (the metric at initialisation)", False)
    patience: int = doc("stop after this many evaluations in a row without an improvement of the checkpoint "
                        "metric (0 = never stop early)", 0, minimum=0)
    min_delta: float = doc("patience: an improvement must beat the best value by more than this, in the "
                           "metric's own units", 0.0, minimum=0)
    patience_after: float | Literal["warmup"] = doc(
        "patience: only evaluations from this point on count, and the best value is taken among them (Keras' "
        "start_from_epoch): a position in eval.unit, or warmup: the end of schedules.lr's warmup (a metric that "
        "dips while the lr is still rising stops nothing)", 0.0, minimum=0)


@dataclass
class CheckpointConfig:
    every: int = doc("write checkpoints/last.pt every N units (0 = only at the end)", 1, minimum=0)
    unit: Literal["epochs", "steps"] = doc("unit of checkpoint.every", "epochs")
    keep_best: int = doc("also keep the k best checkpoints as best-stepS.pt (0 = only best.pt)", 0, minimum=0)
    keep_every: int = doc("keep a copy step-S.pt every N steps (0 = off)", 0, minimum=0)


@dataclass
class DistributedConfig:
    strategy: Literal["ddp", "fsdp"] = doc(
        "under torchrun: ddp replicates the model (DistributedDataParallel); fsdp shards parameters, "
        "gradients and optimizer state over the ranks (FSDP2 fully_shard), checkpoints sharded (DCP)", "ddp")
    fsdp_units: list[str] = doc(
        "fsdp: regexes of module names each sharded as its own unit, gathered only around its forward "
        "and backward (default: every block of a list of repeated blocks, e.g. a ViT's blocks.N)", factory=list)
    fsdp_reshard_after_forward: bool = doc(
        "fsdp: free each unit's gathered parameters after its forward (least memory); false keeps them "
        "until its backward (one all-gather fewer per unit, more memory)", True)


@dataclass
class LoggingConfig:
    """Where a run's metrics go besides its run dir (metrics.jsonl, TensorBoard, the console)."""

    mlflow: bool = doc("also record the run in MLflow: the config as params, every logged metric, the plots, "
                       "report and summary as artifacts, the launch as tags, the final status (rank 0; needs "
                       "pip install 'visiontrain[mlflow]')", False)
    mlflow_uri: str | None = doc("MLflow tracking URI (sqlite:///PATH.db, http://HOST:PORT, ...); default "
                                 "sqlite:///RUN_DIR/mlflow.db, a store of the run's own", None)
    mlflow_experiment: str | None = doc("MLflow experiment name (default: the recipe's name, else the run "
                                        "dir's)", None)
    mlflow_weights: bool = doc("with logging.mlflow: when the run ends, also send the final weights "
                               "(model.safetensors, model_ema.safetensors) and the best checkpoints "
                               "(checkpoints/best.pt, best_ema.pt) as artifacts; false keeps them off a remote "
                               "server", True)


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
