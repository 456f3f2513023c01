"""DINO: the loss and centre on hand-checked numbers, the schedules as wired by the recipe, the
teacher as the engine's EMA, freeze_last_layer, per-parameter clipping, k-NN on a toy case,
multi-crop, exact resume (with the centre), no host read in the step, and a CLI smoke fit."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from crashes import Crash, CrashAt
from detection_helpers import vt
from host_reads import ALL_ON, run_counted
from procs import cli_here
from resume_checks import assert_bit_identical, fit_and_crash_resume
from tiny import DINO as TINY, DINO_NO_WARMUP as NO_WARMUP
from visiontrain.core import config as C
from visiontrain.data.samplers import SeededDataset
from visiontrain.engine.loop.trainer import Trainer
from visiontrain.engine.protocols.hooks import Hook
from visiontrain.evaluation.knn import knn_predict
from visiontrain.models.dino import dino_loss, update_center
from visiontrain.tasks import build_task


def cfg_of(*overrides: str) -> C.Config:
    return C.load_config("ssl-dino", TINY + list(overrides))


def test_dino_loss_skips_each_crop_against_itself():
    # teacher: crop 0 -> class 0, crop 1 -> class 1 (sharp); student: [3/4, 1/4], [1/4, 3/4], [1/2, 1/2]
    teacher = torch.tensor([[50.0, 0.0], [0.0, 50.0]])
    p = torch.tensor([[0.75, 0.25], [0.25, 0.75], [0.5, 0.5]])
    student = p.log() * 0.1  # softmax(student / 0.1) == p
    loss, q = dino_loss(student, teacher, torch.zeros(1, 2), student_temp=0.1, teacher_temp=1.0)
    # pairs (t0, s1), (t0, s2), (t1, s0), (t1, s2): -ln 1/4, -ln 1/2, -ln 1/4, -ln 1/2
    assert loss.item() == pytest.approx(1.5 * math.log(2), rel=1e-5)
    assert q.shape == (2, 1, 2) and q[0, 0, 0].item() == pytest.approx(1.0)


def test_dino_loss_subtracts_the_centre_and_sharpens_with_the_teacher_temperature():
    student = torch.zeros(3, 2)  # uniform student: every pair costs ln 2 whatever the teacher says
    teacher = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    loss, q = dino_loss(student, teacher, torch.tensor([[1.0, 0.0]]), student_temp=0.1, teacher_temp=0.5)
    assert loss.item() == pytest.approx(math.log(2), rel=1e-6)
    assert torch.allclose(q, torch.full_like(q, 0.5))  # centred logits are equal: uniform
    _, q = dino_loss(student, teacher, torch.zeros(1, 2), student_temp=0.1, teacher_temp=0.5)
    assert q[0, 0, 0].item() == pytest.approx(math.exp(2) / (math.exp(2) + 1), rel=1e-6)  # softmax([2, 0])


def test_centre_is_an_ema_of_the_batch_mean():
    center = torch.zeros(1, 2)
    update_center(center, torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 0.9)
    assert torch.allclose(center, torch.tensor([[0.2, 0.3]]))
    update_center(center, torch.tensor([[1.0, 2.0], [3.0, 4.0]]), 0.9)
    assert torch.allclose(center, torch.tensor([[0.38, 0.57]]))


def test_knn_weights_votes_by_similarity():
    train = torch.nn.functional.normalize(torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.8, 0.2], [0.0, 1.0]]), dim=1)
    labels = torch.tensor([0, 0, 0, 1])
    test = torch.nn.functional.normalize(torch.tensor([[1.0, 0.05], [0.05, 1.0]]), dim=1)
    assert knn_predict(train, labels, test, num_classes=2, k=1).tolist() == [0, 1]
    # k=4: three class-0 neighbours against one, but the class-1 sample is far more similar to
    # test 1 and exp(sim / 0.07) lets it outvote them; a plain majority would say 0
    assert knn_predict(train, labels, test, num_classes=2, k=4, temperature=0.07).tolist() == [0, 1]
    assert knn_predict(train, labels, test, num_classes=2, k=4, temperature=100.0).tolist() == [0, 0]


def test_multicrop_gives_two_global_then_local_crops():
    task = build_task(cfg_of("task.local_crops=3", "task.multicrop=per_sample"))
    data = task.build_data()
    assert task.device_transform(channels_last=False) is None
    torch.manual_seed(0)
    crops, label = data.train[5]
    assert [tuple(c.shape) for c in crops] == [(1, 8, 8)] * 2 + [(1, 4, 4)] * 3
    assert isinstance(label, int) and crops[0].dtype == torch.float32
    torch.manual_seed(0)
    again, _ = data.train[5]
    assert all(torch.equal(a, b) for a, b in zip(crops, again))  # torch's RNG only: reproducible
    assert not torch.equal(crops[0], crops[1])


def test_batched_multicrop_makes_the_same_views_in_the_loader_and_in_the_step():
    """task.multicrop=batched: made in the loader's collate (auto on the CPU) or in the step's device
    transform (auto on CUDA), the samples' seeds give the same crops, in the per-sample path's shapes
    and order."""
    keys = [(i, 7) for i in (5, 6, 7)]
    in_loader = build_task(cfg_of("task.local_crops=3", "task.multicrop=batched", "task.multicrop_in=loader"))
    data = in_loader.build_data()
    assert in_loader.device_transform(channels_last=False) is None
    crops, labels = data.train_collate(SeededDataset(data.train).__getitems__(keys))
    assert [tuple(c.shape) for c in crops] == [(3, 1, 8, 8)] * 2 + [(3, 1, 4, 4)] * 3
    assert crops[0].dtype == torch.float32 and not torch.equal(crops[0], crops[1])
    in_step = build_task(cfg_of("task.local_crops=3", "task.multicrop=batched", "task.multicrop_in=step"))
    step_data = in_step.build_data()
    raw = step_data.train_collate(SeededDataset(step_data.train).__getitems__(keys))
    assert raw[0].dtype == torch.uint8 and tuple(raw[0].shape) == (3, 1, 8, 8) and torch.equal(raw[1], labels)
    step_crops, same_labels = in_step.device_transform(channels_last=False)(raw)
    assert same_labels is raw[1] and all(torch.equal(a, b) for a, b in zip(crops, step_crops))
    auto = build_task(cfg_of("task.multicrop=batched"))
    auto.build_data()
    assert (auto.device_transform(channels_last=False) is not None) == torch.cuda.is_available()
    with pytest.raises(C.ConfigError, match="task.multicrop_in: expected one of 'auto' | 'loader' | 'step'"):
        cfg_of("task.multicrop_in=gpu")


def test_recipe_schedules_reach_the_teacher_the_temperature_and_the_decayed_group():
    # the recipe's temperature is 0.04 throughout (its warm-up starts where it ends): 0.07 makes the
    # warm-up's per-epoch steps visible
    cfg = cfg_of("trainer.epochs=4", "schedules.task.teacher_temp.warmup=3", "task.teacher_temp=0.07")
    trainer = Trainer(cfg, build_task(cfg), None)
    clock, weights = trainer.clock, {}
    total, per_epoch = clock.total_steps, clock.steps_per_epoch

    def at(step):
        trainer.scalars.apply(step, weights)
        decayed = [g["weight_decay"] for g in trainer.optimizer.param_groups if g["decay"]]
        free = [g["weight_decay"] for g in trainer.optimizer.param_groups if not g["decay"]]
        return trainer.ema.decay, trainer.task.teacher_temp, decayed, free

    assert at(0) == (pytest.approx(0.996), pytest.approx(0.04), [pytest.approx(0.04)], [0.0])
    # one temperature per epoch, np.linspace(0.04, 0.07, 3) over epochs 0..2
    assert at(per_epoch)[1] == pytest.approx(0.055) and at(2 * per_epoch - 1)[1] == pytest.approx(0.055)
    assert at(2 * per_epoch)[1] == pytest.approx(0.07) and at(3 * per_epoch)[1] == pytest.approx(0.07)
    ema_mid, _, wd_mid, _ = at(total // 2)
    assert ema_mid == pytest.approx(0.998, abs=2e-5) and wd_mid[0] == pytest.approx(0.22, abs=2e-3)
    assert at(total) == (pytest.approx(1.0), pytest.approx(0.07), [pytest.approx(0.4)], [0.0])
    lr0 = cfg.optim.lr * cfg.data.batch_size / 256  # lr = base x global batch / 256
    assert trainer.run.base_lr == pytest.approx(lr0)


def dino_cosine_scheduler(base: float, final: float, epochs: int, niter: int, warmup_epochs: float = 0,
                          start_warmup: float = 0.0) -> np.ndarray:
    """DINO's ``utils.cosine_scheduler``, as its repository writes it: the warmup is
    np.linspace(start, base, W) (base at iteration W-1), then a cosine over the remaining iterations."""
    warmup_iters = int(warmup_epochs * niter)
    warmup = np.linspace(start_warmup, base, warmup_iters) if warmup_epochs > 0 else np.array([])
    iters = np.arange(epochs * niter - warmup_iters)
    cosine = final + 0.5 * (base - final) * (1 + np.cos(np.pi * iters / len(iters)))
    return np.concatenate((warmup, cosine))


@pytest.mark.parametrize("recipe", ["ssl-dino", "ssl-dino-vits16-imagenet"])
def test_recipe_schedules_are_dinos_at_every_iteration(recipe):
    """lr, weight decay and teacher momentum from DINO's cosine_scheduler, the teacher temperature
    from its per-epoch np.linspace, with DINO's own arguments taken from the recipe."""
    from visiontrain.engine.optim.schedules import StepClock, build_schedule

    cfg = C.load_config(recipe, [])
    epochs, niter, s = cfg.trainer.epochs, 8, cfg.schedules  # 8 iterations an epoch: half an epoch is whole
    clock = StepClock(niter, epochs * niter)
    lr = cfg.optim.lr * cfg.data.batch_size / 256  # DINO: args.lr * batch_size_per_gpu * world_size / 256.
    temp = cfg.task.teacher_temp
    expected = {
        "lr": dino_cosine_scheduler(lr, s["lr"].end, epochs, niter, warmup_epochs=s["lr"].warmup),
        "weight_decay": dino_cosine_scheduler(cfg.optim.weight_decay, s["weight_decay"].end, epochs, niter),
        "ema_decay": dino_cosine_scheduler(cfg.ema.decay, 1.0, epochs, niter),
        "task.teacher_temp": np.concatenate((
            np.linspace(s["task.teacher_temp"].warmup_start, temp, int(s["task.teacher_temp"].warmup)),
            np.ones(epochs - int(s["task.teacher_temp"].warmup)) * temp)).repeat(niter)}  # indexed by epoch
    bases = {"lr": lr, "weight_decay": cfg.optim.weight_decay, "ema_decay": cfg.ema.decay, "task.teacher_temp": temp}
    assert set(s) == set(expected)
    for name, values in expected.items():
        schedule = build_schedule(s[name], bases[name], clock, name=name)
        assert len(values) == clock.total_steps
        np.testing.assert_allclose([schedule(i) for i in range(clock.total_steps)], values, rtol=1e-12, atol=1e-15,
                                   err_msg=f"{recipe}: schedules.{name}")


