"""Image classification, cvnets / MobileViT style: timm or small models, label smoothing,
mixup / cutmix on the device with a switch-off for the last epochs, top-1 / top-5 (top-5 from
6 classes up) and per-class precision / recall / F1. Accuracies are in percent, the training
``acc`` as the evaluation's ``top1``; the per-class fractions in [0, 1], as scikit-learn gives them."""
from __future__ import annotations

import dataclasses
import logging
import random
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from visiontrain.core.config import ConfigError, doc
from visiontrain.data.datasets import build_classification_data, check_image_files, classification_eval_transform
from visiontrain.data.datasets.sources import ImageFolderDataConfig, reader_args
from visiontrain.data.datasets.image_folder import DEFAULT_IMAGE_SIZE
from visiontrain.data.eval_transform import EvalTransform
from visiontrain.data.jpeg_decode import DeviceDecoder, EncodedBatch, collate_encoded
from visiontrain.data.normalize import NormalizeOnDevice
from visiontrain.engine.protocols.hooks import Hook
from visiontrain.engine.protocols.task import ExportSpec, Prediction, Task, TaskConfig, TaskData, register_task
from visiontrain.engine.setup.data_choices import device_type
from visiontrain.rundir.metrics_file import PER_CLASS
from visiontrain.engine.step.eval_loop import EvalData
from visiontrain.evaluation.confusion import classification_per_class
from visiontrain.evaluation.figures import confusion_figure
from visiontrain.evaluation.previews import Tile, display_pixels, grid, tiles_image
from visiontrain.models import LOCAL_MODELS, build_model


#: The detection-only ``data.*`` keys, which no classifier reads (DINO's neither).
PREVIEW_IMAGES = 32  # images of the first training batch drawn in train_batch.png


@dataclass
class ClassificationConfig(TaskConfig):
    name: str = doc("task name", "classification")
    model: str = doc("small_cnn, plain_cnn (three blocks, flatten) or any timm model name (resnet18, "
                     "mobilevit_xs, ...)", "small_cnn")
    pretrained: bool = doc("load timm's pretrained weights (needs them cached locally)", False)
    model_args: dict[str, Any] = doc("extra arguments of the model: small_cnn's widths, double_last, head "
                                     "(avgpool | flatten), init (kaiming | torch); timm.create_model's for a "
                                     "timm model", factory=dict)
    drop_rate: float = doc("dropout before the classifier (small_cnn and timm models)", 0.0)
    label_smoothing: float = doc("label smoothing of the cross-entropy targets", 0.0)
    mixup_alpha: float = doc("mixup Beta(alpha, alpha); 0 = off", 0.0)
    cutmix_alpha: float = doc("cutmix Beta(alpha, alpha); 0 = off", 0.0)
    mix_prob: float = doc("probability that a batch is mixed at all", 1.0)
    cutmix_prob: float = doc("with both on: probability of cutmix rather than mixup", 0.5)
    mix_off_epochs: int = doc("switch mixup/cutmix off for the last N epochs", 0)


