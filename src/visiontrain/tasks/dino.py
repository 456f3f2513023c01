"""DINO self-supervised training (Caron et al. 2021) with the k-NN evaluation of its teacher.

What DINO needs from the engine it gets from the engine, not from a second mechanism:
- the teacher *is* the engine's EMA (``ema.enabled``); its momentum 0.996 -> 1 is
  ``schedules.ema_decay`` (cosine), so resume and checkpointing need nothing new;
- the teacher temperature warm-up is ``schedules.task.teacher_temp``; weight decay 0.04 -> 0.4 is
  ``schedules.weight_decay`` (decayed group only); lr warmup + cosine is ``schedules.lr`` with
  ``optim.base_batch: 256``; per-parameter clipping is ``trainer.clip_mode: param``;
- cancelling the last layer's gradients in the first epochs is an ``after_backward`` hook.
The task owns only the centre (saved in every checkpoint through ``state_dict``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar, Literal

import torch
from torch import nn
from torch.utils.data import Subset

from visiontrain.core.config import doc
from visiontrain.data.batch_ops import channels_last as to_channels_last
from visiontrain.data.datasets import build_classification_data, check_image_files
from visiontrain.data.datasets.sources import ImageFolderDataConfig, reader_args
from visiontrain.data.multicrop import MultiCropDataset, MultiCropSpec
from visiontrain.data.multicrop_batched import BatchedMultiCrop, CropCollate, RawMultiCropDataset, collate_raw
from visiontrain.engine.parallel.distributed import DistInfo
from visiontrain.engine.protocols.hooks import Hook
from visiontrain.engine.protocols.task import ExportSpec, Task, TaskConfig, TaskData, register_task
from visiontrain.engine.setup.loaders import Workers, eval_loader, worker_context
from visiontrain.engine.step.ema import unwrap
from visiontrain.engine.step.eval_loop import EvalData
from visiontrain.evaluation.knn import extract_features, knn_predict
from visiontrain.evaluation.previews import Tile, display_pixels, tiles_image
from visiontrain.models.dino import (DinoHead, MultiCropWrapper, build_backbone, dino_loss, set_fused_attention,
                                     update_center)
from visiontrain.tasks.classification import input_metadata


@dataclass
class DinoConfig(TaskConfig):
    unread_data_keys: ClassVar[dict[str, str]] = {
        **dict.fromkeys(("train_split", "val_split"), "DINO reads an image folder's train/ (its training images and "
                        "k-NN bank) and val/ (the k-NN queries) only"),
        "augment": "its augmentation is the multi-crop: task.global_crop_size, task.local_crop_size, "
                   "task.local_crops, task.global_scale, task.local_scale"}
    name: str = doc("task name", "dino")
    backbone: str = doc("timm model (vit_small_patch16_224, vit_tiny_patch16_224, resnet50, ...)",
                        "vit_tiny_patch16_224")
    patch_size: int | None = doc("ViT patch size (null: the model's own; e.g. 4 for 28 px images)", None)
    backbone_args: dict[str, Any] = doc("extra timm.create_model arguments (embed_dim, depth, num_heads...)",
                                        factory=dict)
    fused_attention: bool | None = doc(
        "ViT attention through F.scaled_dot_product_attention (true) or timm's plain matmul and softmax (false); "
        "null: fused on CUDA only (on the CPU the fused kernel's backward costs more than the matmuls on a ViT's "
        "few tokens: BENCHMARKS.md)", None)
    drop_path_rate: float = doc("stochastic depth of the student (the teacher, in eval mode, has none)", 0.1)
    out_dim: int = doc("prototypes K of the head's last layer", 65536)
    hidden_dim: int = doc("head MLP width", 2048)
    bottleneck_dim: int = doc("head bottleneck before L2 normalisation", 256)
    head_layers: int = doc("linear layers of the head MLP", 3)
    head_bn: bool = doc("BatchNorm in the head MLP", False)
    norm_last_layer: bool = doc("fix the weight norm of the last layer at 1 (not trained)", True)
    global_crop_size: int = doc("side of the 2 global crops; also the side of the k-NN evaluation's images (bank "
                                "and queries) and of the exported backbone's input, unless data.image_size is set",
                                224)
    local_crop_size: int = doc("side of the local crops", 96)
    local_crops: int = doc("number of local crops", 8)
    global_scale: list[float] = doc("RandomResizedCrop scale range of the global crops", factory=lambda: [0.4, 1.0])
    local_scale: list[float] = doc("RandomResizedCrop scale range of the local crops", factory=lambda: [0.05, 0.4])
    blur_sigma: list[float] = doc("Gaussian blur sigma range in pixels", factory=lambda: [0.1, 2.0])
    multicrop: Literal["per_sample", "batched"] = doc(
        "per_sample: torchvision v2 per image in the loader; batched: every crop of a batch made at once from "
        "the uint8 images, with each batch's parameters drawn from its seed (the same distributions per view; "
        "images of different sizes are padded to the batch's largest)", "per_sample")
    multicrop_in: Literal["auto", "loader", "step"] = doc(
        "where the batched multi-crop runs: loader (the collate, in the DataLoader workers, or in the training "
        "process without them), step (the task's device transform, on the training device); "
        "auto: step on CUDA, loader otherwise", "auto")
    student_temp: float = doc("student softmax temperature", 0.1)
    teacher_temp: float = doc("teacher temperature (warm it up with schedules.task.teacher_temp)", 0.04)
    center_momentum: float = doc("EMA momentum of the centre of the teacher outputs", 0.9)
    freeze_last_layer: int = doc("epochs during which the last layer's gradients are cancelled", 1)
    knn_k: int = doc("k-NN evaluation: neighbours", 20)
    knn_temperature: float = doc("k-NN evaluation: vote temperature", 0.07)
    knn_bank: int | None = doc("k-NN evaluation: use the first N train images as the bank (null: all)", None)


log = logging.getLogger("visiontrain")

N_GLOBAL = 2


class BindTeacher(Hook):
    """The teacher is the engine's EMA model: hand it to the task once everything is built/resumed."""

    def before_train(self) -> None:
        self.trainer.task.teacher = self.trainer.ema.module


