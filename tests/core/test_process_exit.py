"""A process visiontrain owns ends without the interpreter's last full garbage collections
(``process_tree.skip_final_collection``); a Python program that calls the CLI keeps its own exit.

The probe is a fresh interpreter on purpose (``python -c``): the subject is how it ends.
"""
from __future__ import annotations

import subprocess
import sys

PROBE = """
import atexit, gc, sys
# registered before the command: runs after everything the command registers
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0))
from visiontrain.core import process_tree
from visiontrain.app.cli import main
main(["show-config", "classify-fashion"])  # a Python caller's call
print("after a call:", process_tree._final_collection_skipped, gc.get_freeze_count())
if sys.argv[1] == "command":
    sys.argv = ["visiontrain", "show-config", "classify-fashion"]
    main()  # as the console script calls it
"""


def probe(mode: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [line for line in proc.stdout.splitlines() if line.startswith(("frozen", "after"))]


def test_a_command_ends_without_the_final_collection_and_a_python_caller_keeps_its_own():
    assert probe("command") == ["after a call: False 0", "frozen at exit: True"]
    assert probe("caller") == ["after a call: False 0", "frozen at exit: False"]
