"""A downloaded run dir whose .pt file names a sharded directory: the directory's .metadata is read
with DCP's own classes only, and the name reaches nothing but a step-S.dcp beside the .pt file
(engine/state/dcp_reader.py, engine/state/sharded.py: dcp_path)."""
from __future__ import annotations

import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch

from procs import cli_here
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.engine.state.checkpoint import atomic_save, load_checkpoint
from visiontrain.engine.state.files import CheckpointError


class _RunsCode:
    """What an attacker pickles: unpickling it calls os.system."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def sharded_run(tmp_path: Path, name: str = "step-4.dcp") -> Path:
    """checkpoints/last.pt (plain dicts: it passes the weights_only load) naming a real DCP directory."""
    from torch.distributed import checkpoint as dcp

    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    with warnings.catch_warnings():  # "torch.distributed is disabled ... in a single process": meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {"weight": torch.arange(6.0).reshape(2, 3)}}, checkpoint_id=ckpts / "step-4.dcp",
                 no_dist=True)
    atomic_save({fmt.FORMAT: fmt.FORMAT_VERSION,
                 fmt.WEIGHTS: {fmt.SHARDED: {"dir": name, "param_groups": [], "optimizer": False}}},
                ckpts / "last.pt")
    return ckpts / "last.pt"


def test_real_metadata_loads_and_pickled_code_in_it_is_refused_without_running(tmp_path, capfd):
    pt = sharded_run(tmp_path)
    assert torch.equal(fmt.model_weights(load_checkpoint(pt))["weight"], torch.arange(6.0).reshape(2, 3))

    marker = tmp_path / "ran"
    (pt.parent / "step-4.dcp" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata: refers to posix\.system, which DCP metadata never holds"):
        load_checkpoint(pt)
    export = ["export", str(pt), "--format", "onnx", "--out", str(tmp_path / "m.onnx")]
    for command in (export, ["consolidate", str(pt)]):
        done = cli_here(*command, capture=capfd)
        errors = [line for line in done.stderr.splitlines() if line.startswith("visiontrain: error:")]
        assert done.returncode == 2 and len(errors) == 1 and "posix.system" in errors[0], done.stderr[-2000:]
        assert "Traceback" not in done.stderr
    assert not marker.exists()

    (pt.parent / "step-4.dcp" / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match="metadata .* cannot be read"):
        load_checkpoint(pt)


@pytest.mark.parametrize("name", ["../elsewhere.dcp", "/etc", "step-4.dcp/../../x", 7])
def test_a_sharded_directory_named_outside_the_checkpoints_is_refused(tmp_path, name):
    pt = sharded_run(tmp_path, name=name)
    with pytest.raises(CheckpointError, match=r"names .* as its sharded directory; expected a name like step-120\.dcp"):
        load_checkpoint(pt)
