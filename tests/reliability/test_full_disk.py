"""A real full disk: a small tmpfs the test mounts when it runs as root (CI and the dev machine do);
elsewhere a 4 kB file-size limit (RLIMIT_FSIZE), where the system's words are "File too large"
and the "No space left on device" wording is not checked. Each write of a run (a checkpoint,
metrics.jsonl, the run's own files) names the file, says "No space left on device" and the free
space, and leaves what was written before as it was."""
from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

from toy_task import toy_config
from visiontrain.core import config as C
from visiontrain.engine.records.run_log import RunLogger
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.engine.state import files as files_module
from visiontrain.engine.state.checkpoint import CheckpointError, atomic_save, load_checkpoint, write_run_file
from visiontrain.rundir.write_failure import WriteError

WORKER = Path(__file__).parent / "kill_worker.py"
FULL = r"the disk is full \(No space left on device; \d+ MiB free on that file system\)"
LIMIT_BYTES = 4096


@contextlib.contextmanager
def small_disk(directory: Path, size: str) -> Iterator[bool]:
    """``directory`` as a tmpfs of ``size`` (True), or as a plain directory (False) where mounting is
    not allowed (not root, or no CAP_SYS_ADMIN in a container)."""
    directory.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", str(directory)], check=True)


@contextlib.contextmanager
def no_room(directory: Path, mounted: bool) -> Iterator[None]:
    """The disk under ``directory`` filled to its last byte (a tmpfs), or, unmounted, no file of this
    process may grow past 4 kB while inside."""
    if mounted:
        with open(directory / "filler", "wb", buffering=0) as filler:
            for chunk in (65536, 4096, 1):  # to the last byte
                with contextlib.suppress(OSError):
                    while filler.write(b"\0" * chunk):
                        pass
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT_BYTES, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def says_why(message: str, mounted: bool) -> bool:
    if mounted:
        return re.search(FULL, message) is not None
    return "the file would exceed the file-size limit (ulimit -f) (File too large" in message


def test_a_checkpoint_write_on_a_full_disk_says_no_space_left_on_device(tmp_path: Path) -> None:
    """Was "the disk is full (0 MiB free ...)" without the system's words a user searches for."""
    with small_disk(tmp_path / "disk", "512k") as mounted:
        target = tmp_path / "disk" / "checkpoints" / "last.pt"
        atomic_save({"step": torch.tensor(1)}, target)  # the previous last.pt, a small one
        with no_room(tmp_path / "disk", mounted), pytest.raises(CheckpointError) as info:
            atomic_save({"weights": torch.zeros(200_000)}, target)
        message = str(info.value)
        assert message.startswith(f"could not write checkpoint {target}: ") and says_why(message, mounted), message
        assert message.endswith("the previous last.pt is intact, and nothing of this write was left behind")
        assert int(torch.load(target, weights_only=True)["step"]) == 1
        assert sorted(p.name for p in target.parent.iterdir()) == ["last.pt"]


def test_a_write_error_torch_drops_is_still_named(tmp_path: Path, monkeypatch) -> None:
    """torch's zip writer reports a failed write as its own RuntimeError ("unexpected pos 563520 vs
    563412"), which need not carry the OSError behind it: the file object torch.save writes into
    keeps that error, and the message gives its words, not torch's."""
    real_save = torch.save

    def save_as_torch_may(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer)
        try:
            f.write(buffer.getvalue())
        except OSError:
            pass  # what torch's C++ writer may do with the error of a write: keep only the position
        raise RuntimeError(f"[enforce fail at inline_container.cc:672] . unexpected pos {len(buffer.getvalue())} "
                           f"vs 0")

    monkeypatch.setattr(files_module.torch, "save", save_as_torch_may)
    with small_disk(tmp_path / "disk", "256k") as mounted:
        target = tmp_path / "disk" / "last.pt"
        with no_room(tmp_path / "disk", mounted), pytest.raises(CheckpointError) as info:
            atomic_save({"weights": torch.zeros(200_000)}, target)
    assert "unexpected pos" not in str(info.value) and says_why(str(info.value), mounted), str(info.value)


def test_metrics_and_run_files_on_a_full_disk_name_the_file_and_say_no_space_left(tmp_path: Path) -> None:
    """metrics.jsonl and the run's own files (summary.json, config.yaml) on a real full disk: one
    line each naming the file; the rows written before stay whole."""
    with small_disk(tmp_path / "disk", "256k") as mounted:
        run = tmp_path / "disk" / "run"
        run.mkdir()
        log = RunLogger(run, total_steps=10, progress="plain")
        log.write_row(json.dumps({"kind": "train", "step": 1}) + "\n")
        write_run_file(run, "summary.json", "{}")
        padding = "x" * LIMIT_BYTES  # past the file-size limit, where the disk is not a tmpfs
        with no_room(tmp_path / "disk", mounted):
            with pytest.raises(WriteError) as metrics:
                log.write_row(json.dumps({"kind": "train", "step": 2, "pad": padding}) + "\n")
            with pytest.raises(CheckpointError) as summary:
                write_run_file(run, "summary.json", json.dumps({"steps": 2, "pad": padding}))
        log.close()
        assert str(metrics.value).startswith(f"could not write {run / 'metrics.jsonl'}: ")
        assert str(summary.value).startswith(f"run dir {run} cannot be written: ")
        assert f"({run / 'summary.json'})" in str(summary.value)
        for error in (metrics.value, summary.value):
            assert says_why(str(error), mounted) and "\n" not in str(error), str(error)
        assert (run / "metrics.jsonl").read_text().splitlines()[0] == '{"kind": "train", "step": 1}'
        assert (run / "summary.json").read_text() == "{}"


def test_a_run_whose_disk_fills_up_exits_2_in_one_line_and_its_last_checkpoint_loads(tmp_path: Path) -> None:
    """`visiontrain fit` with its run dir on a 300 kB tmpfs: a checkpoint every step and a kept copy
    of each fill it within a few steps. Exit 2, one line (no traceback), and the last.pt left behind
    loads."""
    recipe = tmp_path / "toy.yaml"
    recipe.write_text(C.dump_config(toy_config(trainer__max_steps=40, checkpoint__every=1, checkpoint__unit="steps",
                                               checkpoint__keep_every=1, trainer__log_every=1)))
    with small_disk(tmp_path / "disk", "300k") as mounted:
        if not mounted:
            pytest.skip("mounting a tmpfs needs root; test_faults.py fills a file-size limit instead")
        run = tmp_path / "disk" / "run"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, str(WORKER), str(recipe), str(run), json.dumps({"phase": "none"})],
                              capture_output=True, text=True, env=env, timeout=300)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("visiontrain: error:")]
        assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert re.search(rf"could not write .*{FULL}", errors[0]), errors[0]
        assert fmt.step_of(load_checkpoint(run / "checkpoints" / "last.pt")) >= 1
        assert not list(run.rglob(".*.tmp"))


def test_the_plain_reason_keeps_the_system_words_for_every_space_error() -> None:
    from visiontrain.rundir.write_failure import why_not_written

    for code, plain in ((errno.ENOSPC, "the disk is full"), (errno.EDQUOT, "the disk quota is used up")):
        reason = why_not_written(OSError(code, os.strerror(code)), Path("/"))
        assert reason.startswith(f"{plain} ({os.strerror(code)}; "), reason
