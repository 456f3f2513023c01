"""Starting the processes of a command: `fit --nproc N` as torchrun's agent, each rank importing the
user's modules again (``--import``, ``catalog.import_user``)."""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path

from visiontrain.core.process_tree import LAUNCHER_PID_ENV, end_with_parent, expected_pid

#: The user's command line, passed to the ranks a ``--nproc`` launch starts (their own differs).
COMMAND_ENV = "VISIONTRAIN_COMMAND"


def command_line(argv: list[str]) -> str:
    """The command as the user typed it, for provenance.json: ``visiontrain ARGS``, or the command
    of the ``fit --nproc N`` that started this rank."""
    return os.environ.get(COMMAND_ENV) or shlex.join(["visiontrain", *argv])


def run_torchrun(args: argparse.Namespace) -> int:
    """``fit ... --nproc N``: ``torchrun --standalone --nproc-per-node N -m visiontrain fit ...``, with
    torchrun's agent running in this process: the scheduler's signals reach it (the pid the user
    started), and it passes them on to every rank. torch is imported here already, which saves each
    launch about 3 s of CPU over starting torchrun anew. A failed rank ends it as it ends torchrun:
    the failure's summary, then ``ChildFailedError``."""
    from torch.distributed.run import main as torchrun

    imports = list(args.imports)
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)  # python my_task.py fit --nproc N
    if main_file and Path(main_file).resolve() != (Path(__file__).parents[1] / "__main__.py").resolve():
        imports.append(main_file)  # the ranks import it as a module: it registers its task
    argv = [*(a for m in imports for a in ("--import", m)), "fit", args.recipe, *args.overrides]
    for flag, value in (("--run-dir", args.run_dir), ("--resume", args.resume), ("--init", args.init)):
        if value is not None:
            argv += [flag, value]
    sys.stdout.flush()
    os.environ[COMMAND_ENV] = args.command_line
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the agent is this process: the ranks' parent
    # torchrun keeps each rank's error file in a log dir, by default a new /tmp/torchelastic_* it never
    # removes (one a launch). Its failure summary has read them by the time it returns or raises.
    with tempfile.TemporaryDirectory(prefix="visiontrain-torchrun-") as logs:
        torchrun(["--standalone", f"--nproc-per-node={args.nproc}", f"--log-dir={logs}", "-m", "visiontrain", *argv])
    return 0


def end_with_launcher() -> None:
    """In a rank that torchrun's agent started: end when the agent dies. The agent starts each rank in
    a session of its own, so a ``kill -9`` of the launcher's process group does not reach the ranks,
    which would go on training and writing the run dir beside the next attempt."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        end_with_parent(expected_pid(LAUNCHER_PID_ENV))
