"""Counting a training step's host reads: every Tensor method that reads a value to the host,
patched while a window of steps runs, and on CUDA every synchronizing call CUDA itself reports
(tests/engine/test_host_syncs.py; the detector and DINO tests run their steps through it too)."""
from __future__ import annotations

import contextlib
import traceback
import warnings
from pathlib import Path
from typing import Iterator

import pytest
import torch

from devices import ON_CUDA
from visiontrain.engine.loop.trainer import next_micro_batches
from visiontrain.engine.protocols.hooks import Hook

SYNC_WARNING = "called a synchronizing CUDA operation"


REPO = str(Path(__file__).resolve().parents[2]) + "/"


def short_path(filename: str) -> str:
    """A frame's file as a package path (torchvision/ops/boxes.py) or a repository path (src/...)."""
    return filename.rsplit("site-packages/", 1)[-1].removeprefix(REPO)



READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__",
         "__repr__", "__format__")


class ReadCounter:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.active, self.calls = False, []
        for name in READS:
            original = getattr(torch.Tensor, name)

            def wrapper(t, *args, _name=name, _orig=original, **kwargs):
                if self.active:
                    import traceback

                    self.calls.append((_name, "".join(traceback.format_stack(limit=6)[:-1])))
                return _orig(t, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, wrapper)


class CudaSyncs:
    """On CUDA, the synchronizing calls made while on (``torch.cuda.set_sync_debug_mode``), each as
    the Python frames that made it. The mode is "warn", not "error": an error would stop at the
    first sync and name only that one, the warnings list them all (ops in the backward pass are
    reported at their ``backward()`` call); the tests then require the list to be empty, or to
    name only a sync the code marks as intended."""

    def __init__(self) -> None:
        self.sites: list[str] = []

    def on(self) -> None:
        if ON_CUDA:
            torch.cuda.set_sync_debug_mode("warn")

    def off(self) -> None:
        if ON_CUDA:
            torch.cuda.set_sync_debug_mode("default")

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        with warnings.catch_warnings():
            warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")
            shown = warnings.showwarning

            def show(message, category, filename, lineno, file=None, line=None):
                if SYNC_WARNING not in str(message):
                    return shown(message, category, filename, lineno, file, line)
                frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
                self.sites.append(" <- ".join(f"{short_path(f.filename)}:{f.lineno} {f.name}"
                                              for f in reversed(frames[-5:])))

            warnings.showwarning = show
            try:
                yield
            finally:
                self.off()


def sync_report(sites: list[str]) -> str:
    """The synchronizing calls by place, most frequent first (a failure names each place once)."""
    from collections import Counter

    places = Counter(" <- ".join(site.split(" <- ")[:3]) for site in sites)
    return f"{len(sites)} synchronizing CUDA calls:\n" + "\n".join(f"{n:4d} x {place}" for place, n in places.most_common())


class Window(Hook):
    """Counts from the first step's start to the end of step ``steps`` (the log point comes after)."""

    def __init__(self, counter: ReadCounter, syncs: CudaSyncs, steps: int = 50) -> None:
        self.counter, self.syncs, self.steps = counter, syncs, steps

    def before_step(self) -> None:
        if self.trainer.step == 0:
            self.counter.active = True
            self.syncs.on()

    def after_step(self) -> None:
        if self.trainer.step == self.steps:
            self.counter.active = False
            self.syncs.off()


def run_counted(trainer_cls, cfg, task, monkeypatch, steps: int = 50) -> ReadCounter:
    """The Tensor reads of steps 1..``steps`` (``.calls``) and, on CUDA, their synchronizing CUDA
    calls (``.syncs``: empty on the CPU)."""
    counter, syncs = ReadCounter(monkeypatch), CudaSyncs()

    def fetch_uncounted(*args):  # loading is host work by nature: the seam the trainer gives
        active, counter.active = counter.active, False
        try:
            return next_micro_batches(*args)
        finally:
            counter.active = active

    trainer = trainer_cls(cfg, task, None, hooks=[Window(counter, syncs, steps)], fetch=fetch_uncounted)
    assert trainer.device.type == ("cuda" if ON_CUDA else "cpu")
    with syncs.recording():
        trainer.fit()
    assert trainer.step >= steps
    counter.syncs = syncs.sites
    return counter


ALL_ON = ["trainer.log_every=50", "trainer.max_steps=60", "trainer.accum_steps=2", "trainer.clip_grad=1.0",
          "trainer.precision=bf16", "trainer.nonfinite=skip", "ema.enabled=true", "ema.warmup=true",
          "eval.every=0", "checkpoint.every=0", "trainer.progress=plain"]


def count_reads(monkeypatch) -> dict[str, int]:
    """Counts every tensor method that reads a value to the host, until ``monkeypatch.undo()``."""
    calls: dict[str, int] = dict.fromkeys(READS, 0)
    for name in READS:
        original = getattr(torch.Tensor, name)

        def wrapper(t, *a, _name=name, _orig=original, **k):
            calls[_name] += 1
            return _orig(t, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, wrapper)
    return calls