class TeacherCheck(Hook):
    """Snapshots the teacher and checks it after the first step against the EMA formula."""

    def before_step(self) -> None:
        if self.trainer.step == 0:
            self.old = {k: v.clone() for k, v in self.trainer.ema.module.state_dict().items()}

    def after_step(self) -> None:
        if self.trainer.step == 1:
            teacher, student = self.trainer.ema.module, self.trainer.raw_model
            self.no_grad = all(p.grad is None and not p.requires_grad for p in teacher.parameters())
            in_optim = {id(p) for g in self.trainer.optimizer.param_groups for p in g["params"]}
            self.untouched = not any(id(p) in in_optim for p in teacher.parameters())
            new_s = student.state_dict()
            self.err = max((v - (0.996 * self.old[k] + 0.004 * new_s[k])).abs().max().item()
                           for k, v in teacher.state_dict().items() if v.is_floating_point())
            self.moved = any(not torch.equal(v, self.old[k]) for k, v in teacher.state_dict().items())


def test_teacher_gets_no_gradient_and_is_the_ema_of_the_student():
    cfg = cfg_of("trainer.max_steps=1", "eval.at_start=false", *NO_WARMUP)
    check = TeacherCheck()
    Trainer(cfg, build_task(cfg), None, hooks=[check]).fit()
    assert check.no_grad and check.untouched and check.moved
    assert check.err < 1e-6


