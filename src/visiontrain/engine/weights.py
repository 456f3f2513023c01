"""Weights in and out: --init (shape-tolerant), safetensors export, resume compatibility checks."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from visiontrain.engine.checkpoint import CheckpointError, load_checkpoint


def _state_from_file(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        if not path.is_file():
            raise CheckpointError(f"weights file {path} does not exist")
        return load_file(str(path))
    state = load_checkpoint(path)
    if "model" in state and isinstance(state["model"], dict):
        return state["model"]
    return state


def load_init_weights(model: nn.Module, path: str | Path) -> str:
    """Load weights only; tensors whose shape differs (a new class count) or that the model lacks
    are skipped and reported. Returns the report line."""
    source = _state_from_file(path)
    own = model.state_dict()
    loaded, mismatched, unexpected = {}, [], []
    for key, tensor in source.items():
        if key not in own:
            unexpected.append(key)
        elif own[key].shape != tensor.shape:
            mismatched.append(f"{key} {tuple(tensor.shape)} -> {tuple(own[key].shape)}")
        else:
            loaded[key] = tensor
    if not loaded:
        raise CheckpointError(f"--init {path}: no tensor matches this model by name and shape "
                              f"(is it a checkpoint of another model?)")
    model.load_state_dict(loaded, strict=False)
    missing = [k for k in own if k not in loaded]
    parts = [f"--init {path}: loaded {len(loaded)}/{len(own)} tensors"]
    if mismatched:
        parts.append(f"skipped {len(mismatched)} with another shape: {', '.join(mismatched)}")
    if unexpected:
        parts.append(f"ignored {len(unexpected)} not in the model: {', '.join(unexpected[:10])}")
    if missing:
        parts.append(f"{len(missing)} left at their initial values")
    return "; ".join(parts)


def save_safetensors(model: nn.Module, path: Path) -> None:
    from safetensors.torch import save_file

    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(state, str(tmp))
    tmp.replace(path)


def check_resume_compatible(state: dict[str, Any], trainer: Any, source: str) -> None:
    """Refuse a resume that cannot continue exactly, naming what differs."""
    for key in ("model", "optimizer", "progress", "rng"):
        if key not in state:
            raise CheckpointError(f"--resume {source}: not a visiontrain training checkpoint "
                                  f"(no {key!r}); use --init to load its weights only")
    own = trainer.raw_model.state_dict()
    theirs = state["model"]
    bad = [f"{k} {tuple(theirs[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
           if k in theirs and theirs[k].shape != v.shape]
    missing = [k for k in own if k not in theirs]
    if bad or missing:
        detail = "; ".join(filter(None, [
            f"shapes differ: {', '.join(bad[:5])}" if bad else "",
            f"missing tensors: {', '.join(missing[:5])}" if missing else ""]))
        raise CheckpointError(f"--resume {source}: the checkpoint is of another model or class count "
                              f"({detail}); use --init {source} to start from its weights instead")
    p = state["progress"]
    cfg = trainer.cfg
    if int(p.get("batch_size", cfg.data.batch_size)) != cfg.data.batch_size or \
            int(p.get("world_size", 1)) != trainer.dist.world_size:
        raise CheckpointError(
            f"--resume {source}: it was written with data.batch_size={p.get('batch_size')} on "
            f"{p.get('world_size')} process(es); this run has data.batch_size={cfg.data.batch_size} on "
            f"{trainer.dist.world_size}. An exact resume needs both unchanged (the position inside the "
            f"epoch is counted in batches); use --init to start a new run from its weights")
