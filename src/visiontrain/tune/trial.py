"""One trial of ``visiontrain tune``: a ``visiontrain fit`` in a process of its own, watched from its
metrics file.

A trial is a normal run, in its own run dir, with its config, metrics, checkpoints, report and
provenance: anything that works on a run works on a trial. Running it as a subprocess means a trial
that crashes, runs out of memory or is killed cannot take the tuner down, and that a tuner killed
with SIGKILL cannot leave a trial training on its own: the trial gets SIGTERM as its parent dies
(Linux ``PR_SET_PDEATHSIG``), writes ``last.pt`` at its next step and exits, ready to be resumed.

The tuner reads the trial's evaluation rows as they are written (``metrics.jsonl``), reports each to
Optuna, and asks the pruner; a trial to prune gets SIGTERM too, so it also ends with its checkpoint
written.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from visiontrain.core.exit_codes import EXIT_INTERRUPTED, EXIT_NONFINITE, EXIT_OUT_OF_MEMORY, EXIT_PREEMPTED, EXIT_USAGE
from visiontrain.rundir.metrics_file import ema_key, read_metrics
from visiontrain.rundir.run_files import METRICS_FILE

#: In each trial's run dir: the fit's console output (appended across resumes).
TRIAL_LOG = "fit.log"
#: How often the tuner looks at a running trial's metrics (seconds).
POLL_S = 0.5
#: prctl option: the signal a process gets when the thread that started it dies (linux/prctl.h).
PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None

COMPLETE, PRUNED, FAILED, INTERRUPTED, USAGE = "complete", "pruned", "failed", "interrupted", "usage"
WHY_EXITED = {EXIT_NONFINITE: "a non-finite loss", EXIT_OUT_OF_MEMORY: "out of memory",
              EXIT_PREEMPTED: "stopped by a signal", EXIT_INTERRUPTED: "stopped by Ctrl-C"}


@dataclasses.dataclass(frozen=True)
class Objective:
    """The number a study optimises: the recipe's ``eval.metric`` (or ``--metric``), in its ``eval.mode``.
    An evaluation row's value is the better of the model's and the EMA's where both are evaluated (each
    keeps its own best checkpoint); a trial's value is its best row's, the metric of its best.pt."""

    metric: str
    mode: str

    @property
    def direction(self) -> str:
        return "maximize" if self.mode == "max" else "minimize"

    def of_row(self, row: dict[str, Any]) -> float | None:
        values = [row[k] for k in (self.metric, ema_key(self.metric)) if _finite(row.get(k))]
        return self.best(values)

    def best(self, values: list[float]) -> float | None:
        if not values:
            return None
        return max(values) if self.mode == "max" else min(values)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclasses.dataclass
class Outcome:
    """How a trial ended: ``state`` one of complete, pruned, failed, interrupted (stopped with the
    tuner: to be resumed) or usage (the trial's config is refused: the study cannot go on)."""

    state: str
    value: float | None = None
    exit_code: int | None = None
    reason: str = ""
    pruned_at: int | None = None


@dataclasses.dataclass
class TrialProcess:
    """What a trial runs: the fit command and environment, and where it writes."""

    command: list[str]
    run_dir: Path
    env: dict[str, str]
    cores: list[int] | None = None

    def start(self) -> subprocess.Popen:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / TRIAL_LOG, "ab") as log:
            # A session of its own: a Ctrl-C in the tuner's terminal reaches the tuner only, which stops
            # each trial (SIGTERM) and marks it for resuming.
            return subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                    start_new_session=True, preexec_fn=functools.partial(_in_child, self.cores))

    def last_line(self) -> str:
        """The fit's last line of output: the error a failed trial ended with."""
        try:
            lines = [ln for ln in (self.run_dir / TRIAL_LOG).read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return lines[-1].strip() if lines else ""


def _in_child(cores: list[int] | None) -> None:
    """In the trial's process before it runs: SIGTERM (a checkpoint, then exit) when the tuner dies,
    and the job's cores as its affinity (its DataLoader workers inherit it)."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if cores is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)


def fit_command(recipe: str, overrides: list[str], run_dir: Path, imports: list[str]) -> list[str]:
    """``visiontrain fit`` of one trial; ``--resume auto`` continues a trial interrupted before."""
    return [sys.executable, "-m", "visiontrain", *(a for m in imports for a in ("--import", m)), "fit", recipe,
            *overrides, "trainer.progress=plain", "--run-dir", str(run_dir), "--resume", "auto"]


def trial_env(cores: list[int] | None) -> dict[str, str]:
    """The tuner's environment, with a thread for each of the trial's cores when several trials run at
    once (torch's default is the machine's physical cores, whatever the affinity)."""
    env = dict(os.environ)
    if cores:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(len(cores))
    return env


class Watch:
    """Follows a running trial: its evaluation rows go to Optuna's ``trial.report`` (the ones after
    training started: an evaluation at step 0 measures the initialisation, not the settings), and
    the pruner is asked after each.

    A row is reported at its number among them (1, 2, ...), not at its optimizer step: trials whose
    batch size differs evaluate at different steps after the same epochs, and the pruner compares
    trials at equal report steps."""

    def __init__(self, trial: Any, run_dir: Path, objective: Objective,
                 on_eval: Callable[[int, float], None]) -> None:
        self.trial, self.path, self.objective, self.on_eval = trial, run_dir / METRICS_FILE, objective, on_eval
        self.reported: set[int] = set()
        self.values: dict[int, float] = {}
        self.pruned_at: int | None = None

    def read(self) -> bool:
        """Read new evaluation rows; True when the pruner says to stop the trial."""
        if not self.path.is_file():
            return False
        for row in read_metrics(self.path, strict=False).evals:
            step, value = int(row["step"]), self.objective.of_row(row)
            if value is None or step in self.values:
                continue
            self.values[step] = value
            if step > 0:
                self.trial.report(value, sum(s > 0 for s in self.values))
                self.on_eval(step, value)
                if self.pruned_at is None and self.trial.should_prune():
                    self.pruned_at = step
                    return True
        return False

    @property
    def value(self) -> float | None:
        return self.objective.best(list(self.values.values()))


def run_trial(process: TrialProcess, watch: Watch, stopping: threading.Event,
              heartbeat: Callable[[], None]) -> Outcome:
    """Run the trial to its end, pruning it or stopping it with the tuner; never raises for the
    trial's own failure."""
    proc = process.start()
    signalled = False
    while True:
        try:
            code = proc.wait(POLL_S)
        except subprocess.TimeoutExpired:
            code = None
        prune = watch.read()
        heartbeat()
        if (prune or stopping.is_set()) and not signalled and code is None:
            proc.send_signal(signal.SIGTERM)  # the fit writes last.pt at its next step, then exits
            signalled = True
        if code is not None:
            watch.read()
            return _outcome(code, process, watch, stopping)


def _outcome(code: int, process: TrialProcess, watch: Watch, stopping: threading.Event) -> Outcome:
    if watch.pruned_at is not None and code in (0, EXIT_PREEMPTED):
        return Outcome(PRUNED, watch.value, code, f"pruned at step {watch.pruned_at}", watch.pruned_at)
    if code == 0:
        if watch.value is None:
            return Outcome(FAILED, None, code, f"no evaluation gave {watch.objective.metric}: the objective needs "
                                               f"evaluations (eval.every > 0)")
        return Outcome(COMPLETE, watch.value, code)
    if code in (EXIT_PREEMPTED, EXIT_INTERRUPTED) or (code < 0 and stopping.is_set()):
        return Outcome(INTERRUPTED, watch.value, code, "stopped before its end: to be resumed from its last.pt")
    if code == EXIT_USAGE:
        return Outcome(USAGE, None, code, process.last_line())
    if code < 0:
        return Outcome(FAILED, watch.value, code, f"killed by {signal.Signals(-code).name}")
    why = WHY_EXITED.get(code, f"exit status {code}")
    return Outcome(FAILED, watch.value, code, f"{why}: {process.last_line()}")