class LastLayerGrads(Hook):
    def after_backward(self) -> None:
        head = self.trainer.raw_model.head
        last = [p.grad is None for p in head.last_layer.parameters() if p.requires_grad]
        rest = [p.grad is None for p in head.mlp.parameters()]
        self.seen.append((self.trainer.epoch, all(last), any(last), any(rest)))


def test_freeze_last_layer_cancels_exactly_that_layer_for_exactly_those_epochs():
    cfg = cfg_of("trainer.epochs=3", "task.freeze_last_layer=2", "data.limit_train=96", "eval.every=0",
                 "eval.at_start=false", *NO_WARMUP)
    probe = LastLayerGrads()
    probe.seen = []
    trainer = Trainer(cfg, build_task(cfg), None, hooks=[probe])
    before = trainer.raw_model.head.last_layer.parametrizations.weight.original1.detach().clone()
    trainer.fit()
    assert [s[0] for s in probe.seen] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for epoch, all_none, any_none, rest_none in probe.seen:
        assert not rest_none  # every other layer keeps its gradients
        assert (all_none, any_none) == ((True, True) if epoch < 2 else (False, False))
    assert not torch.equal(before, trainer.raw_model.head.last_layer.parametrizations.weight.original1)


class ParamNorms(Hook):
    def after_backward(self) -> None:
        self.norms.extend(p.grad.norm().item() for p in self.trainer.raw_model.parameters() if p.grad is not None)


