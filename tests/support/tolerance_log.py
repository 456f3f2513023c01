"""What each float tolerance of the suite had to absorb on this machine: a log to set tolerances from.

With ``VISIONTRAIN_TOLERANCE_LOG=FILE`` set, every ``pytest.approx`` comparison, every
``torch.testing.assert_close``, ``torch.allclose``, ``numpy.allclose`` and
``numpy.testing.assert_allclose`` made by a test appends one JSON line to FILE: the test file and line
that asked, the largest absolute difference seen there and the tolerance allowed. Run the suite once
per kind of CPU (or per kernel set: ``ATEN_CPU_CAPABILITY=avx2``, ``=default``, ``=avx512``) and
compare with ``python tests/support/tolerance_log.py LOG...``: each site's largest difference on each, against
its tolerance. A tolerance is chosen from that spread (docs/testing.md says how).
"""
from __future__ import annotations

import json
import math
import os
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

TESTS = str(Path(__file__).resolve().parents[1])
_lock = threading.Lock()


def _site() -> str | None:
    """The test-file line that made the comparison (the innermost frame under tests/)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(TESTS) and not name.endswith("tolerance_log.py"):
            return f"{Path(name).name}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _write(path: str, diff: float, atol: float, rtol: float, scale: float) -> None:
    site = _site()
    if site is None or not math.isfinite(diff):
        return
    row = {"site": site, "diff": diff, "allowed": atol + rtol * scale, "atol": atol, "rtol": rtol,
           "capability": os.environ.get("ATEN_CPU_CAPABILITY", "native")}
    with _lock, open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _tensor_diff(actual: Any, expected: Any) -> tuple[float, float]:
    import torch

    a, e = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    if a.numel() == 0 or e.numel() == 0:
        return 0.0, 0.0
    a, e = torch.broadcast_tensors(a, e)
    both = torch.isfinite(a) & torch.isfinite(e)
    if not both.any():
        return 0.0, 0.0
    return (a - e)[both].abs().max().item(), e[both].abs().max().item()


def install(path: str) -> None:
    """Wraps the comparisons above so that each also logs what it saw; their results are unchanged."""
    import numpy as np
    import torch
    from _pytest.approx import ApproxScalar

    scalar_eq = ApproxScalar.__eq__

    def approx_eq(self: ApproxScalar, actual: Any) -> bool:
        try:
            _write(path, abs(float(actual) - float(self.expected)), float(self.tolerance), 0.0, 0.0)
        except (TypeError, ValueError, OverflowError):
            pass
        return scalar_eq(self, actual)

    ApproxScalar.__eq__ = approx_eq

    def logged(fn: Callable, atol_default: float, rtol_default: float, *, testing: bool) -> Callable:
        def wrapper(actual: Any, expected: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                if testing and kwargs.get("atol") is None:
                    from torch.testing._comparison import default_tolerances

                    rtol, atol = default_tolerances(torch.as_tensor(actual), torch.as_tensor(expected))
                else:
                    rtol = kwargs.get("rtol", args[0] if args else rtol_default)
                    atol = kwargs.get("atol", args[1] if len(args) > 1 else atol_default)
                diff, scale = _tensor_diff(actual, expected)
                _write(path, diff, float(atol), float(rtol), scale)
            except Exception:  # a comparison of non-numbers: the wrapped call says what is wrong
                pass
            return fn(actual, expected, *args, **kwargs)
        return wrapper

    torch.testing.assert_close = logged(torch.testing.assert_close, 0.0, 0.0, testing=True)
    torch.allclose = logged(torch.allclose, 1e-8, 1e-5, testing=False)
    np.allclose = logged(np.allclose, 1e-8, 1e-5, testing=False)
    np.testing.assert_allclose = logged(np.testing.assert_allclose, 0.0, 1e-7, testing=False)


def summarize(paths: list[str]) -> list[str]:
    """One line a site: under each capability the largest share of its tolerance a comparison used
    (difference / allowed) and the largest difference, the sites nearest their tolerance first."""
    used: dict[str, dict[str, float]] = defaultdict(dict)
    diff: dict[str, dict[str, float]] = defaultdict(dict)
    for path in paths:
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            cap, site = row["capability"], row["site"]
            share = row["diff"] / row["allowed"] if row["allowed"] > 0 else (math.inf if row["diff"] else 0.0)
            used[site][cap] = max(used[site].get(cap, 0.0), share)
            diff[site][cap] = max(diff[site].get(cap, 0.0), row["diff"])
    caps = sorted({c for by in used.values() for c in by})
    lines = [f"{'site':40} " + " ".join(f"{c + ' used':>13} {c + ' diff':>13}" for c in caps)]
    for site in sorted(used, key=lambda s: -max(used[s].values())):
        cells = " ".join(f"{used[site][c]:13.2g} {diff[site][c]:13.2g}" if c in used[site] else f"{'-':>13} {'-':>13}"
                         for c in caps)
        lines.append(f"{site:40} {cells}")
    return lines


if __name__ == "__main__":
    print("\n".join(summarize(sys.argv[1:])))
