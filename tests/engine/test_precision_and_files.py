"""The precision a run computes in (trainer.precision=auto by what the device computes natively), bf16,
and the checkpoint files a run keeps (fp16 overflow skips: tests/reliability/test_faults.py)."""
from __future__ import annotations

import json

import pytest
import torch

from toy_task import ToyTask, toy_config
from visiontrain.core.config import ConfigError
from visiontrain.engine.loop.trainer import Trainer
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.engine.state.checkpoint import load_checkpoint
from visiontrain.engine.state.weights import load_init_weights
from visiontrain.engine.step import precision


def test_bf16_trains_and_logs_fp32_values(run_dir):
    t = Trainer(cfg := toy_config(trainer__precision="bf16", trainer__max_steps=8), ToyTask(cfg), run_dir)
    t.fit()
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if '"train"' in l]
    assert rows and all(isinstance(r["mse"], float) for r in rows)
    assert t.run.scaler is None


CPU = torch.device("cpu")


def fake_cpu(monkeypatch, **caps: bool) -> None:
    """This CPU as one with the instruction sets named (the capability is faked, not the CPU)."""
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"cpu_name": "Test CPU", **caps})


def fake_gpu(monkeypatch, *, bf16: bool) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Test GPU")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)


@pytest.mark.parametrize("caps, chosen, why", [
    ({"avx512_bf16": True}, "bf16", "Test CPU has AVX512_BF16"),
    ({"amx_bf16": True, "amx_tile": True}, "bf16", "Test CPU has AMX_BF16"),
    ({"bf16": True}, "bf16", "Test CPU has BF16"),  # Arm's BF16 extension (Graviton 3)
    ({"avx512_f": True, "avx2": True}, "fp32", "Test CPU has no AVX512_BF16 or AMX_BF16, so bf16 is emulated"),
    ({"avx2": True}, "fp32", "Test CPU has no AVX512_BF16 or AMX_BF16, so bf16 is emulated"),
])
def test_auto_on_a_cpu_is_bf16_only_where_it_is_native(monkeypatch, caps, chosen, why):
    fake_cpu(monkeypatch, **caps)
    choice = precision.choose_precision("auto", CPU)
    assert (choice.precision, choice.requested, choice.why) == (chosen, "auto", why)
    assert choice.line() == f"precision: {chosen}, chosen by trainer.precision=auto: {why}"


def test_auto_on_a_gpu_is_bf16_else_fp16_with_the_scaler_else_fp32_when_sharded(monkeypatch):
    gpu = torch.device("cuda", 0)
    fake_gpu(monkeypatch, bf16=True)
    assert precision.choose_precision("auto", gpu).record() == {
        "precision": "bf16", "requested": "auto", "why": "Test GPU computes bf16"}
    assert precision.choose_precision("auto", gpu, sharded=True).precision == "bf16"
    fake_gpu(monkeypatch, bf16=False)  # a V100
    assert precision.choose_precision("auto", gpu).record() == {
        "precision": "fp16", "requested": "auto", "why": "Test GPU has no bf16; fp16 with a gradient scaler instead"}
    assert precision.choose_precision("auto", gpu).scaler(CPU) is not None  # fp16's, on any device type
    assert precision.choose_precision("bf16", CPU).scaler(CPU) is None and precision.FP32.scaler(CPU) is None
    sharded = precision.choose_precision("auto", gpu, sharded=True)
    assert sharded.precision == "fp32" and "sharded model cannot use fp16's gradient scaler" in sharded.why
    with pytest.raises(ConfigError, match="distributed.strategy=fsdp with trainer.precision=fp16"):
        precision.choose_precision("fp16", gpu, sharded=True)
    assert precision.choose_precision("auto", torch.device("mps")).precision == "fp32"  # support unknown


def test_a_forced_precision_is_kept_and_an_emulated_one_says_so(monkeypatch):
    fake_cpu(monkeypatch, avx2=True)
    assert precision.choose_precision("fp32", CPU).line() == "precision: fp32, as trainer.precision sets: full precision"
    emulated = precision.choose_precision("bf16", CPU)
    assert emulated.precision == "bf16" and emulated.line() == (
        "precision: bf16, as trainer.precision sets: Test CPU has no AVX512_BF16 or AMX_BF16, so bf16 is emulated: "
        "slower than fp32 here; trainer.precision=auto picks fp32 on it")
    assert "fp16 is emulated" in precision.choose_precision("fp16", CPU).why
    fake_cpu(monkeypatch, avx512_bf16=True)
    assert precision.choose_precision("bf16", CPU).why == "Test CPU has AVX512_BF16"


def test_a_torch_without_get_capabilities_asks_its_two_x86_checks(monkeypatch):
    monkeypatch.delattr(torch.cpu, "get_capabilities")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert precision.choose_precision("auto", CPU).why == "this CPU has AMX_BF16"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert precision.choose_precision("auto", CPU).precision == "fp32"