class FreezeLastLayer(Hook):
    """DINO's cancel_gradients_last_layer: no update of the head's last layer in the first epochs."""

    def before_train(self) -> None:
        self.params = list(unwrap(self.trainer.model).head.last_layer.parameters())

    def after_backward(self) -> None:
        if self.trainer.epoch < self.trainer.task.cfg.task.freeze_last_layer:
            for p in self.params:
                p.grad = None


class DinoTask(Task):
    name = "dino"
    default_loss_weights = {"dino": 1.0}
    metric, mode = "knn_top1", "max"

    needs_ema = ("the teacher is the engine's EMA of the student (with ema.decay=0.996 and schedules.ema_decay: "
                 "{shape: cosine, end: 1.0})")

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        t = self.cfg.task
        self.teacher_temp = t.teacher_temp
        self.teacher: nn.Module | None = None
        self.center = torch.zeros(1, t.out_dim)
        self.bank: Any = None
        self.num_classes = 0
        self.cropper: Any = None  # the batched multi-crop when the step makes the crops, set by build_data

    # ------------------------------------------------------------------ data and model
    def build_data(self) -> TaskData:
        d, t = self.cfg.data, self.cfg.task
        reader = replace(reader_args(d), image_size=self.eval_image_size(), augment="none", uint8_train=False,
                         train_split="train", val_split="val")
        data = build_classification_data(d.name, reader)
        if isinstance(d, ImageFolderDataConfig):  # the other sources are in memory: no file to open
            check_image_files(data, on_bad_image=d.image_policy(), max_skipped_share=d.max_skipped_share,
                              check=d.check_images)
        src = data.train
        spec = MultiCropSpec(global_size=t.global_crop_size, local_size=t.local_crop_size,
                             local_crops=t.local_crops, global_scale=tuple(t.global_scale),
                             local_scale=tuple(t.local_scale), blur_sigma=tuple(t.blur_sigma),
                             mean=tuple(src.mean), std=tuple(src.std))
        n_bank = len(src) if t.knn_bank is None else min(t.knn_bank, len(src))
        self.bank = src if n_bank == len(src) else Subset(src, range(n_bank))
        self.num_classes = data.num_classes
        self.normalisation = (tuple(src.mean), tuple(src.std))  # for previews
        info = {"num_classes": data.num_classes, "class_names": data.class_names,
                "in_channels": data.in_channels, "image_size": data.image_size,
                "preprocess": data.eval_transform.spec()}
        if t.multicrop == "batched":
            in_step = t.multicrop_in == "step" or (t.multicrop_in == "auto" and self._on_cuda())
            self.cropper = BatchedMultiCrop(spec) if in_step else None
            return TaskData(RawMultiCropDataset(src, spec), data.val, info, random_transforms=True,
                            train_collate=collate_raw if in_step else CropCollate(spec),
                            worker_datasets={"k-NN bank": self.bank})
        return TaskData(MultiCropDataset(src, spec), data.val, info, random_transforms=True,
                        worker_datasets={"k-NN bank": self.bank})

    def eval_image_size(self) -> int:
        """The side of the images the k-NN evaluation feeds the backbone: the size it trained at (the
        global crops), unless ``data.image_size`` asks for another, which is then said once. Left to
        the dataset's own default, an image folder would evaluate a 28 px model at 224 px."""
        d, t = self.cfg.data, self.cfg.task
        if getattr(d, "image_size", None) is None:
            return t.global_crop_size
        if d.image_size != t.global_crop_size:
            log.info("task dino: the k-NN evaluation (bank and queries) and the export use data.image_size=%d px "
                     "images; the training crops are task.global_crop_size=%d px", d.image_size, t.global_crop_size)
        return d.image_size

    def _on_cuda(self) -> bool:
        device = self.cfg.device
        return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())

    def device_transform(self, *, channels_last: bool) -> Callable[[Any], Any] | None:
        """When the step makes the batched crops (``task.multicrop_in``): (uint8 images, labels, view
        parameters) -> (crops, labels) on the training device, so a GPU run's loader only reads images."""
        if self.cropper is None:
            return None
        crop = self.cropper

        def make_crops(batch: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
            images, labels, params = batch
            crops = crop(images, params)
            if channels_last:
                crops = [to_channels_last(c) for c in crops]
            return crops, labels
        return make_crops

    def build_model(self, info: dict[str, Any]) -> nn.Module:
        t = self.cfg.task
        self.num_classes = info["num_classes"]
        backbone = build_backbone(t.backbone, in_channels=info["in_channels"], image_size=t.global_crop_size,
                                  patch_size=t.patch_size, drop_path_rate=t.drop_path_rate,
                                  extra=dict(t.backbone_args))
        set_fused_attention(backbone, self._on_cuda() if t.fused_attention is None else t.fused_attention)
        head = DinoHead(backbone.num_features, t.out_dim, hidden_dim=t.hidden_dim, bottleneck_dim=t.bottleneck_dim,
                        layers=t.head_layers, use_bn=t.head_bn, norm_last_layer=t.norm_last_layer)
        return MultiCropWrapper(backbone, head)

    # ------------------------------------------------------------------ training
    def losses(self, model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
        crops, _ = batch
        t = self.cfg.task
        student_out = model(crops)
        with torch.no_grad():
            teacher_out = self.teacher(crops[:N_GLOBAL]).float()
        if self.center.device != teacher_out.device:
            self.center = self.center.to(teacher_out.device)  # once: the first step or after a resume
        loss, q = dino_loss(student_out, teacher_out, self.center, student_temp=t.student_temp,
                            teacher_temp=self.teacher_temp, n_global=N_GLOBAL)
        with torch.no_grad():
            entropy = -(q * q.clamp_min(1e-12).log()).sum(-1).mean()  # collapse to one prototype: -> 0
            center_norm = self.center.norm()  # before this batch's update, as used in the loss
            update_center(self.center, teacher_out, t.center_momentum)
        return {"dino": loss, "teacher_entropy": entropy, "center_norm": center_norm}

    def preview_figures(self, batch: Any) -> dict[str, Any]:
        """The first samples' views side by side: the global crops, then the local ones."""
        crops = self.cropper(batch[0], batch[2]) if self.cropper is not None else batch[0]
        n, (mean, std) = min(4, len(crops[0])), self.normalisation
        rows = [[Tile(display_pixels(view[i], mean, std), f"{'global' if v < N_GLOBAL else 'local'} {v}")
                 for v, view in enumerate(crops)] for i in range(n)]
        title = f"first training batch as the model receives it (the views of {n} of {len(crops[0])} samples)"
        return {"train_batch": tiles_image(rows, title=title, cell=96)}

    def hooks(self) -> list[Hook]:
        return [BindTeacher(), FreezeLastLayer()]

    def state_dict(self) -> dict[str, Any]:
        return {"center": self.center.detach().cpu().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        center = state.get("center")
        if center is None or tuple(center.shape) != tuple(self.center.shape):
            shape = None if center is None else list(center.shape)
            raise ValueError(f"the checkpoint's DINO centre has shape {shape}, "
                             f"this run's head has out_dim {self.cfg.task.out_dim}")
        self.center = center.to(self.center.device).clone()

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, model: nn.Module, data: EvalData) -> dict[str, float]:
        """k-NN top-1 of the backbone's features: the bank (train images, no augmentation) sharded
        over ranks and gathered, each rank's share of the test set voted against it, counts summed."""
        t, d = self.cfg.task, self.cfg.data
        wrapper = unwrap(model)

        def encode(images: torch.Tensor) -> torch.Tensor:
            return wrapper(images, features_only=True)
        rank, world = data.dist.rank, data.dist.world_size
        # Equal shards (the last padded with repeats, dropped after extraction): under FSDP every
        # forward is a collective, so every rank must run the same number of batches.
        n = len(self.bank)
        per = -(-n // world)
        start, valid = rank * per, max(0, min(per, n - rank * per))
        shard = Subset(self.bank, [min(start + i, n - 1) for i in range(per)])
        workers = Workers(d.num_workers, context=worker_context(d.worker_start) if d.num_workers else None)
        bank_loader = eval_loader(shard, d.eval_batch(), collate=None, dist_info=DistInfo(), workers=workers)
        bank_x, bank_y = extract_features(encode, data.over(bank_loader), data.device)
        bank_x, bank_y = data.gather_rows(bank_x[:valid]), data.gather_rows(bank_y[:valid])
        test_x, test_y = extract_features(encode, data, data.device)  # this rank's share, padding left out
        pred = knn_predict(bank_x, bank_y, test_x, num_classes=self.num_classes, k=t.knn_k,
                           temperature=t.knn_temperature)
        counts = torch.stack([(pred == test_y).sum(), torch.tensor(test_y.numel(), device=data.device)]).double()
        data.sum_(counts)
        correct, total = counts.tolist()  # host sync (end of evaluation)
        return {"knn_top1": 100.0 * correct / max(total, 1.0)}

    def export_spec(self, model: nn.Module, info: dict[str, Any]) -> ExportSpec:
        """The backbone: images [B, C, S, S] prepared exactly as the k-NN evaluation prepared its
        images (S, the resize and the normalisation as recorded in the checkpoint) -> features [B, D],
        the part used downstream; no class names: DINO predicts none."""
        size = int(info.get("image_size") or self.cfg.task.global_crop_size)
        example = torch.randn(2, info["in_channels"], size, size, generator=torch.Generator().manual_seed(0))
        metadata = {**input_metadata(info.get("preprocess"), self.cfg.data, "none", size, info["in_channels"]),
                    "output": "features [B, D]: the backbone's embedding (the teacher's when exported with --ema)"}
        return ExportSpec(unwrap(model).backbone.eval(), (example,), ["images"], ["features"], metadata=metadata)


register_task("dino", DinoTask, DinoConfig)
