"""``trainer.profile=true``: a torch.profiler trace of a few training steps, written to the run dir.

The window starts at ``trainer.profile_start`` (after the first steps' warm-up: allocator, cuDNN
autotuning, lazy init) and covers ``trainer.profile_steps`` optimizer steps, data loading
included, so the trace shows where a step's time goes: the loader, the forward and backward
kernels, the optimizer, and any host sync. Rank 0 writes ``profile/trace.json`` (open it in
Perfetto or chrome://tracing) and ``profile/summary.txt`` (the operators by total time).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from visiontrain.engine.protocols.hooks import Hook
from visiontrain.rundir.run_files import PROFILE_DIR


class ProfileSteps(Hook):
    def __init__(self, out_dir: Path, start: int, steps: int) -> None:
        self.out_dir, self.start, self.stop_at = out_dir, start, start + steps
        self.prof: torch.profiler.profile | None = None
        self.done = False

    def before_step(self) -> None:
        if self.prof is None and not self.done and self.trainer.step == self.start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.trainer.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
            self.prof.__enter__()

    def after_step(self) -> None:
        if self.prof is not None and self.trainer.step >= self.stop_at:
            self._write()

    def after_train(self) -> None:  # a run shorter than the window still gets what was recorded
        if self.prof is not None:
            self._write()

    def _write(self) -> None:
        self.prof.__exit__(None, None, None)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(self.out_dir / "trace.json"))
        sort = "cuda_time_total" if self.trainer.device.type == "cuda" else "cpu_time_total"
        table = self.prof.key_averages().table(sort_by=sort, row_limit=40)
        (self.out_dir / "summary.txt").write_text(
            f"steps {self.start + 1}..{self.trainer.step} (trainer.profile_start={self.start})\n{table}\n")
        self.trainer.log.print(f"profile of steps {self.start + 1}..{self.trainer.step} written to {self.out_dir}")
        self.prof, self.done = None, True

    @classmethod
    def for_run(cls, trainer: Any) -> "ProfileSteps | None":
        """The profiler when ``trainer.profile`` is on and this rank writes the run dir."""
        t, run = trainer.cfg.trainer, trainer.run
        return cls(run.run_dir / PROFILE_DIR, t.profile_start, t.profile_steps) if t.profile and run.writes else None
