"""Files that cannot be written: a run dir on a read-only file system (an archived or shared copy),
a disk that fills while metrics.jsonl is written, an export whose file cannot be written. Each is
one line naming the file, why in plain words and what to do, exit code 2; nothing is lost, and
`report --out` still reports a run it cannot write to."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import build_once
from procs import cli_here
from toy_task import toy_config
from visiontrain.app import cli
from visiontrain.core import config as C
from visiontrain.engine.records import run_log as logging_module
from visiontrain.rundir.metrics_file import METRICS_FILE
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.engine.state.checkpoint import load_checkpoint

# A finished digits run (4 steps) whose files are then made unwritable; its subject is the files, so
# the run is as small as the bad-input catalogue's (and, as that one, draws no figures at its end).
DIGITS = ["data.name=digits", "data.limit_train=64", "data.limit_val=32", "data.batch_size=16",
          "trainer.epochs=1", "trainer.progress=plain", "trainer.plots=false"]


def digest(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("visiontrain: error: ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def namespaces_available() -> bool:
    """A user and mount namespace of one's own (no root needed): where a bind mount can be read-only."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    return probe.returncode == 0


def read_only(directory: Path, *args: str) -> subprocess.CompletedProcess:
    """``visiontrain ARGS`` with ``directory`` mounted read-only over itself, seen by this command
    alone (its own mount namespace): a read-only file system, EROFS, for root too, where chmod
    would not stop root."""
    script = 'mount --bind -o ro "$0" "$0" && exec "$@"'
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, str(directory),
                           sys.executable, "-m", "visiontrain", *args], capture_output=True, text=True, env=env,
                          timeout=600)


# Runs each command line of argv[1] (a JSON list) through visiontrain.app.cli.main in this one process,
# file descriptors 1 and 2 caught per command (what a C++ library prints too; an uncaught error's
# traceback, exit 1, as a process of its own would end), and prints [[code, stdout, stderr], ...].
COMMANDS_IN_ONE_PROCESS = """
import json, os, sys, tempfile, traceback
from visiontrain.app import cli
results = []
for argv in json.loads(sys.argv[1]):
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            code = cli.main(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        out.seek(0)
        err.seek(0)
        results.append([code, out.read().decode(), err.read().decode()])
print(json.dumps(results))
"""


def read_only_commands(directory: Path, *commands: list[str]) -> list[subprocess.CompletedProcess]:
    """Each of ``commands`` (``visiontrain`` argument lists) with ``directory`` mounted read-only, as
    ``read_only`` runs one, but all in one process: a start-up of 5-9 s each saved. Their subject is
    the message and the exit code of each command; ``read_only`` keeps one through the real entry point
    (test_resume_auto_in_a_read_only_run_dir_of_an_attempt_without_checkpoint)."""
    script = 'mount --bind -o ro "$0" "$0" && exec "$@"'
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, str(directory),
                           sys.executable, "-c", COMMANDS_IN_ONE_PROCESS, json.dumps(commands)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [subprocess.CompletedProcess(["visiontrain", *args], code, out, err)
            for args, (code, out, err) in zip(commands, json.loads(proc.stdout.splitlines()[-1]), strict=True)]


@pytest.fixture(scope="module")
def digits_run(shared_dir: Path) -> Path:
    """Trained once a session (tests/reliability/test_bad_input.py trains the same command line); the
    tests copy it before they change it."""
    def fit(out: Path) -> None:
        # in this process: no DataLoader workers to start (data.num_workers 0)
        proc = cli_here("fit", "classify-fashion", *DIGITS, "--run-dir", str(out / "run"))
        assert proc.returncode == 0, proc.stderr[-3000:]

    return build_once(shared_dir, f"digits-run-{hashlib.sha256(' '.join(DIGITS).encode()).hexdigest()[:12]}",
                      fit) / "run"


@pytest.mark.skipif(not namespaces_available(), reason="needs unshare with user namespaces (a read-only mount)")
def test_a_read_only_run_dir_is_one_line_for_resume_report_and_export(digits_run: Path, tmp_path: Path) -> None:
    run = Path(shutil.copytree(digits_run, tmp_path / "run"))
    assert not (run / "plots").exists()  # a run without its curves (trainer.plots=false): the report draws them
    before = digest(run)
    last = run / "checkpoints" / "last.pt"
    elsewhere = tmp_path / "elsewhere" / "report.html"
    resume, report, report_elsewhere, export = read_only_commands(
        run, ["fit", "classify-fashion", *DIGITS, "trainer.epochs=2", "--run-dir", str(run), "--resume", "auto"],
        ["report", str(run)], ["report", str(run), "--out", str(elsewhere)], ["export", str(run), "--format", "onnx"])

    line = one_error_line(resume)
    assert line == (f"visiontrain: error: run dir {run} cannot be written: the file system is read-only ({run}); "
                    f"make it writable, or continue its run in another: --run-dir NEW --resume {last}")

    line = one_error_line(report)
    assert line == (f"visiontrain: error: could not write the report {run / 'report.html'}: the file system is "
                    f"read-only; pass --out FILE.html to write it elsewhere")
    assert report_elsewhere.returncode == 0, report_elsewhere.stderr[-3000:]
    result = json.loads(report_elsewhere.stdout.splitlines()[-1])
    assert result["report"] == str(elsewhere) and result["plots"] >= 3  # the curves, drawn outside the run dir
    assert "losses.png" in elsewhere.read_text()

    best = run / "checkpoints" / "best.onnx"
    line = one_error_line(export)
    assert line == (f"visiontrain: error: could not write the onnx file {best}: the file system is read-only; "
                    f"nothing was written (choose another --out)")
    assert digest(run) == before


