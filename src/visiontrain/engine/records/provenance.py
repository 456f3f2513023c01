"""Where a run came from: ``RUN_DIR/provenance.json``, one entry per launch.

A run that is preempted and resumed runs as several processes, possibly on other machines, from
another checkout or with other package versions; each launch appends its own entry (``launches``)
and never rewrites an earlier one. An entry holds the recipe, the command line and its overrides,
the step it started at and the checkpoint it resumed from, the package versions, the git commit of
the current directory (and whether tracked files differ from it), the host, platform, CPU count and
GPUs. The file is replaced atomically, so a kill leaves the old list or the new one.

Reading is torch-free (``report`` shows the launches); recording runs in the training process.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import visiontrain
from visiontrain.core.cores import usable_cores
from visiontrain.rundir.run_files import PROVENANCE_FILE

#: Versions every launch records; a tracker adds its own package (``Tracker.packages``).
PACKAGES = ("torch", "torchvision", "timm", "numpy")


@dataclass
class Launch:
    """What this process was started with. The CLI fills it in; a run started from Python records
    its interpreter's command line and no recipe."""

    recipe: str | None = None
    overrides: list[str] = field(default_factory=list)
    command: str = field(default_factory=lambda: shlex.join([sys.executable, *sys.argv]))


@dataclass(frozen=True)
class Starting:
    """Where this launch takes the run up: at ``step``, from the checkpoint ``resumed_from`` (None: a
    fresh run), on ``world_size`` processes, computing in ``precision`` (what ``trainer.precision``
    resolved to on this machine and why: a resumed ``auto`` run may compute in another precision on
    another machine; each launch says its own)."""
    step: int = 0
    resumed_from: str | None = None
    world_size: int = 1
    precision: dict[str, str] | None = None


def read_provenance(run_dir: str | Path) -> dict[str, Any]:
    """The run's record (``{}`` when it has none); a file that is not a JSON object is a
    ValueError naming it."""
    path = Path(run_dir) / PROVENANCE_FILE
    if not path.is_file():
        return {}
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(record, dict) or not isinstance(record.get("launches", []), list):
        raise ValueError(f"{path}: not a provenance record (expected an object with a list of launches)")
    return record


def record_launch(run_dir: Path, launch: Launch, starting: Starting, *,
                  packages: tuple[str, ...] = ()) -> dict[str, Any]:
    """Append this launch to RUN_DIR/provenance.json and return the whole record. A file that
    cannot be read (edited by hand) is kept aside as provenance-unreadable.json, not overwritten."""
    from visiontrain.engine.state.checkpoint import write_run_file  # torch: kept out of the readers' imports

    try:
        record = read_provenance(run_dir)
    except ValueError:
        os.replace(run_dir / PROVENANCE_FILE, run_dir / "provenance-unreadable.json")
        record = {}
    entry = describe_launch(launch, starting, packages=packages)
    record = {"launches": [*record.get("launches", []), entry]}
    write_run_file(run_dir, PROVENANCE_FILE, json.dumps(record, indent=2) + "\n")
    return record


def describe_launch(launch: Launch, starting: Starting, *, packages: tuple[str, ...] = ()) -> dict[str, Any]:
    """One launch's entry: what was run, from which code, on which machine, and where it took the run up."""
    s = starting
    return {
        "started": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "recipe": launch.recipe, "command": launch.command, "overrides": list(launch.overrides),
        "step": s.step, "resumed_from": s.resumed_from,
        "cwd": os.getcwd(), "git": git_state(Path.cwd()),
        "versions": package_versions((*PACKAGES, *packages)),
        "host": socket.gethostname(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "usable_cores": usable_cores(), "gpus": gpu_names(), "world_size": s.world_size, "precision": s.precision,
    }


def git_state(cwd: Path) -> dict[str, Any] | None:
    """``{"commit", "dirty"}`` of the git checkout ``cwd`` is in (dirty: a tracked file differs from
    the commit; a run dir inside the checkout is not a change); None when git is missing, ``cwd`` is
    not in a checkout or it has no commit yet."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "--verify", "HEAD")
        if head.returncode != 0:
            return None
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head.stdout.strip(), "dirty": status.returncode != 0 or status.stdout.strip() != ""}


def package_versions(names: tuple[str, ...]) -> dict[str, str | None]:
    """Python's version, then each installed distribution's (None when it is not installed), then
    visiontrain's own: the code that runs, installed or not."""
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in names:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    versions["visiontrain"] = visiontrain.__version__
    return versions


def gpu_names() -> list[str]:
    """The CUDA devices this process sees, by name; none on a machine without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
