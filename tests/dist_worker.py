"""Run by tests/test_distributed.py under torchrun: trains the toy task, rank 0 saves weights."""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import torch  # noqa: E402

torch.set_num_threads(1)
from toy_task import ToyTask, toy_config  # noqa: E402
from visiontrain.engine.distributed import shutdown  # noqa: E402
from visiontrain.engine.trainer import Trainer  # noqa: E402

out, run_dir, overrides = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
cfg = toy_config(**overrides)
trainer = Trainer(cfg, ToyTask(cfg), run_dir)
trainer.fit()
if trainer.dist.is_main:
    torch.save(trainer.raw_model.state_dict(), out)
del trainer  # DDP must not outlive the process group
shutdown()  # all ranks leave the process group together