def test_per_parameter_clipping_bounds_every_gradient():
    cfg = cfg_of("trainer.max_steps=2", "trainer.clip_grad=0.001", "eval.at_start=false", *NO_WARMUP)
    probe = ParamNorms()
    probe.norms = []
    Trainer(cfg, build_task(cfg), None, hooks=[probe]).fit()
    assert probe.norms and max(probe.norms) <= 0.001 * (1 + 1e-4)
    assert cfg.trainer.clip_mode == "param" and C.load_config("ssl-dino").trainer.clip_grad == 3.0


def dino_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in trainer.raw_model.state_dict().items()}
    out.update({f"teacher.{k}": v for k, v in trainer.ema.module.state_dict().items()})
    out["center"] = trainer.task.center
    return out


@pytest.mark.parametrize("multicrop", [["task.multicrop=batched"], ["task.multicrop=batched", "task.multicrop_in=step"],
                                       ["task.multicrop=per_sample"]], ids=["batched", "batched-in-step", "per-sample"])
def test_mid_epoch_resume_is_bit_exact_with_the_centre(tmp_path, multicrop):
    cfg = cfg_of(*multicrop, "trainer.epochs=2", "data.limit_train=320", "checkpoint.every=4", "checkpoint.unit=steps",
                 "eval.every=1", "task.knn_bank=100", "data.limit_val=50", "schedules.lr.warmup=0.5",
                 "schedules.task.teacher_temp.warmup=0.5")
    full = Trainer(cfg, build_task(cfg), tmp_path / "full")
    full.fit()
    crashed = Trainer(cfg, build_task(cfg), tmp_path / "crashed", hooks=[CrashAt(13)])  # epoch 1, step 3
    with pytest.raises(Crash):
        crashed.fit()
    resumed = Trainer(cfg, build_task(cfg), tmp_path / "crashed", resume=str(tmp_path / "crashed/checkpoints/last.pt"))
    assert resumed.step == 12
    resumed.fit()
    assert_bit_identical(dino_state(full), dino_state(resumed))
    assert full.task.center.abs().sum() > 0


