"""Per-step costs that grow with the model, against its size: the EMA update, the gradient norm and
clipping, the weights' non-finite check (paid at checkpoints), and building the parameter groups
(paid once). Models from 1.3M to 304M parameters (timm: mobilevit_xxs, ViT-Ti/S/B/L), CPU, one
thread, each in a process of its own; the median of several calls of the project's own code
(``ModelEma.update``, ``TrainStep._unscale_and_clip``, ``check_weights``, ``build_param_groups``
with ``check_coverage``).

    python benchmarks/scale/step_costs.py [--quick]
"""
from __future__ import annotations

import statistics
import time

from loglog import RESULTS, draw, in_child, main, slope

MODELS = {"mobilevit_xxs": "mobilevit_xxs", "vit_tiny": "vit_tiny_patch16_224", "vit_small": "vit_small_patch16_224",
          "vit_base": "vit_base_patch16_224", "vit_large": "vit_large_patch16_224"}
QUICK = ("mobilevit_xxs", "vit_tiny", "vit_small")
REPEATS = 7


def _median_s(fn, repeats: int = REPEATS) -> float:
    fn()  # warm-up: first-call allocations and caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str) -> dict:
    import torch

    from visiontrain.core._tv_compat import ensure_torchvision

    ensure_torchvision()
    import timm

    from visiontrain.engine.step.ema import ModelEma
    from visiontrain.engine.step.guards import check_weights
    from visiontrain.engine.optim.param_groups import build_param_groups, check_coverage
    from visiontrain.engine.step.pipeline import StepOptions, TrainStep

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    groups = build_param_groups(model, 0.05)
    optimizer = torch.optim.AdamW(groups, lr=1e-4)
    step = TrainStep(model, lambda m, b: {}, optimizer, StepOptions(torch.device("cpu"), clip_grad=1.0), recorder=None)
    ema = ModelEma(model, 0.999)
    ema.update(model, 1)  # builds its pairs once, as in a run

    def groups_once() -> None:
        check_coverage(model, build_param_groups(model, 0.05))

    return {"params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
            "ema_update_s": _median_s(lambda: ema.update(model, 1)),
            "grad_norm_clip_s": _median_s(step._unscale_and_clip),
            "nonfinite_check_s": _median_s(lambda: check_weights([model, ema.module], 1, 0)),
            "param_groups_s": _median_s(groups_once, 3)}


def run(quick: bool = False) -> list[dict]:
    """One row per model, each measured in a process of its own; the figure for a full run."""
    rows = []
    for name, spec in MODELS.items():
        if quick and name not in QUICK:
            continue
        row = in_child(__file__, spec)
        rows.append({"model": name, **{k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()}})
    if not quick:
        xs = [r["params_m"] for r in rows]
        keys = ("ema_update_s", "grad_norm_clip_s", "nonfinite_check_s", "param_groups_s")
        curves = {k[:-2]: (xs, [r[k] for r in rows]) for k in keys}
        draw([("parameters (M)", "seconds per call (CPU, 1 thread)", curves)], RESULTS / "scale-step-costs.png")
        rows.append({"model": "log-log slope", **{k: round(slope(xs, [r[k] for r in rows]), 2)
                                                  for k in rows[0] if k.endswith("_s")}})
    return rows


if __name__ == "__main__":
    main(__doc__, run, measure, "the three smallest models only")
