"""The step pipeline through the real Trainer: accumulation, clipping, loss weights, the
non-finite policy, max_steps, schedules applied to the optimizer. The tests marked ``cuda`` run on
the GPU too (tests/support/devices.py): there the optimizer is fused and fp16 scales on the device."""
from __future__ import annotations

import json

import pytest
import torch

from toy_task import toy_config, train
from visiontrain.engine.protocols.hooks import Hook
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.engine.state.checkpoint import load_checkpoint
from visiontrain.engine.step.guards import NonFiniteLossError


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.raw_model.state_dict().items()}


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.cuda
def test_accumulation_equals_large_batch():
    common = dict(trainer__epochs=1, optim__lr=0.01, optim__momentum=0.0, trainer__log_every=1000)
    big = train(toy_config(data__batch_size=32, **common))
    small = train(toy_config(data__batch_size=8, trainer__accum_steps=4, **common))
    assert big.step == small.step == 8
    assert max_diff(weights(big), weights(small)) < 1e-6
    # and it differs from plain batch-8 training, so the test can fail
    plain = train(toy_config(data__batch_size=8, **common))
    assert max_diff(weights(big), weights(plain)) > 1e-3


def test_accum_after_epoch_switches_on_later():
    t = train(toy_config(data__batch_size=32, trainer__accum_steps=2, trainer__accum_after_epoch=1,
                         trainer__epochs=3))
    # 8 batches/epoch: epoch 0 has 8 steps, epochs 1 and 2 have 4 each
    assert t.step == 16
    assert t.clock.total_steps == 16


