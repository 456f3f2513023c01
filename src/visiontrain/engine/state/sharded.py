"""FSDP2's sharded checkpoints (``distributed.strategy=fsdp``).

Checkpoints. Model, EMA and optimizer tensors go through torch.distributed.checkpoint: every rank
writes its own shards into ``step-S.dcp/``, first as a hidden ``.tmp`` directory that rank 0
renames once complete. The ``.pt`` files (last.pt, best.pt, ...) stay what they always are:
the rest of the state, written atomically by rank 0, plus the name of their ``.dcp`` directory.
A crash at any moment leaves every ``.pt`` naming a complete directory; directories no ``.pt``
names any more are deleted after each save. Only tensors go into a DCP directory, because
torch.distributed.checkpoint unpickles other items without ``weights_only``: the optimizer's
hyper-parameters stay in the ``.pt`` file, and a full load refuses a directory with anything else.
"""
from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from visiontrain.engine.parallel.distributed import DistInfo, broadcast_object
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.engine.state.files import CheckpointError, read_checkpoint_file

DCP_DIR = re.compile(r"^step-\d+(-\d+)?\.dcp$")


class ShardedCheckpoints:
    """The ``step-S.dcp`` directories of one checkpoints directory."""

    def __init__(self, ckpt_dir: Path | None, info: DistInfo) -> None:
        self.dir, self.info = ckpt_dir, info
        self._written: tuple[int, str] | None = None  # (step, directory) of the last save

    def _free_name(self, step: int) -> str:
        """``step-S.dcp``, or ``step-S-K.dcp`` when a run resumed from before S wrote S again: an
        existing directory is never replaced, since a ``.pt`` file may still name it."""
        name, k = f"step-{step}.dcp", 1
        while (self.dir / name).exists():
            name, k = f"step-{step}-{k}.dcp", k + 1
        return name

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, ema_: Any) -> dict[str, Any]:
        """Every rank calls. Writes ``step-S.dcp`` (once per step) and returns what the ``.pt`` file
        keeps of the weights: the directory's name, the optimizer's hyper-parameters, the EMA's count."""
        from torch.distributed import checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        ema = ema_.module if ema_ is not None else None  # the buffers are rank 0's: the checkpointer synced them
        # An optimizer without state (no step taken yet) is saved as such: asking torch for its
        # state dict would first initialise it with a zero-lr step, which changes Adam's step count.
        has_state = bool(optimizer.state)
        if has_state:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            groups = optim_sd["param_groups"]
        else:
            model_sd, optim_sd, groups = get_model_state_dict(model), None, []
        if self._written is None or self._written[0] != step:
            name = broadcast_object(self._free_name(step) if self.info.is_main else None, self.info)
            tensors: dict[str, Any] = {"model": model_sd}
            if optim_sd is not None:
                tensors["optim"] = optim_sd["state"]
            if ema is not None:
                tensors["ema"] = get_model_state_dict(ema)
            tmp = self.dir / f".{name}.tmp"
            if self.info.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            if self.info.enabled:
                dist.barrier()  # the fresh directory exists before any rank writes into it
            try:
                dcp.save(tensors, checkpoint_id=tmp)
            except Exception as err:  # DCP reports any rank's failure (a full disk, ...) on every rank
                raise CheckpointError(f"could not write sharded checkpoint {tmp}: {str(err).splitlines()[0][:500]} "
                                      f"(the previous checkpoints are intact)") from err
            if self.info.is_main:
                os.replace(tmp, self.dir / name)
                _fsync_dir(self.dir)
            self._written = (step, name)
        return {fmt.SHARDED: {"dir": self._written[1], "optimizer": has_state, "param_groups": groups},
                fmt.EMA: {"updates": ema_.updates} if ema_ is not None else None}

    def load(self, source: Path, state: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
             ema_: Any) -> None:
        """Every rank calls: each reads its own shards of the directory the ``.pt`` file ``source`` names
        (``state``: its weights entry)."""
        from torch.distributed import checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                             set_model_state_dict, set_optimizer_state_dict)

        record = state[fmt.SHARDED]
        path = dcp_path(Path(source).parent, record)
        ema = ema_.module if ema_ is not None and state[fmt.EMA] is not None else None
        if record["optimizer"]:  # initialises the fresh optimizer's state (zero-lr step), then overwritten
            model_sd, optim_sd = get_state_dict(model, optimizer)
            tensors: dict[str, Any] = {"model": model_sd, "optim": optim_sd["state"]}
        else:
            tensors = {"model": get_model_state_dict(model)}
        if ema is not None:
            tensors["ema"] = get_model_state_dict(ema)
        from visiontrain.engine.state.dcp_reader import SafeReader

        try:
            dcp.load(tensors, checkpoint_id=path, storage_reader=SafeReader(path))
        except Exception as err:  # DCP wraps every rank's failure in its own exception type
            raise CheckpointError(f"sharded checkpoint {path} could not be read into this model: "
                                  f"{str(err).splitlines()[0][:500]}") from None
        set_model_state_dict(model, tensors["model"])
        if record["optimizer"]:
            set_optimizer_state_dict(model, optimizer, {"state": tensors["optim"],
                                                        "param_groups": own_kernels(record["param_groups"], optimizer)})
        if ema is not None:
            set_model_state_dict(ema, tensors["ema"])
            ema_.updates = int(state[fmt.EMA]["updates"])

    def prune(self) -> None:
        """Rank 0, after writing its ``.pt`` files: delete the directories none of them names."""
        named = set()
        for pt in self.dir.glob("*.pt"):
            try:
                record = fmt.sharded_record(fmt.read(read_checkpoint_file(pt, mmap=True), pt))
            except CheckpointError:
                continue  # unreadable (or not a checkpoint): nothing it names could be used
            if record is not None:
                named.add(record.get("dir"))
        for entry in self.dir.iterdir():  # and what a crash mid-save left: .step-S.dcp.tmp
            if entry.is_dir() and (entry.name.startswith(".step-") or
                                   (DCP_DIR.match(entry.name) and entry.name not in named)):
                shutil.rmtree(entry, ignore_errors=True)


