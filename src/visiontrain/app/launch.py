"""Starting the processes of a command: `fit --nproc N` as torchrun's agent, each rank importing the
user's modules again (``--import``, ``catalog.import_user``)."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

from visiontrain.core.process_tree import LAUNCHER_PID_ENV, end_with_parent, expected_pid

#: The user's command line, passed to the ranks a ``--nproc`` launch starts (their own differs).
COMMAND_ENV = "VISIONTRAIN_COMMAND"
#: Read by torchrun's agent: each rendezvous round publishes its own store address (docs/distributed.md).
UNSHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def command_line(argv: list[str]) -> str:
    """The command as the user typed it, for provenance.json: ``visiontrain ARGS``, or the command
    of the ``fit --nproc N`` that started this rank."""
    return os.environ.get(COMMAND_ENV) or shlex.join(["visiontrain", *argv])


def run_torchrun(args: argparse.Namespace) -> int:
    """``fit ... --nproc N``: ``torchrun --standalone --nproc-per-node N -m visiontrain fit ...``, with
    torchrun's agent running in this process: the scheduler's signals reach it (the pid the user
    started), and it passes them on to every rank. torch is imported here already, which saves each
    launch about 3 s of CPU over starting torchrun anew. A failed rank ends the launch with the
    rank's own exit status (``launch_failure``), not with torchrun's traceback and summary."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    imports = list(args.imports)
    main_file = users_main_file()
    if main_file:
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
    with tempfile.TemporaryDirectory(prefix="visiontrain-torchrun-") as logs, _agent_quiet():
        try:  # ``run``, not torchrun's ``main``, whose error recorder logs the failure once more
            run(parse_args(["--standalone", f"--nproc-per-node={args.nproc}", f"--log-dir={logs}", "-m",
                            "visiontrain", *argv]))
        except ChildFailedError as err:
            return launch_failure(err)
    return 0


@contextlib.contextmanager
def _agent_quiet() -> Iterator[None]:
    """The agent's own log line for a failed rank ("failed (exitcode: -9) local_rank: 1 ...") is what
    ``launch_failure`` says, once, in the project's words: that logger is quiet for the launch."""
    agent_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level = agent_log.level
    agent_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        agent_log.setLevel(level)


def launch_failure(err: Any) -> int:
    """The exit status of a launch whose rank failed (torchrun's ``ChildFailedError``). A rank that
    ended with a status of its own (``core.exit_codes``: a peer lost, a bad input, a non-finite
    loss...) has printed its one ``visiontrain: error:`` line: the launch ends with that status and
    adds nothing. A rank that died without a word (killed by a signal, the OOM killer) is named in
    one line, and the launch ends as a process killed by that signal does (128 + its number)."""
    failures = sorted(err.failures.items())
    said = [failure for _, failure in failures if failure.exitcode > 0]
    if said:
        return said[0].exitcode
    rank, failure = err.get_first_failure()
    how = f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else f"ended with status {failure.exitcode}"
    print(f"visiontrain: error: rank {rank} (pid {failure.pid}) {how}, and the run stopped; its last "
          f"checkpoint is intact: run the same command with --resume auto to continue", file=sys.stderr)
    return 128 - failure.exitcode if failure.exitcode < 0 else 1


def users_main_file() -> str | None:
    """The file of a user's script that runs the CLI itself (``python my_task.py fit --nproc N``),
    which each rank must import to register what it defines; None when the CLI was started as
    itself: ``python -m visiontrain`` (the package's ``__main__.py``) or the ``visiontrain`` console
    script, a file that only imports ``visiontrain.app.cli.main`` and calls it."""
    main = sys.modules.get("__main__")
    main_file = getattr(main, "__file__", None)
    if not main_file or getattr(getattr(main, "main", None), "__module__", None) == "visiontrain.app.cli":
        return None
    if Path(main_file).resolve() == (Path(__file__).parents[1] / "__main__.py").resolve():
        return None
    return main_file


def end_with_launcher() -> None:
    """In a rank that torchrun's agent started: end when the agent dies. The agent starts each rank in
    a session of its own, so a ``kill -9`` of the launcher's process group does not reach the ranks,
    which would go on training and writing the run dir beside the next attempt."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        end_with_parent(expected_pid(LAUNCHER_PID_ENV))


def elastic_store_hint(env: dict[str, str]) -> str | None:
    """The line for rank 0 of the first round of a torchrun run whose agents may start their ranks
    again (``--max-restarts`` above 0) without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with torch
    2.13 a machine that joins after another was lost waits on the rendezvous until it times out
    (pytorch#147064). The ranks see the agent's environment, so they can tell; None otherwise."""
    restarts = env.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if "TORCHELASTIC_RUN_ID" not in env or not restarts.isdigit() or int(restarts) == 0 \
            or env.get(UNSHARED_STORE_ENV) == "1" or env.get("RANK", "0") != "0" \
            or env.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    return (f"visiontrain: torchrun may start the ranks again (--max-restarts {restarts}), but a machine that "
            f"joins after another was lost will wait on the rendezvous until it times out unless every agent "
            f"runs with {UNSHARED_STORE_ENV}=1 (torch's shared rendezvous store; docs/distributed.md, \"Elastic\")")
