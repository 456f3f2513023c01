"""A run's last.pt lost or damaged: `--resume auto` continues from the newest checkpoint that loads
(step-S.pt, best.pt: each holds the whole state), in one line naming the broken file, why, and what
it continues from, and keeps the damaged file under another name. Every kind of damage (empty,
cut short, zero-filled, random bytes, over the whole file or a range of it) is one line saying the
file is truncated or corrupt: never a traceback, torch's advice to load with weights_only=False,
or "holds objects other than tensors"."""
from __future__ import annotations

import random
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from toy_task import toy_config, train
from visiontrain.app import cli
from visiontrain.core import config as C
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.engine.state.checkpoint import CheckpointError, atomic_save, load_checkpoint, read_checkpoint_file
from visiontrain.engine.state import run_dir as run_dir_module

# 256 samples / 32 = 8 steps per epoch; the run stops at 6: last.pt, step-2/4/6.pt and best.pt (step 6)
SETTINGS = dict(checkpoint__every=2, checkpoint__unit="steps", checkpoint__keep_every=2)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("finished") / "run"
    train(toy_config(trainer__max_steps=6, **SETTINGS), run)
    return run


@pytest.fixture
def run(finished_run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


def recipe(tmp_path: Path, max_steps: int) -> str:
    path = tmp_path / f"toy-{max_steps}.yaml"
    path.write_text(C.dump_config(toy_config(trainer__max_steps=max_steps, **SETTINGS)))
    return str(path)


def damaged(data: bytes, kind: str, rng: random.Random) -> bytes:
    start = rng.randrange(0, len(data) - 1)
    length = rng.randrange(1, min(4096, len(data) - start) + 1)
    return {
        "empty": lambda: b"",
        "truncated": lambda: data[:rng.randrange(1, len(data))],
        "zero-filled": lambda: bytes(len(data)),
        "zeroed range": lambda: data[:start] + bytes(length) + data[start + length:],
        "random bytes": lambda: rng.randbytes(len(data)),
        "random range": lambda: data[:start] + rng.randbytes(length) + data[start + length:],
    }[kind]()


KINDS = ["empty", "truncated", "zero-filled", "zeroed range", "random bytes", "random range"]


def says_corrupt(err: CheckpointError, path: Path) -> None:
    text = str(err)
    assert str(path) in text and "\n" not in text, text
    assert "truncated" in text or "corrupt" in text, text
    assert "weights_only=False" not in text and "weights_only set to False" not in text, text
    assert "other than tensors" not in text, text


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("kind", KINDS)
def test_every_damage_is_one_line_saying_truncated_or_corrupt(finished_run: Path, tmp_path: Path,
                                                              kind: str) -> None:
    """50 seeds of each kind. A load that fails says the file is truncated or corrupt (was, for a
    zeroed or random range in the pickle, "holds objects other than tensors", and for a zero-filled
    file "neither the zip archive nor the pickle", with torch's warnings on stderr). With ``verify``
    (what a resume reads with) a file whose tensors were changed fails too: only damage to bytes
    nothing reads (a zip header's date) may load, and then it loads the same state."""
    original = (finished_run / "checkpoints" / "step-6.pt").read_bytes()
    whole = read_checkpoint_file(finished_run / "checkpoints" / "step-6.pt")
    path = tmp_path / "last.pt"
    for seed in range(50):
        path.write_bytes(damaged(original, kind, random.Random(seed)))
        for verify in (False, True):
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                try:
                    loaded = read_checkpoint_file(path, verify=verify)
                except CheckpointError as err:
                    says_corrupt(err, path)
                    assert not said, [str(w.message) for w in said]  # the line says it all
                    break
            assert not verify or same(loaded, whole), f"seed {seed}: damaged bytes loaded as another state"


def test_resume_auto_without_last_pt_continues_from_the_newest_checkpoint(run: Path, tmp_path: Path,
                                                                          capsys) -> None:
    """A finished run whose last.pt is gone: was the whole run dir moved aside and training from step
    0; now it continues from step-6.pt, byte-identical to the lost file, and has nothing to train."""
    (run / "checkpoints" / "last.pt").unlink()
    before = sorted(p.name for p in run.iterdir())
    capsys.readouterr()
    assert cli.main(["fit", recipe(tmp_path, 6), "--run-dir", str(run), "--resume", "auto"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("visiontrain:")]
    last = run / "checkpoints"
    assert notes == [f"visiontrain: {last / 'last.pt'} is missing; continuing from {last / 'step-6.pt'} (step 6), "
                     f"the newest checkpoint that loads"]
    assert sorted(p.name for p in run.iterdir()) == before  # nothing set aside


@pytest.mark.parametrize("kind", KINDS)
def test_resume_auto_with_a_damaged_last_pt_continues_exactly_and_keeps_it(run: Path, tmp_path: Path,
                                                                           capsys, kind: str) -> None:
    """The damaged last.pt (step 6) is kept as last.pt.broken-<time>; the run goes on from step-6.pt
    to step 8 with the weights of a run never interrupted."""
    last = run / "checkpoints" / "last.pt"
    rng = random.Random(7)
    bad = damaged(last.read_bytes(), kind, rng)
    while kind.endswith("range") and not _fails(bad, tmp_path):  # a range nothing reads: draw another
        bad = damaged(last.read_bytes(), kind, rng)
    last.write_bytes(bad)
    capsys.readouterr()
    assert cli.main(["fit", recipe(tmp_path, 8), "--run-dir", str(run), "--resume", "auto"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("visiontrain:")]
    kept = list(last.parent.glob("last.pt.broken-*"))
    assert len(notes) == 1 and len(kept) == 1 and kept[0].read_bytes() == bad, notes
    assert notes[0].startswith(f"visiontrain: ") and str(last) in notes[0] and f"(kept as {kept[0].name})" in notes[0]
    assert ("truncated" in notes[0] or "corrupt" in notes[0]) and notes[0].endswith(
        f"; continuing from {last.parent / 'step-6.pt'} (step 6), the newest checkpoint that loads")
    whole = train(toy_config(trainer__max_steps=8, **SETTINGS), tmp_path / "whole")
    assert same(fmt.model_weights(load_checkpoint(last)), whole.run.raw_model.state_dict())
    assert fmt.step_of(load_checkpoint(last)) == 8


def _fails(data: bytes, tmp_path: Path) -> bool:
    path = tmp_path / "probe.pt"
    path.write_bytes(data)
    try:
        run_dir_module.resumable_step(path)
    except CheckpointError:
        return True
    return False


def test_resume_auto_with_no_checkpoint_that_loads_sets_the_attempt_aside(run: Path, tmp_path: Path,
                                                                          capsys) -> None:
    """Every checkpoint damaged: the earlier behaviour for an attempt without a checkpoint (its files
    set aside, a new run) with the damaged last.pt among them. Was: a resume from it, refused."""
    for pt in (run / "checkpoints").glob("*.pt"):
        pt.write_bytes(pt.read_bytes()[:100])
    capsys.readouterr()
    assert cli.main(["fit", recipe(tmp_path, 2), "--run-dir", str(run), "--resume", "auto"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("visiontrain:")]
    aside = next(run.glob("attempt-without-checkpoint-*"))
    assert len(notes) == 1 and "last.pt is truncated or corrupt" in notes[0] and "no other checkpoint loads: " \
        "starting a new run" in notes[0] and str(aside) in notes[0], notes
    assert len((aside / "checkpoints" / "last.pt").read_bytes()) == 100
    assert fmt.step_of(load_checkpoint(run / "checkpoints" / "last.pt")) == 2


def test_resume_path_to_a_damaged_file_names_the_checkpoints_that_load(run: Path, tmp_path: Path, capsys) -> None:
    """`--resume RUN/checkpoints/last.pt`, damaged: exit 2, one line with the reason and the run's
    checkpoints that load; nothing is written or moved."""
    last = run / "checkpoints" / "last.pt"
    data = last.read_bytes()
    last.write_bytes(data[:len(data) // 2])
    capsys.readouterr()
    new_dir = tmp_path / "new"
    code = cli.main(["fit", recipe(tmp_path, 8), "--run-dir", str(new_dir), "--resume", str(last)])
    err = capsys.readouterr().err.strip()
    ckpts = run / "checkpoints"
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"visiontrain: error: checkpoint {last} is truncated or corrupt: ")
    assert err.endswith(f"; the newest checkpoints of that run that load: {ckpts / 'step-6.pt'} (step 6), "
                        f"{ckpts / 'best.pt'} (step 6), {ckpts / 'step-4.pt'} (step 4): pass one to --resume")
    assert not new_dir.exists() and len(last.read_bytes()) == len(data) // 2


def test_a_sharded_step_file_is_resumable_only_with_its_directory_of_shards(run: Path) -> None:
    """An FSDP run's .pt files name their step-S.dcp directory: a step-S.pt is a place to continue
    from while that directory is whole (its .metadata written last), and not without it."""
    ckpts = run / "checkpoints"
    state = load_checkpoint(ckpts / "step-6.pt")
    state[fmt.WEIGHTS] = {fmt.SHARDED: {"dir": "step-6.dcp", "optimizer": True, "param_groups": []},
                          fmt.EMA: None, fmt.STRATEGY: fmt.FSDP}
    atomic_save(state, ckpts / "step-6.pt")
    with pytest.raises(CheckpointError, match=r"step-6\.dcp is missing or incomplete"):
        run_dir_module.resumable_step(ckpts / "step-6.pt")
    assert [p.name for _, p in run_dir_module.resumable_checkpoints(ckpts, skip=ckpts / "last.pt")] == ["best.pt"]
    (ckpts / "step-6.dcp").mkdir()
    (ckpts / "step-6.dcp" / ".metadata").write_bytes(b"")
    assert run_dir_module.resumable_step(ckpts / "step-6.pt") == 6
    assert [p.name for _, p in run_dir_module.resumable_checkpoints(ckpts, skip=ckpts / "last.pt")] == ["step-6.pt"]
