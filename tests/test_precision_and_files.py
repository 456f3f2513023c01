"""bf16, and the checkpoint files a run keeps (fp16 overflow skips: tests/reliability/test_faults.py)."""
from __future__ import annotations

import torch

from toy_task import ToyTask, toy_config
from visiontrain.engine.loop.trainer import Trainer
from visiontrain.engine.state import checkpoint_format as fmt
from visiontrain.engine.state.checkpoint import load_checkpoint
from visiontrain.engine.state.weights import load_init_weights


def test_bf16_trains_and_logs_fp32_values(run_dir):
    import json

    t = Trainer(cfg := toy_config(trainer__precision="bf16", trainer__max_steps=8), ToyTask(cfg), run_dir)
    t.fit()
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if '"train"' in l]
    assert rows and all(isinstance(r["mse"], float) for r in rows)
    assert t.run.scaler is None


def test_bf16_on_a_cpu_without_bf16_instructions_says_fp32_is_faster(run_dir, monkeypatch, capsys):
    from visiontrain.engine.step import precision

    cpu = torch.device("cpu")
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert precision.precision_note("bf16", cpu) is None
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert precision.precision_note("fp32", cpu) is None and precision.precision_note("fp16", cpu) is None
    Trainer(cfg := toy_config(trainer__precision="bf16", trainer__max_steps=1), ToyTask(cfg), run_dir)
    assert "trainer.precision=bf16: this CPU has no native bf16" in capsys.readouterr().out


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


def test_torch_compile_matches_eager():
    """trainer.compile=true (about 15 s of compilation on CPU): same training as eager."""
    cfg_e = toy_config(trainer__max_steps=6, optim__lr=0.01)
    cfg_c = toy_config(trainer__max_steps=6, optim__lr=0.01, trainer__compile=True)
    eager = Trainer(cfg_e, ToyTask(cfg_e), None)
    eager.fit()
    compiled = Trainer(cfg_c, ToyTask(cfg_c), None)
    compiled.fit()
    assert compiled.model is not compiled.raw_model  # the step ran through the compiled module
    a, b = eager.raw_model.state_dict(), compiled.raw_model.state_dict()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