@pytest.mark.skipif(not namespaces_available(), reason="needs unshare with user namespaces (a read-only mount)")
def test_resume_auto_in_a_read_only_run_dir_of_an_attempt_without_checkpoint(tmp_path: Path) -> None:
    """--resume auto moves such an attempt's files aside before starting afresh: it cannot here. Through
    the real entry point: the whole of stderr is the one line."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "epoch": 0, "total": 1.0}\n')
    proc = read_only(run, "fit", "classify-fashion", *DIGITS, "--run-dir", str(run), "--resume", "auto")
    line = one_error_line(proc)
    assert proc.stderr.strip().splitlines() == [line], proc.stderr[-3000:]
    assert line.startswith(f"visiontrain: error: run dir {run} cannot be written: the file system is read-only")
    assert line.endswith("--resume auto starts afresh there and sets the earlier attempt's files aside: make it "
                         "writable or choose another --run-dir")
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


@pytest.mark.parametrize("fmt, existed", [("onnx", False), ("torchscript", True)])
def test_an_export_that_cannot_be_written_says_why_and_leaves_the_file_as_it_was(digits_run: Path, tmp_path: Path,
                                                                                  fmt: str, existed: bool) -> None:
    """A real failed write: a 4 kB file-size limit (EFBIG, as a full disk gives ENOSPC). It was
    'cannot export to onnx: see the message: OSError: ...', and a torch file writer that aborts the
    process (exit 134) as it is destroyed."""
    out = tmp_path / "exported" / f"model.{fmt}"
    if existed:
        out.parent.mkdir()
        out.write_bytes(b"an earlier export")

    def small_files_only() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    proc = subprocess.run([sys.executable, "-m", "visiontrain", "export", str(digits_run), "--format", fmt,
                           "--out", str(out)], capture_output=True, text=True, preexec_fn=small_files_only,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    kept = f"{out} is as it was" if existed else "nothing was written"
    assert one_error_line(proc).startswith(
        f"visiontrain: error: could not write the {fmt} file {out}: the file would exceed the file-size limit "
        f"(ulimit -f) (")
    assert one_error_line(proc).endswith(f"; {kept} (choose another --out)")
    assert sorted(p.name for p in out.parent.iterdir()) == ([out.name] if existed else [])
    assert not existed or out.read_bytes() == b"an earlier export"


class FillingDisk:
    """metrics.jsonl on a disk that fills up: the ``full_after``-th line is cut short by ENOSPC."""

    def __init__(self, file, full_after: int) -> None:
        self.file, self.name, self.left = file, file.name, full_after

    def write(self, text: str) -> int:
        self.left -= 1
        if self.left <= 0:
            self.file.write(text[: len(text) // 2])
            self.file.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.file.write(text)

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def test_a_full_disk_while_writing_metrics_names_the_file_and_resume_goes_on(tmp_path: Path, monkeypatch,
                                                                              capsys) -> None:
    """The 4th row of the toy run (train at step 12) meets a full disk: one line naming metrics.jsonl
    (was an OSError traceback, exit 1); last.pt (step 10) is intact, and --resume auto, once there is
    room, logs every row once."""
    recipe = tmp_path / "toy.yaml"
    recipe.write_text(C.dump_config(toy_config(checkpoint__every=5, checkpoint__unit="steps")))
    run = tmp_path / "run"
    real_open = open
    monkeypatch.setattr(logging_module, "open", lambda *a, **kw: FillingDisk(real_open(*a, **kw), 4), raising=False)
    capsys.readouterr()
    assert cli.main(["fit", str(recipe), "--run-dir", str(run)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err == (f"visiontrain: error: could not write {run / METRICS_FILE}: the disk is full ("
                   f"{err.split('the disk is full (', 1)[1].split(')', 1)[0]}); the checkpoints written before are "
                   f"intact (a line cut short is dropped when the run resumes): continue with --resume auto once "
                   f"it can be written")
    assert fmt.step_of(load_checkpoint(run / "checkpoints" / "last.pt")) == 10

    monkeypatch.undo()
    assert cli.main(["fit", str(recipe), "--run-dir", str(run), "--resume", "auto"]) == 0
    rows = [(r["kind"], r["step"]) for r in map(json.loads, (run / METRICS_FILE).read_text().splitlines())]
    assert rows == [("train", 4), ("train", 8), ("eval", 8), ("train", 12), ("train", 16), ("eval", 16)]
