"""The exit status of every ``visiontrain`` command, in one place: the CLI returns them, the engine
names the one a stop ends with (``stop_signals.Preempted.exit_code``), and scripts and
schedulers read them. Below every room, with ``stop_signals``, since both reach it.

0 is success; each other status below says what happened and what to do next.
"""
from __future__ import annotations

#: A bad recipe, key, value, path or checkpoint, or a file that cannot be written: one line on stderr
#: names it; nothing already written is lost. Fix the input and run again. (argparse's own usage
#: errors exit 2 too.)
EXIT_USAGE = 2
#: A non-finite loss under ``trainer.nonfinite=raise``: no checkpoint was written after that step.
EXIT_NONFINITE = 3
#: Stopped by SIGTERM or SIGUSR1 (a scheduler's preemption): last.pt is written, ``--resume auto`` continues.
EXIT_PREEMPTED = 4
#: Out of memory on the device: the last checkpoint is intact; the message says what to lower.
EXIT_OUT_OF_MEMORY = 5
#: Under torchrun, another rank or node was lost (killed, crashed, unreachable) and this rank stopped:
#: last.pt is intact; restart every node with ``--resume auto``.
EXIT_PEER_LOST = 6
#: Stopped by Ctrl-C (the shell's 128 + SIGINT): last.pt is written, as for a preemption.
EXIT_INTERRUPTED = 130