#: The param-group keys that choose the optimizer's kernels, not its arithmetic
KERNEL_KEYS = ("fused", "foreach")


def own_kernels(groups: list[dict[str, Any]], optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The written param groups with this run's kernel choice: a checkpoint of one process (fused
    SGD) resumed sharded, where fused SGD has no DTensor rule (foreach), or the other way round."""
    return [{**saved, **{k: own[k] for k in KERNEL_KEYS if k in own}}
            for saved, own in zip(groups, optimizer.param_groups)]


def dcp_path(pointer_dir: Path, record: dict[str, Any]) -> Path:
    """The directory a ``.pt`` file names: one of the ``step-S.dcp`` names this module writes, beside
    the ``.pt`` file (a name from a downloaded file reaches nothing else: ``../x`` is refused)."""
    name = record.get("dir")
    if not isinstance(name, str) or not DCP_DIR.match(name):
        raise CheckpointError(f"the .pt file in {pointer_dir} names {name!r} as its sharded directory; expected "
                              f"a name like step-120.dcp beside it")
    path = pointer_dir / name
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"sharded checkpoint {path} is missing or incomplete (no .metadata): the "
                              f".pt file in {pointer_dir} names it; copy the whole checkpoints directory")
    return path


def sharded_shapes(pointer_dir: Path, record: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The model tensors' full shapes, from the directory's metadata (nothing else is read)."""
    from visiontrain.engine.state.dcp_reader import SafeReader

    md = SafeReader(dcp_path(pointer_dir, record)).read_metadata()
    return {k[len("model."):]: tuple(v.size) for k, v in md.state_dict_metadata.items() if k.startswith("model.")}


def load_full(path: Path) -> dict[str, Any]:
    """One process, no process group: every tensor of a DCP directory at full size on the CPU,
    nested as saved. Anything but tensors is refused (it would be unpickled without weights_only),
    and the metadata is read with DCP's own classes only (``dcp_reader``)."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from visiontrain.engine.state.dcp_reader import SafeReader

    reader = SafeReader(path)
    md = reader.read_metadata()
    flat = {}
    for key, item in md.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise CheckpointError(f"sharded checkpoint {path}: item {key!r} is not a tensor; refused "
                                  f"(it would be unpickled with code execution allowed)")
        flat[key] = torch.empty(item.size, dtype=item.properties.dtype)
    with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(flat, storage_reader=reader, no_dist=True)
    nested: dict[str, Any] = {}
    for key, tensor in flat.items():
        *parents, leaf = md.planner_data.get(key, (key,)) if md.planner_data else (key,)
        node = nested
        for p in parents:
            node = node.setdefault(str(p), {})
        node[str(leaf)] = tensor
    return nested


def resolve_full(state: dict[str, Any], pointer: Path) -> dict[str, Any]:
    """A ``.pt`` file that names a DCP directory, as the single-file checkpoint it stands for:
    full model, EMA and optimizer (keyed by parameter name, as torch's ``get_optimizer_state_dict``
    gives it). What validate, predict, export and --init read."""
    record = fmt.sharded_record(state)
    tensors = load_full(dcp_path(pointer.parent, record))
    optimizer = {"state": tensors.get("optim", {}), "param_groups": record["param_groups"]}
    return fmt.with_full_weights(state, tensors["model"], optimizer, tensors.get("ema"))


def _fsync_dir(path: Path) -> None:
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