def mix_batch(x: torch.Tensor, target: torch.Tensor, *, mixup_alpha: float, cutmix_alpha: float,
              cutmix_prob: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixup or cutmix a batch with its flipped self, on the device.

    The random scalars (lambda, which kind, the box) come from Python's ``random`` on the host —
    checkpointed with the other RNG states — so mixing never reads a device value.
    ``target`` holds soft targets [B, C].
    """
    use_cutmix = cutmix_alpha > 0 and (mixup_alpha <= 0 or random.random() < cutmix_prob)
    alpha = cutmix_alpha if use_cutmix else mixup_alpha
    lam = random.betavariate(alpha, alpha)
    if use_cutmix:
        h, w = x.shape[-2:]
        cut = (1.0 - lam) ** 0.5
        ch, cw = int(h * cut), int(w * cut)
        cy, cx = random.randrange(h), random.randrange(w)
        y0, y1 = max(cy - ch // 2, 0), min(cy + ch // 2, h)
        x0, x1 = max(cx - cw // 2, 0), min(cx + cw // 2, w)
        x = x.clone()
        x[..., y0:y1, x0:x1] = x.flip(0)[..., y0:y1, x0:x1]
        lam = 1.0 - (y1 - y0) * (x1 - x0) / (h * w)  # the area actually pasted
    else:
        x = x.mul(lam).add_(x.flip(0), alpha=1.0 - lam)
    return x, target.mul(lam).add_(target.flip(0), alpha=1.0 - lam)


def recorded_eval_transform(preprocess: dict[str, Any] | None, data: Any, augment: str) -> EvalTransform:
    """The ``EvalTransform`` of a checkpoint's ``data_info["preprocess"]``. A checkpoint written
    before data_info recorded it gets it rebuilt from its ``data.*`` config, which for Fashion-MNIST
    and digits reads the dataset again (their normalisation is the train split's statistics)."""
    if preprocess is not None:
        return EvalTransform.from_spec(preprocess)

    logging.getLogger("visiontrain").info(
        "the checkpoint's data_info has no 'preprocess' (written by an older visiontrain): rebuilding the "
        "validation transform from data.name=%s", data.name)
    try:
        args = reader_args(data)
        return classification_eval_transform(data.name, root=args.root, image_size=args.image_size,
                                             augment=augment, download=args.download)
    except (OSError, ValueError) as err:
        raise ValueError(f"the checkpoint's data_info has no 'preprocess' (written by an older visiontrain) and "
                         f"data.name={data.name} could not be read to recover its normalisation: {err}; make the "
                         f"dataset readable at data.root (from Python: Predictor.load(..., "
                         f"overrides=['data.root=DIR']))") from err


def input_metadata(preprocess: dict[str, Any] | None, data: Any, augment: str, size: int,
                   channels: int) -> dict[str, Any]:
    """The ONNX metadata of an S x S image input normalised by the recorded validation transform.
    A checkpoint from before the transform was recorded, whose dataset cannot be read here (an
    export on another machine), is still exported: its metadata says the normalisation is unknown."""
    meta: dict[str, Any] = {"input_layout": "NCHW", "input_size": {"height": size, "width": size},
                            "input_channels": channels, "color": "L" if channels == 1 else "RGB"}
    try:
        pre = recorded_eval_transform(preprocess, data, augment).spec()
    except ValueError as err:
        logging.getLogger("visiontrain").warning("export: no normalisation in the ONNX metadata: %s", err)
        return {**meta, "preprocess": f"unknown: {err}"}
    return {**meta, "resize": {"mode": "shorter_side_then_center_crop", "shorter_side": pre["resize"] or size,
                               "crop": size}, "scale": pre["scale"], "mean": pre["mean"], "std": pre["std"]}


def decodes_on_device(data: Any, trainer_device: str) -> bool:
    """``data.decode`` resolved (image-folder's key; the other sources decode on the CPU): auto is gpu
    for the imagenet augmentation on a GPU, where decoding JPEGs on the CPU is what the step waits for."""
    decode = getattr(data, "decode", "cpu")
    if data.name != "image-folder":  # shards inherit the key: their members are read on the CPU path
        if decode == "gpu":
            raise ConfigError(f"data.decode=gpu reads image files from data.name=image-folder; data.name="
                              f"{data.name} decodes on the CPU (set data.decode=auto or cpu)")
        return False
    if decode == "auto":
        return data.augment == "imagenet" and device_type(trainer_device) == "cuda"
    return decode == "gpu"


class MixSwitchOff(Hook):
    """GluonCV / timm style: no mixing in the last ``mix_off_epochs`` epochs."""

    def before_epoch(self) -> None:
        task, epochs = self.trainer.task, self.trainer.progress.epochs
        task.mixing = self.trainer.epoch < epochs - task.cfg.task.mix_off_epochs


class ClassificationTask(Task):
    name = "classification"
    predicts = Prediction.CLASS_SCORES
    default_loss_weights = {"ce": 1.0}
    metric, mode = "top1", "max"

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        t = cfg.task
        self.mixing = t.mixup_alpha > 0 or t.cutmix_alpha > 0
        self.num_classes = 0
        self.class_names: list[str] = []
        self.preprocess: dict[str, Any] | None = None  # data_info["preprocess"]: the validation transform
        self.confusion: torch.Tensor | None = None  # the last evaluation's counts [true, predicted]

    def build_data(self) -> TaskData:
        d = self.cfg.data
        decoding = decodes_on_device(d, self.cfg.device)
        data = build_classification_data(d.name, dataclasses.replace(reader_args(d), decode_on_device=decoding))
        if isinstance(d, ImageFolderDataConfig):  # the other sources are in memory: no file to open
            check_image_files(data, on_bad_image=d.image_policy(), max_skipped_share=d.max_skipped_share,
                              check=d.check_images)
        self.num_classes, self.class_names = data.num_classes, list(data.class_names)
        self.normalisation = (data.eval_transform.mean, data.eval_transform.std)  # the training images' too
        info = {"num_classes": data.num_classes, "class_names": data.class_names,
                "in_channels": data.in_channels, "image_size": data.image_size,
                "preprocess": data.eval_transform.spec()}
        return TaskData(data.train, data.val, info, random_transforms=data.random_train_transforms,
                        train_collate=collate_encoded if decoding else None)

    def device_transform(self, *, channels_last: bool) -> Callable[[Any], Any] | None:
        if decodes_on_device(self.cfg.data, self.cfg.device):
            return DeviceDecoder(self.cfg.data.image_size or DEFAULT_IMAGE_SIZE, channels_last)
        if not reader_args(self.cfg.data).uint8_train:
            return None

        normalize = NormalizeOnDevice()  # image-folder's ImageNet statistics
        return lambda batch: (normalize(batch[0]), *batch[1:])

    def build_model(self, info: dict[str, Any]) -> nn.Module:
        t = self.cfg.task
        self.num_classes = info["num_classes"]
        self.class_names = list(info.get("class_names") or range(self.num_classes))
        self.preprocess = info.get("preprocess")  # None in a checkpoint written before it was recorded
        # timm calls it drop_rate; SmallCNN's dropout is the same thing
        extra = {"dropout": t.drop_rate} if t.model in LOCAL_MODELS else {"drop_rate": t.drop_rate}
        return build_model(t.model, num_classes=info["num_classes"], in_channels=info["in_channels"],
                           image_size=info["image_size"], pretrained=t.pretrained, **{**extra, **t.model_args})

    def losses(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        images, labels = batch
        t = self.cfg.task
        if self.mixing and (t.mix_prob >= 1.0 or random.random() < t.mix_prob):
            soft = F.one_hot(labels, self.num_classes).to(images.dtype)
            if t.label_smoothing:
                soft = soft * (1.0 - t.label_smoothing) + t.label_smoothing / self.num_classes
            images, soft = mix_batch(images, soft, mixup_alpha=t.mixup_alpha,
                                     cutmix_alpha=t.cutmix_alpha, cutmix_prob=t.cutmix_prob)
            logits = model(images)
            ce = torch.sum(-soft * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()
        else:
            logits = model(images)
            ce = F.cross_entropy(logits.float(), labels, label_smoothing=t.label_smoothing)
        # in percent, like the evaluation's top1 (the convention for every accuracy and error rate);
        # a float sum and one scale: as many kernels as .float().mean(), and no host read
        acc = (logits.detach().argmax(-1) == labels).sum(dtype=torch.float32) * (100.0 / labels.numel())
        return {"ce": ce, "acc": acc}  # acc has no weight: logged, not optimised

    def evaluate(self, model: nn.Module, data: EvalData) -> dict[str, Any]:
        """top-1 / top-5 in percent, the mean loss, and per class the precision, recall and F1 of
        the top-1 predictions with the class's support (``classification_per_class``)."""
        device = data.device
        sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, top1, top5, count
        c = self.num_classes
        confusion = torch.zeros(c * c, dtype=torch.int64, device=device)  # [true, predicted], flattened
        k = min(5, c)
        for (images, labels), real in data:
            logits, labels = model(images).float()[real], labels[real]  # the sampler's padding is not counted
            topk = logits.topk(k, dim=-1).indices
            hit = topk == labels[:, None]
            confusion += torch.bincount(labels * c + topk[:, 0], minlength=c * c)
            sums += torch.stack([F.cross_entropy(logits, labels, reduction="sum"),
                                 hit[:, 0].sum(), hit.any(-1).sum(),
                                 torch.tensor(float(labels.numel()), device=device)]).double()
        data.sum_(sums, confusion)  # evaluation is sharded across ranks: sum the shards
        loss, top1, top5, n = sums.tolist()  # host sync (end of evaluation)
        self.confusion = confusion.view(c, c).cpu()  # host sync (end of evaluation), for eval_figures
        n = max(n, 1.0)
        metrics = {"top1": 100.0 * top1 / n, "top5": 100.0 * top5 / n, "loss": loss / n}
        if c < 6:  # the top 5 of 5 classes or fewer always hold the label: 100 % says nothing
            del metrics["top5"]
        metrics[PER_CLASS] = classification_per_class(self.confusion, self.class_names or range(c))
        return metrics

    def preview_figures(self, batch: Any) -> dict[str, Any]:
        if isinstance(batch[0], EncodedBatch):  # data.decode=gpu: decoded here, on the CPU, by the same code
            batch = DeviceDecoder(self.cfg.data.image_size or DEFAULT_IMAGE_SIZE, say=False)(batch)
        images, labels = batch
        n = min(PREVIEW_IMAGES, len(images))
        mean, std = getattr(self, "normalisation", (None, None))
        tiles = [Tile(display_pixels(images[i], mean, std), str(self.class_names[int(labels[i])])) for i in range(n)]
        mixed = ", before mixup/cutmix (applied on the device)" if self.mixing else ""
        title = f"first training batch as the model receives it ({n} of {len(images)} images){mixed}"
        return {"train_batch": tiles_image(grid(tiles, 8), title=title, cell=112)}

    def eval_figures(self) -> dict[str, Any]:
        if self.confusion is None:
            return {}

        return {"confusion_matrix": confusion_figure(self.confusion, self.class_names)}

    def eval_transform(self) -> EvalTransform:
        """The validation set's own transform (``data_info["preprocess"]``; see :func:`recorded_eval_transform`)."""
        transform = recorded_eval_transform(self.preprocess, self.cfg.data, reader_args(self.cfg.data).augment)
        self.preprocess = transform.spec()
        return transform

    @torch.no_grad()
    def predict(self, model: nn.Module, images: list[torch.Tensor], device: torch.device
                ) -> list[dict[str, torch.Tensor]]:
        """Class probabilities of raw images (uint8 [C, H, W] or float in [0, 1]), prepared by the
        validation set's own transform: one batch, since every image comes out S x S."""
        if not images:
            return []
        transform = self.eval_transform()
        batch = torch.stack([transform(img) for img in images]).to(device)
        probabilities = model.eval()(batch).float().softmax(-1).cpu()  # host sync (prediction output)
        return [{"probabilities": p} for p in probabilities]

    def export_spec(self, model: nn.Module, info: dict[str, Any]) -> ExportSpec:
        """Images [B, C, S, S] (normalised as in training) -> logits [B, classes]; batch left free.
        The metadata says how to make such an image and read the logits."""
        size = info["image_size"]
        example = torch.randn(2, info["in_channels"], size, size, generator=torch.Generator().manual_seed(0))
        metadata = {"class_names": self.class_names, "category_ids": list(range(self.num_classes)),
                    **input_metadata(self.preprocess, self.cfg.data, reader_args(self.cfg.data).augment, size,
                                     info["in_channels"]),
                    "output": "logits [B, classes]: softmax gives the class probabilities"}
        return ExportSpec(model.eval(), (example,), ["images"], ["logits"], metadata=metadata)

    def hooks(self) -> list[Hook]:
        t = self.cfg.task
        return [MixSwitchOff()] if (t.mixup_alpha > 0 or t.cutmix_alpha > 0) and t.mix_off_epochs else []


register_task("classification", ClassificationTask, ClassificationConfig)
