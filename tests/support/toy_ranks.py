"""The toy task trained on NPROC ranks under torchrun, or in one plain process (tests/support/dist_worker.py),
and what the distributed tests read of such a run."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from procs import finish, popen


WORKER = Path(__file__).parent / "dist_worker.py"


def run(nproc: int, out: Path, run_dir: Path, resume: Path | None = None, **overrides) -> None:
    """The toy task on NPROC ranks (torchrun) or one plain process; OUT gets the full weights."""
    args = [str(WORKER), str(out), str(run_dir), json.dumps(overrides), *([str(resume)] if resume else [])]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args] \
        if nproc > 1 else [sys.executable, *args]
    proc = popen(cmd)  # a process group: a hang's every rank is stopped and shown
    _, err = finish(proc, 240)
    assert proc.returncode == 0, err[-3000:]


def first_loss(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r["total"] for r in rows if r["kind"] == "train" and r["step"] == 1)