@pytest.mark.cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_each_precision_trains_with_clipping(run_dir, precision):
    """The same regression in each precision, clipped, with AdamW: finite losses that fall, and
    under fp16 the gradient scaler in the checkpoint (bf16 and fp32 need none)."""
    t = train(toy_config(trainer__precision=precision, trainer__clip_grad=5.0, trainer__epochs=3,
                         trainer__log_every=4, optim__name="adamw", optim__lr=0.05), run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    totals = [r["total"] for r in rows if r["kind"] == "train"]
    assert len(totals) == 6 and all(torch.isfinite(torch.tensor(totals)))
    assert totals[-1] < 0.25 * totals[0], totals
    assert (t.run.scaler is not None) == (precision == "fp16")
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert (fmt.entry(state, fmt.SCALER) is not None) == (precision == "fp16")
    if precision == "fp16":
        assert fmt.entry(state, fmt.SCALER)["scale"] > 0


def test_max_steps_stops_mid_epoch(run_dir):
    t = train(toy_config(trainer__max_steps=5, trainer__epochs=3), run_dir)
    assert t.step == 5 and t.epoch == 0 and t.step_in_epoch == 5
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    progress = dict(fmt.entry(state, fmt.PROGRESS))
    assert 0 < progress.pop("wall_s") < 600  # the training time so far, carried into a resumed run
    assert progress == {"step": 5, "epoch": 0, "step_in_epoch": 5}
    assert fmt.entry(state, fmt.DATA) == {"seed": 0, "batch_size": 32, "world_size": 1, "accum_steps": 1,
                                          "follows_world_size": "any", "seeding": "sample"}
    assert fmt.strategy_of(state) == fmt.REPLICATED


class GradProbe(Hook):
    """Records the (clipped) gradient norm seen by after_backward."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.per_param: list[list[float]] = []

    def after_backward(self) -> None:
        grads = [p.grad for p in self.trainer.raw_model.parameters()]
        self.norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
        self.per_param.append([g.norm().item() for g in grads])


@pytest.mark.cuda
def test_clip_by_global_norm():
    probe = GradProbe()
    cfg = toy_config(trainer__clip_grad=0.5, trainer__max_steps=6, optim__lr=0.001)
    from toy_task import ToyTask
    from visiontrain.engine.loop.trainer import Trainer

    t = Trainer(cfg, ToyTask(cfg), None, hooks=[probe])
    t.fit()
    assert all(n <= 0.5 + 1e-4 for n in probe.norms)
    assert max(probe.norms) == pytest.approx(0.5, abs=1e-4)  # the toy gradients are larger than 0.5


@pytest.mark.cuda
def test_clip_per_parameter():
    probe = GradProbe()
    cfg = toy_config(trainer__clip_grad=0.3, trainer__clip_mode="param", trainer__max_steps=4, optim__lr=0.001)
    from toy_task import ToyTask
    from visiontrain.engine.loop.trainer import Trainer

    Trainer(cfg, ToyTask(cfg), None, hooks=[probe]).fit()
    flat = [n for step in probe.per_param for n in step]
    assert all(n <= 0.3 + 1e-4 for n in flat)
    assert max(probe.norms) > 0.3 + 1e-3  # the global norm is not what was clipped


def test_grad_norm_logged_and_loss_weights(run_dir):
    train(toy_config(trainer__clip_grad=100.0, trainer__max_steps=4, trainer__log_every=2), run_dir)
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == [2, 4]
    r = train_rows[0]
    assert r["grad_norm"] > 0
    # total = 1.0 * mse + 0.5 * l1; mean_out has no weight: logged, not optimised
    assert r["total"] == pytest.approx(r["mse"] + 0.5 * r["l1"], rel=1e-5)
    assert r["l1_w"] == pytest.approx(0.5 * r["l1"], rel=1e-5)
    assert "mean_out" in r and "mean_out_w" not in r
    for key in ("lr", "samples_per_s", "data_s", "compute_s", "eta_s", "epoch"):
        assert key in r


def _single_term_task(term: str):
    from toy_task import ToyTask

    class SingleTerm(ToyTask):  # one weighted term of weight 1: the total is that very tensor
        default_loss_weights = {term: 1.0}

    return SingleTerm


def test_total_that_is_a_term_is_logged_under_both_names(run_dir):
    """The recorder keeps such a total once and logs it as the term and as `total`; the columns
    after it (grad_norm) and the unweighted terms around it stay in place."""
    from visiontrain.engine.loop.trainer import Trainer

    cfg = toy_config(trainer__clip_grad=100.0, trainer__max_steps=4, trainer__log_every=2)
    trainer = Trainer(cfg, _single_term_task("l1")(cfg), run_dir)
    trainer.fit()
    assert trainer.step_fn.names == ["mse", "l1", "mean_out", "total", "grad_norm"]
    assert trainer.step_fn.columns == [0, 1, 2, 1, 3]  # total is recorded once, as l1
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert len(train_rows) == 2
    for r in train_rows:
        assert r["total"] == r["l1"] and r["mse"] != r["l1"] and r["grad_norm"] > 0
        assert "l1_w" not in r and "mse_w" not in r


def test_total_that_is_a_term_still_stops_a_nonfinite_run(run_dir):
    from visiontrain.engine.loop.trainer import Trainer

    cfg = toy_config(task__poison_step=5, trainer__log_every=4, trainer__epochs=2)
    with pytest.raises(NonFiniteLossError, match=r"step 6 .*mse=nan.*total=nan"):
        Trainer(cfg, _single_term_task("mse")(cfg), run_dir).fit()


def test_scheduled_weight_of_a_single_term_logs_the_weighted_total(run_dir):
    """A schedule may move the weight off 1.0: then the total is its own tensor, recorded apart."""
    from visiontrain.engine.loop.trainer import Trainer

    cfg = toy_config(trainer__epochs=1, trainer__log_every=1,
                     schedules={"loss.l1": {"shape": "linear", "base": 0.0, "end": 1.0}})
    Trainer(cfg, _single_term_task("l1")(cfg), run_dir).fit()
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["kind"] == "train"]
    assert len(rows) == 8
    for i, r in enumerate(rows):  # weight of l1 at step i is i/8
        assert r["total"] == pytest.approx(r["l1"] * i / 8, rel=1e-5, abs=1e-7)


@pytest.mark.cuda
def test_nonfinite_raise_names_step_epoch_terms(run_dir):
    cfg = toy_config(task__poison_step=10, trainer__log_every=4, checkpoint__every=1,
                     checkpoint__unit="steps", trainer__epochs=3)
    with pytest.raises(NonFiniteLossError) as err:
        train(cfg, run_dir)
    msg = str(err.value)
    assert "step 11" in msg and "epoch 1" in msg  # 8 steps per epoch: the 11th step is in epoch 1
    assert "mse=nan" in msg and "l1=" in msg and "total=nan" in msg
    assert "No checkpoint was written after that step (checkpoints/last.pt is from before it)" in msg
    state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
    assert fmt.step_of(state) == 10  # nothing written after the bad step
    assert all(torch.isfinite(v).all() for v in fmt.model_weights(state).values())


def test_a_nonfinite_stop_before_any_checkpoint_says_there_is_none(run_dir):
    """Stopped at step 3 of a run that checkpoints each epoch (8 steps): the message once said
    "checkpoints/last.pt is from before it" with no such file; it says what the run dir holds."""
    with pytest.raises(NonFiniteLossError) as err:
        train(toy_config(task__poison_step=2, trainer__log_every=4), run_dir)
    assert not (run_dir / "checkpoints" / "last.pt").exists()
    assert "No checkpoint was written after that step (nor before it: there is no checkpoints/last.pt yet)" \
        in str(err.value) and "last.pt is from before it" not in str(err.value)
    with pytest.raises(NonFiniteLossError, match=r"after that step \(nor before it: this run has no run dir\)"):
        train(toy_config(task__poison_step=2, trainer__log_every=4), None)


def test_weights_gone_nonfinite_before_the_first_checkpoint_say_there_is_none(tmp_path):
    from visiontrain.engine.step.guards import check_weights

    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        model.bias.fill_(float("nan"))
    with pytest.raises(NonFiniteLossError, match=r"nothing was written at step 8 \(nor before it: there is no "
                                                 r"checkpoints/last.pt yet\)"):
        check_weights([model], 8, 0, ckpt_dir=tmp_path / "checkpoints")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.pt").write_bytes(b"")
    with pytest.raises(NonFiniteLossError, match=r"at step 8 \(checkpoints/last.pt is from before it\)"):
        check_weights([model], 8, 0, ckpt_dir=tmp_path / "checkpoints")


@pytest.mark.cuda
def test_nonfinite_skip_leaves_weights_untouched(run_dir):
    snapshots = {}

    class Snap(Hook):
        def before_step(self):
            if self.trainer.step in (10, 11):
                snapshots[self.trainer.step] = weights(self.trainer)

    cfg = toy_config(task__poison_step=10, trainer__nonfinite="skip", trainer__epochs=3, optim__lr=0.01)
    from toy_task import ToyTask
    from visiontrain.engine.loop.trainer import Trainer

    t = Trainer(cfg, ToyTask(cfg), run_dir, hooks=[Snap()])
    summary = t.fit()
    assert max_diff(snapshots[10], snapshots[11]) == 0.0  # the poisoned step changed nothing
    assert summary["skipped_steps"] == 1 and t.step == 24
    assert all(torch.isfinite(v).all() for v in t.raw_model.state_dict().values())
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("skipped_steps") == 1 for r in rows if r["kind"] == "train")


@pytest.mark.cuda
def test_nonfinite_skip_with_foreach_optimizer():
    cfg = toy_config(task__poison_step=0, trainer__nonfinite="skip", trainer__max_steps=3,
                     optim__impl="foreach", optim__name="adamw")
    from toy_task import ToyTask
    from visiontrain.engine.loop.trainer import Trainer

    t = Trainer(cfg, ToyTask(cfg), None)
    before = weights(t)
    t.fit()
    assert t.log_point.skipped == 1
    # first step skipped (state dropped), then two real AdamW steps: step counter says 2
    state = t.optimizer.state[next(iter(t.raw_model.parameters()))]
    assert int(state["step"]) == 2
    assert max_diff(before, weights(t)) > 0


def test_lr_schedule_reaches_optimizer(run_dir):
    seen = []

    class LrProbe(Hook):
        def after_backward(self):
            seen.append([g["lr"] for g in self.trainer.optimizer.param_groups])

    cfg = toy_config(schedules={"lr": {"shape": "linear", "end": 0.0, "warmup": 2, "warmup_start": 0.0}},
                     optim__lr=0.1, optim__weight_decay=0.01, trainer__epochs=1)
    from toy_task import ToyTask
    from visiontrain.engine.loop.trainer import Trainer

    Trainer(cfg, ToyTask(cfg), None, hooks=[LrProbe()]).fit()
    # 8 steps: warmup 0 -> 0.1 over 2 steps, then linear 0.1 -> 0 over the remaining 6
    expected = [0.0, 0.05, 0.1, 0.1 * 5 / 6, 0.1 * 4 / 6, 0.1 * 3 / 6, 0.1 * 2 / 6, 0.1 * 1 / 6]
    assert [s[0] for s in seen] == pytest.approx(expected)
    assert all(len(set(s)) == 1 for s in seen)  # every group follows (lr_mult 1)


@pytest.mark.parametrize("which,expected", [("both", {"mse", "ema/mse"}), ("model", {"mse"}), ("ema", {"ema/mse"})])
def test_eval_models_and_at_start(run_dir, which, expected):
    t = train(toy_config(ema__enabled=True, eval__models=which, eval__at_start=True, trainer__epochs=1), run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, t.step]  # before the first step, then at the end
    assert all(expected == {k for k in r if "mse" in k} for r in evals)
    assert evals[0]["mse" if which != "ema" else "ema/mse"] > evals[-1]["mse" if which != "ema" else "ema/mse"]


def test_sync_bn_converts_under_ddp_and_is_refused_on_the_cpu():
    from visiontrain.engine.parallel.distributed import DistInfo, convert_sync_bn

    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2))
    assert convert_sync_bn(net, DistInfo(), torch.device("cpu")) is net  # one process: nothing to sync
    with pytest.raises(ValueError, match="trainer.sync_bn=false"):
        convert_sync_bn(net, DistInfo(rank=0, world_size=2), torch.device("cpu"))
    converted = convert_sync_bn(net, DistInfo(rank=0, world_size=2), torch.device("cuda", 0))
    assert isinstance(converted[1], torch.nn.SyncBatchNorm)
    no_bn = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    assert convert_sync_bn(no_bn, DistInfo(rank=0, world_size=2), torch.device("cpu")) is no_bn
