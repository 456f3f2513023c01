"""Python calls per training step of the engine, counted, not timed: the run of ``overhead.py``'s
engine (tiny MLP, log every 50 steps) under cProfile for N and 2N steps; the difference over N is
the per-step count, free of set-up and of machine load. The engine's own calls are listed by
function, so a change to the loop shows as a count that moved.

    python benchmarks/step_calls.py [--steps 1000]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402


def calls(steps: int) -> dict[tuple[str, int, str], int]:
    profile = cProfile.Profile()
    profile.enable()
    overhead.engine_loop(steps)
    profile.disable()
    return {key: value[1] for key, value in pstats.Stats(profile).stats.items()}  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    short, long = calls(args.steps), calls(2 * args.steps)
    per_step = {key: (n - short.get(key, 0)) / args.steps for key, n in long.items()}
    ours = {key: n for key, n in per_step.items() if "visiontrain" in key[0]}
    print(f"python calls per step: {sum(per_step.values()):.1f}; in visiontrain: {sum(ours.values()):.1f}")
    for (path, line, name), n in sorted(ours.items(), key=lambda item: -item[1]):
        if n >= 0.5:
            print(f"{n:6.2f}  {path.split('/src/')[-1]}:{line} {name}")


if __name__ == "__main__":
    main()