@pytest.mark.parametrize("native", [True, False])
def test_out_of_memory_advice_lowers_the_precision_the_run_computes_in(tmp_path, monkeypatch, native):
    """The advice follows what ``auto`` resolved to on this CPU, not what the config asked for: on a CPU
    with native bf16 the run already computes in it and there is no precision left to lower."""
    from types import SimpleNamespace

    from visiontrain.engine.step.guards import out_of_memory_message

    fake_cpu(monkeypatch, avx512_bf16=native)
    cfg = toy_config(trainer__precision="auto")
    run = SimpleNamespace(cfg=cfg, device=CPU, precision=precision.choose_precision("auto", CPU), ckpt_dir=tmp_path)
    message = out_of_memory_message(MemoryError("can't allocate memory"), phase="training", run=run, step=3)
    assert ("or set trainer.precision=bf16" in message) == (not native), message
    assert message.endswith("No checkpoint was written yet.")


@pytest.mark.parametrize("native", [True, False])
def test_a_run_says_and_records_what_auto_chose(tmp_path, monkeypatch, capsys, native):
    fake_cpu(monkeypatch, avx512_bf16=native)
    cfg = toy_config(trainer__precision="auto", trainer__max_steps=2)
    t = Trainer(cfg, ToyTask(cfg), tmp_path / "run")
    t.fit()
    chosen = "bf16" if native else "fp32"
    record = precision.choose_precision("auto", CPU).record()
    assert t.step_fn.precision.precision == record["precision"] == chosen
    out = capsys.readouterr().out
    assert out.count("precision: ") == 1 and f"precision: {chosen}, chosen by trainer.precision=auto" in out
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["precision"] == record
    launch, = json.loads((tmp_path / "run" / "provenance.json").read_text())["launches"]
    assert launch["precision"] == record


class OutputDtypes(ToyTask):
    """The toy task that also notes the dtype of the model's outputs in each evaluation."""

    def evaluate(self, model, data):
        self.seen = {model(x).dtype for (x, _y, _), _real in data}
        return super().evaluate(model, data)


@pytest.mark.parametrize("setting, dtype", [("fp32", torch.float32), ("train", torch.bfloat16)])
def test_eval_precision_train_evaluates_under_the_runs_autocast_and_fp32_by_default(tmp_path, capsys, setting, dtype):
    """fit's evaluations and validate's (``build_evaluation`` from the run's config) compute alike."""
    from visiontrain.engine.parts.evaluator import evaluate_models
    from visiontrain.engine.setup.training import build_evaluation

    cfg = toy_config(trainer__precision="bf16", trainer__max_steps=2, eval__precision=setting)
    t = Trainer(cfg, task := OutputDtypes(cfg), tmp_path / "run")
    t.fit()
    assert task.seen == {dtype}
    said = "evaluation in bf16, as eval.precision=train sets"
    assert (said in capsys.readouterr().out) == (setting == "train")
    task.seen = set()
    evaluate_models(build_evaluation(cfg, task, t.run.raw_model, None, t.run.data_info))
    assert task.seen == {dtype}


def test_periodic_and_k_best_checkpoints(run_dir):
    cfg = toy_config(trainer__epochs=4, optim__lr=0.001, checkpoint__keep_every=8, checkpoint__keep_best=2,
                     checkpoint__every=4, checkpoint__unit="steps", eval__every=4, eval__unit="steps")
    Trainer(cfg, ToyTask(cfg), run_dir).fit()
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert {"last.pt", "best.pt", "step-8.pt", "step-16.pt", "step-24.pt"} <= set(names)
    kept = [n for n in names if n.startswith("best-step")]
    assert len(kept) == 2
    assert fmt.step_of(load_checkpoint(run_dir / "checkpoints" / "step-16.pt")) == 16


def test_init_from_safetensors_loads_weights_only(run_dir, tmp_path):
    cfg = toy_config(trainer__max_steps=4)
    first = Trainer(cfg, ToyTask(cfg), run_dir)
    first.fit()
    wide = toy_config(task__hidden=64)  # another hidden size: both Linear layers differ in shape
    t = Trainer(wide, ToyTask(wide), None)
    report = load_init_weights(t.raw_model, run_dir / "model.safetensors")
    assert ("loaded 1/4 tensors; skipped 3 with another shape: 0.bias (32,) -> (64,), "
            "0.weight (32, 16) -> (64, 16), 3.weight (1, 32) -> (1, 64)") in report  # 3.bias (1,) fits
    same = Trainer(cfg, ToyTask(cfg), None, init=str(run_dir / "model.safetensors"))
    assert all(torch.equal(a, b) for a, b in zip(same.raw_model.state_dict().values(),
                                                 first.raw_model.state_dict().values()))
    assert same.step == 0  # weights only: a new run


def test_torch_compile_matches_eager(tmp_path, monkeypatch):
    """trainer.compile=true (about 15 s of compilation on CPU): same training as eager."""
    # Inductor's own cache dir: its cache keys leave out ATEN_CPU_CAPABILITY, so C++ it compiled for
    # one kernel set (a run of the suite on AVX2) failed to build under another (=default)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    cfg_e = toy_config(trainer__max_steps=6, optim__lr=0.01)
    cfg_c = toy_config(trainer__max_steps=6, optim__lr=0.01, trainer__compile=True)
    eager = Trainer(cfg_e, ToyTask(cfg_e), None)
    eager.fit()
    compiled = Trainer(cfg_c, ToyTask(cfg_c), None)
    compiled.fit()
    assert compiled.model is not compiled.raw_model  # the step ran through the compiled module
    a, b = eager.raw_model.state_dict(), compiled.raw_model.state_dict()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