def test_ssl_dino_as_shipped_resumes_bit_exact(tmp_path):
    """ssl-dino's data path as shipped (the batched multi-crop made in its one forkserver worker on
    the CPU, in the precision auto chooses here), cut after step 4's checkpoint and resumed: the student, the teacher and the
    centre equal an uninterrupted run's bit for bit, so every batch's views were drawn again from
    its seed."""
    cfg = C.load_config("ssl-dino", [
        "data.limit_train=256", "data.batch_size=32", "trainer.max_steps=6", "task.knn_bank=64", "data.limit_val=64",
        # a small network keeps the three runs to seconds; the subject is the data path and the state
        "task.backbone_args={embed_dim: 32, depth: 1, num_heads: 2}", "task.out_dim=64", "task.hidden_dim=32",
        "task.bottleneck_dim=16",
        # a checkpoint mid-epoch to resume from (the recipe writes one per epoch)
        "checkpoint.every=2", "checkpoint.unit=steps"])
    d = cfg.data
    assert (cfg.task.multicrop, d.num_workers, d.worker_start, cfg.trainer.precision) == \
        ("batched", 1, "forkserver", "auto")
    full, resumed = fit_and_crash_resume(cfg, tmp_path, crash_at=4)
    assert resumed.step == full.step == 6
    assert_bit_identical(dino_state(full), dino_state(resumed))


def test_dino_step_has_no_host_reads(monkeypatch):
    """With the batched multi-crop in the step (CUDA's default, set here on the CPU: the device
    transform is the part that must not read), the step reads nothing."""
    cfg = C.load_config("ssl-dino", TINY + ALL_ON + ["trainer.epochs=2", "data.batch_size=8", "eval.at_start=false",
                                                     "task.multicrop_in=step", *NO_WARMUP])
    counter = run_counted(Trainer, cfg, build_task(cfg), monkeypatch)
    assert counter.calls == [], counter.calls[0][1]


def test_attention_is_plain_on_the_cpu_and_computes_the_same_function():
    task = build_task(cfg_of())
    plain = task.build_model({"num_classes": 10, "in_channels": 1})
    fused = build_task(cfg_of("task.fused_attention=true")).build_model({"num_classes": 10, "in_channels": 1})
    fused.load_state_dict(plain.state_dict())
    flags = [[m.fused_attn for m in model.modules() if hasattr(m, "fused_attn")] for model in (plain, fused)]
    assert flags == [[torch.cuda.is_available()], [True]]  # null: fused on CUDA only; the one block of TINY
    x = [torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))]
    torch.testing.assert_close(plain.eval()(x), fused.eval()(x), atol=1e-5, rtol=1e-5)


