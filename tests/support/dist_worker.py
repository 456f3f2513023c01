"""Run by the distributed tests under torchrun: trains the toy task (optionally resuming), and rank 0
saves the full weights (and the EMA's) to OUT."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402

torch.set_num_threads(1)
from toy_task import ToyTask, toy_config  # noqa: E402
from visiontrain.engine.loop.trainer import Trainer  # noqa: E402
from visiontrain.engine.parallel.distributed import shutdown  # noqa: E402
from visiontrain.engine.parallel.fsdp import full_state_dict  # noqa: E402

out, run_dir, overrides = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
resume = sys.argv[4] if len(sys.argv) > 4 else None
cfg = toy_config(**overrides)
trainer = Trainer(cfg, ToyTask(cfg), run_dir, resume=resume)
trainer.fit()
weights = {}
for name, module in (("model", trainer.raw_model), ("ema", trainer.ema and trainer.ema.module)):
    if module is not None:  # under FSDP every rank takes part in the gather
        weights[name] = full_state_dict(module) if trainer.run.sharded else module.state_dict()
if trainer.dist.is_main:
    torch.save(weights, out)
del trainer  # DDP must not outlive the process group
shutdown()  # all ranks leave the process group together
