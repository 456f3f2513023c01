"""How visiontrain's costs grow with the size of the data, the run and the model.

Each axis is a module of ``benchmarks/scale/`` with ``run(quick) -> rows``; each also runs alone
(``python benchmarks/scale/NAME.py [--quick]``) and draws its log-log figure under
``benchmarks/results/scale-*.png``. This runs them in turn and prints every row.

    python benchmarks/scale.py --quick          # a few minutes: the small sizes of every axis
    python benchmarks/scale.py                  # every size (long)
    python benchmarks/scale.py --only checkpoints records
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scale/ package beside this file
sys.path.insert(0, str(Path(__file__).resolve().parent / "scale"))  # its modules import loglog as a script does

#: The axes, in the order they run (each a module of benchmarks/scale/).
AXES = ("startup", "worker_memory", "coco_eval", "per_class", "records", "resume_position", "checkpoints", "step_costs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small sizes only (a few minutes)")
    parser.add_argument("--only", nargs="+", choices=AXES, help="run only these axes")
    args = parser.parse_args()
    for axis in args.only or AXES:
        module = importlib.import_module(f"scale.{axis}")
        start = time.perf_counter()
        rows = module.run(args.quick)
        print(f"## {axis} ({time.perf_counter() - start:.0f} s)")
        for row in rows:
            print(json.dumps(row))
        sys.stdout.flush()


if __name__ == "__main__":
    main()