def test_dino_needs_the_ema_teacher(tmp_path):
    """A declaration the build checks (``DinoTask.needs_ema``; the task never reads the ema section):
    build_task refuses, and so does the Trainer for a task built by hand, before writing anything."""
    from visiontrain.tasks.dino import DinoTask

    cfg = cfg_of("ema.enabled=false")
    with pytest.raises(C.ConfigError, match=r"^task dino: the teacher is the engine's EMA of the student .*; "
                                            r"set ema.enabled=true$"):
        build_task(cfg)
    with pytest.raises(C.ConfigError, match="ema.enabled=true"):
        Trainer(cfg, DinoTask(cfg), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_recipes_load():
    small = C.load_config("ssl-dino")
    assert small.schedules["task.teacher_temp"].warmup_start == 0.04 and small.task.teacher_temp == 0.04
    big = C.load_config("ssl-dino-vits16-imagenet", ["data.root=/data/imagenet"])
    t = big.task
    assert (t.backbone, t.out_dim, t.local_crops, t.global_crop_size, t.local_crop_size) == \
        ("vit_small_patch16_224", 65536, 10, 224, 96)
    assert (big.data.name, big.data.batch_size, big.trainer.epochs, big.optim.lr, big.optim.base_batch) == \
        ("image-folder", 64, 100, 5e-4, 256)
    assert big.schedules["lr"].warmup == 10 and big.schedules["lr"].end == 1e-6
    assert big.schedules["task.teacher_temp"].warmup == 30 and big.schedules["ema_decay"].end == 1.0
    assert big.trainer.precision == "auto" and big.trainer.sync_bn


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    run = tmp_path_factory.mktemp("dino") / "run"
    # eval.at_start=true: the recipe gives the initialisation's k-NN (30-50 s on 2 cores) to training; a user
    # who turns it on gets the k-NN at step 0, which the test below reads beside the end's
    proc = vt("fit", "ssl-dino", *TINY, "trainer.max_steps=6", "trainer.log_every=3", "trainer.epochs=1",
              "trainer.plots=true", "data.limit_train=320", "schedules.lr.warmup=0.2",
              "schedules.task.teacher_temp.warmup=0.2", "eval.at_start=true",
              "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_cli_smoke_fit_evaluates_at_init_and_saves_the_centre(fitted):
    run = fitted
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 6] and all(0 < r["ema/knn_top1"] <= 100 for r in evals)
    assert not any(k == "knn_top1" for r in evals for k in r)  # eval.models=ema: the teacher only
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [3, 6]
    assert all(k in train[-1] for k in ("dino", "teacher_entropy", "center_norm", "grad_norm"))
    assert 0 < train[-1]["teacher_entropy"] <= math.log(64) + 1e-4
    ckpt = torch.load(run / "checkpoints/last.pt", weights_only=True)
    assert ckpt["task"]["center"].shape == (1, 64) and ckpt["task"]["center"].abs().sum() > 0
    assert json.loads((run / "summary.json").read_text())["best"]["ema"] > 0
    # the plots show the teacher's entropy among the training curves and its k-NN accuracy
    from visiontrain.rundir.metrics_file import read_metrics
    from visiontrain.engine.records.plots import curve_figures

    figures = curve_figures(*read_metrics(run / "metrics.jsonl"))
    titles = {name: [ax.get_title() for ax in fig.axes if ax.get_visible()] for name, fig in figures.items()}
    assert "teacher_entropy" in titles["losses"] and titles["eval"] == ["ema/knn_top1"]
    assert {"losses.png", "eval.png"} <= {p.name for p in (run / "plots").glob("*.png")}


def test_validate_and_export_the_teacher_backbone(fitted, tmp_path, capfd):
    proc = vt("validate", str(fitted))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["ema/knn_top1"] > 0
    # export and predict load no data (no DataLoader workers to start): in this process
    proc = cli_here("export", str(fitted / "checkpoints/last.pt"), "--format", "onnx", "--ema", "--out",
                    str(tmp_path / "teacher.onnx"), capture=capfd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["outputs"] == ["features"] and result["max_abs_diff"] < 1e-4
    proc = cli_here("predict", str(fitted / "checkpoints/last.pt"), "x.png", "--out", str(tmp_path / "p"),
                    capture=capfd)
    assert proc.returncode == 2 and "task 'dino' makes no predictions on images" in proc.stderr, proc.stderr


@pytest.mark.parametrize("multicrop", ["per_sample", "batched"])
def test_image_folder_rgb_path_of_the_imagenet_recipe(tmp_path, multicrop):
    """The ImageNet recipe's data path (PIL RGB images of different sizes, jitter with saturation and
    hue, 3-channel ViT with 16 px patches) on a tiny folder, at reduced sizes; batched (an option of
    the recipe, which ships per_sample), the images of a batch are padded to the largest and cropped
    in the loader."""
    from dataset_trees import build_png_tree

    build_png_tree(tmp_path, {"train": ["a", "b"], "val": ["a", "b"]}, n=8)
    cfg = C.load_config("ssl-dino-vits16-imagenet", [
        f"data.root={tmp_path}", "data.image_size=32", "data.batch_size=4", "data.num_workers=0",
        "task.global_crop_size=32", "task.local_crop_size=16", "task.local_crops=2", "task.out_dim=32",
        "task.hidden_dim=16", "task.bottleneck_dim=8", "task.backbone_args={depth: 1, embed_dim: 24, num_heads: 2}",
        "trainer.precision=fp32", "trainer.sync_bn=false", "trainer.max_steps=2", "trainer.progress=plain",
        "eval.every=0", f"task.multicrop={multicrop}", *NO_WARMUP])
    trainer = Trainer(cfg, build_task(cfg), None)
    loader = trainer.run.source.loader
    if multicrop == "per_sample":
        crops, _ = loader.dataset.dataset[0]
    else:
        crops, labels = loader.collate_fn(loader.dataset.__getitems__([(i, 7) for i in range(4)]))
        assert labels.shape == (4,) and trainer.task.device_transform(channels_last=False) is None
        crops = [c[0] for c in crops]
    assert [tuple(c.shape) for c in crops] == [(3, 32, 32)] * 2 + [(3, 16, 16)] * 2
    trainer.fit()
    assert 0 <= trainer.evaluator.last["ema/knn_top1"] <= 100


# An image folder of 20-28 x 24 px files; a 1-block ViT with 4 px patches trained on 16/8 px crops. In-process
# (no workers) and in fp32: the subject is the size evaluation and export use, not the recipe's data path.
FOLDER = ["data.name=image-folder", "task.patch_size=4", "task.global_crop_size=16", "task.local_crop_size=8",
          "task.backbone_args={embed_dim: 32, depth: 1, num_heads: 2}", "task.out_dim=32", "task.hidden_dim=16",
          "task.bottleneck_dim=8", "task.local_crops=2", "data.batch_size=4", "data.num_workers=0",
          "trainer.precision=fp32", "trainer.progress=plain", "trainer.max_steps=1", "eval.at_start=false", *NO_WARMUP]


def test_an_image_folder_is_evaluated_and_exported_at_the_training_crop_size(tmp_path, caplog):
    """k-NN bank and queries at task.global_crop_size when data.image_size is unset (the folder's own default,
    224 px, once evaluated a 16 px model at 224 px without a word), and the ONNX metadata says exactly that:
    shorter side to int(16 / 0.875) = 18, centre crop 16, ImageNet normalisation."""
    from dataset_trees import build_png_tree

    build_png_tree(tmp_path, {"train": ["a", "b"], "val": ["a", "b"]}, n=4)
    cfg = C.load_config("ssl-dino", [f"data.root={tmp_path}", *FOLDER])
    with caplog.at_level("INFO", logger="visiontrain"):
        trainer = Trainer(cfg, build_task(cfg), tmp_path / "run")
    info, task = trainer.run.data_info, trainer.task
    assert info["image_size"] == 16 and (info["preprocess"]["size"], info["preprocess"]["resize"]) == (16, 18)
    assert task.bank[0][0].shape == (3, 16, 16) and trainer.run.val_loader.dataset[0][0].shape == (3, 16, 16)
    assert not [r for r in caplog.records if "global_crop_size" in r.getMessage()]  # nothing to say
    trainer.fit()
    assert 0 <= trainer.evaluator.last["ema/knn_top1"] <= 100
    spec = task.export_spec(trainer.ema.module, info)
    assert spec.example_inputs[0].shape[-2:] == (16, 16)
    meta = spec.metadata
    assert meta["input_size"] == {"height": 16, "width": 16} and meta["mean"] == [0.485, 0.456, 0.406]
    assert meta["resize"] == {"mode": "shorter_side_then_center_crop", "shorter_side": 18, "crop": 16}

    # data.image_size set: evaluation and export follow it, and the log names both keys
    cfg = C.load_config("ssl-dino", [f"data.root={tmp_path}", *FOLDER, "data.image_size=24"])
    with caplog.at_level("INFO", logger="visiontrain"):
        trainer = Trainer(cfg, build_task(cfg), None)
    assert trainer.run.data_info["preprocess"]["size"] == 24 and trainer.task.bank[0][0].shape == (3, 24, 24)
    said = [r.getMessage() for r in caplog.records if "global_crop_size" in r.getMessage()]
    assert said == ["task dino: the k-NN evaluation (bank and queries) and the export use data.image_size=24 px "
                    "images; the training crops are task.global_crop_size=16 px"]
    meta = trainer.task.export_spec(trainer.ema.module, trainer.run.data_info).metadata
    assert meta["input_size"] == {"height": 24, "width": 24} and meta["resize"]["shorter_side"] == 27
