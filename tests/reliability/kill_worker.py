"""Run by test_kill9.py: ``visiontrain fit RECIPE --run-dir DIR --resume auto`` of the toy recipe,
SIGKILLing itself at the moment SPEC names (what ``kill -9`` from outside does, at a moment that
can be chosen): the n-th training forward, evaluation (after its first batch), checkpoint file
write (part-way through the bytes), checkpoint rename (just before / just after it) or metrics
line (half written) of this process."""
from __future__ import annotations

import io
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))  # the toy task
import torch  # noqa: E402

torch.set_num_threads(1)
import toy_task  # noqa: E402  (registers the toy task and its config section)
from visiontrain.app import cli  # noqa: E402
from visiontrain.engine.records import run_log as run_logging  # noqa: E402

recipe, run_dir, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
phase, n = spec["phase"], spec.get("n", 0)
seen = 0


def due() -> bool:
    global seen
    seen += 1
    return seen == n


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


if phase == "step":
    losses = toy_task.ToyTask.losses
    toy_task.ToyTask.losses = lambda self, model, batch: die() if due() else losses(self, model, batch)
elif phase == "eval":
    evaluate = toy_task.ToyTask.evaluate

    def first_batch_then_die(loader):
        for batch in loader:
            yield batch
            die()

    toy_task.ToyTask.evaluate = lambda self, model, data: evaluate(
        self, model, data.over(first_batch_then_die(data.loader)) if due() else data)
elif phase == "save-write":
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if not due():
            return real_save(obj, f, *args, **kwargs)
        buf = io.BytesIO()
        real_save(obj, buf, *args, **kwargs)
        data = buf.getvalue()
        f.write(data[: int(len(data) * spec["fraction"])])
        f.flush()
        os.fsync(f.fileno())
        die()

    torch.save = save
elif phase in ("save-before-rename", "save-after-rename"):
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if str(dst).endswith(".pt") and due():
            if phase == "save-after-rename":
                real_replace(src, dst, *args, **kwargs)
            die()
        return real_replace(src, dst, *args, **kwargs)

    os.replace = replace
elif phase == "log":
    log = run_logging.RunLogger.log

    def half_a_line(self, kind, step, epoch, values):
        if self.enabled and due():
            line = json.dumps({"kind": kind, "step": step, "epoch": epoch, **values})
            self.write_row(line[: len(line) // 2])
            self._jsonl.flush()
            die()
        return log(self, kind, step, epoch, values)

    run_logging.RunLogger.log = half_a_line
elif phase != "none":
    raise SystemExit(f"unknown phase {phase!r}")

sys.exit(cli.main(["fit", recipe, "--run-dir", run_dir, "--resume", "auto"]))
