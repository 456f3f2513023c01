"""Weights in and out: --init (shape-tolerant), safetensors export, resume compatibility checks."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from visiontrain.engine.state.checkpoint import CheckpointError, give_usual_mode, load_checkpoint
from visiontrain.engine.state.files import not_weights
from visiontrain.rundir import checkpoint_format as fmt


def _state_from_file(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        if not path.is_file():
            raise CheckpointError(f"weights file {path} does not exist")
        what = not_weights(path)
        if what is not None:
            raise CheckpointError(f"{path} is not a weights file: {what}")
        try:
            return load_file(str(path))
        except SafetensorError as err:  # a Rust error: the CLI would otherwise print a traceback
            raise CheckpointError(f"weights file {path} is truncated or corrupt: {err}") from None
    return fmt.model_weights(load_checkpoint(path))


def _input_conv_adaptable(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """A first conv trained on grey (1) or RGB (3) images, wanted with the other channel count."""
    return (src.dim() == dst.dim() == 4 and src.shape[0] == dst.shape[0] and src.shape[2:] == dst.shape[2:]
            and src.shape[1] in (1, 3) and dst.shape[1] in (1, 3) and src.shape[1] != dst.shape[1])


def _adapt_input_conv(weight: torch.Tensor, channels: int) -> torch.Tensor:
    """Grey -> RGB: the filter repeated over the channels and divided by 3, so an RGB image of a grey
    one gives the same response; RGB -> grey: summed over the channels (what timm does for grey)."""
    if channels == 1:
        return weight.sum(1, keepdim=True)
    return weight.repeat(1, channels, 1, 1) / channels


def load_init_weights(model: nn.Module, path: str | Path, *, what: str = "--init") -> str:
    """Load weights only; tensors whose shape differs (a new class count) or that the model lacks
    are skipped and reported. An input conv of 1 channel loaded into 3 (or back) is adapted, so a
    model trained on grey images can start an RGB one. ``what`` names the option in messages.
    Returns the report line."""
    source = _state_from_file(path)
    own = model.state_dict()
    loaded, mismatched, unexpected, adapted = {}, [], [], []
    for key, tensor in source.items():
        if key not in own:
            unexpected.append(key)
        elif own[key].shape == tensor.shape:
            loaded[key] = tensor
        elif _input_conv_adaptable(tensor, own[key]):
            loaded[key] = _adapt_input_conv(tensor, own[key].shape[1])
            adapted.append(f"{key} {tensor.shape[1]} -> {own[key].shape[1]} input channels")
        else:
            mismatched.append(f"{key} {tuple(tensor.shape)} -> {tuple(own[key].shape)}")
    if not loaded:
        raise CheckpointError(f"{what} {path}: no tensor matches this model by name and shape "
                              f"(is it a checkpoint of another model?)")
    model.load_state_dict(loaded, strict=False)
    missing = [k for k in own if k not in loaded]
    parts = [f"{what} {path}: loaded {len(loaded)}/{len(own)} tensors"]
    if adapted:
        parts.append(f"adapted {', '.join(adapted)}")
    if mismatched:
        parts.append(f"skipped {len(mismatched)} with another shape: {', '.join(mismatched)}")
    if unexpected:
        parts.append(f"ignored {len(unexpected)} not in the model: {', '.join(unexpected[:10])}")
    if missing:
        parts.append(f"{len(missing)} left at their initial values")
    return "; ".join(parts)


def save_safetensors(weights: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    state = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(state, str(tmp))
    give_usual_mode(tmp)  # safetensors writes 0600; the same mode as the checkpoints
    tmp.replace(path)


def shapes_of(weights: dict[str, Any]) -> dict[str, tuple[int, ...] | None]:
    """Each entry's shape; None for an entry that is no tensor (a hand-made or hostile file)."""
    return {k: tuple(v.shape) if isinstance(v, torch.Tensor) else None for k, v in weights.items()}


def weights_misfit(theirs: dict[str, tuple[int, ...] | None], own: dict[str, torch.Tensor],
                   *, extra: bool = False) -> str:
    """What keeps weights of the shapes ``theirs`` from loading into a model whose state dict is ``own``
    (shapes that differ, tensors missing, and with ``extra`` tensors the model has no place for),
    in a few words; "" when they fit. Said before ``load_state_dict``, whose error is a traceback."""
    bad = [f"{k} {theirs[k] if theirs[k] is not None else 'not a tensor'} vs {tuple(v.shape)}"
           for k, v in own.items() if k in theirs and theirs[k] != tuple(v.shape)]
    missing = [k for k in own if k not in theirs]
    unexpected = [k for k in theirs if k not in own] if extra else []
    return "; ".join(filter(None, [
        f"shapes differ: {', '.join(bad[:5])}" if bad else "",
        f"missing tensors: {', '.join(missing[:5])}" if missing else "",
        f"tensors the model has no place for: {', '.join(unexpected[:5])}" if unexpected else ""]))


def _model_text(config: Any, info: Any) -> str:
    """'task classification (small_cnn), 10 classes': what a resume error compares, in a user's words."""
    task = config.get("task", {}) if isinstance(config, dict) else {}
    model = task.get("model") or task.get("backbone")
    classes = info.get("num_classes") if isinstance(info, dict) else None
    return (f"task {task.get('name', '?')}" + (f" ({model})" if model else "")
            + (f", {classes} classes" if classes is not None else ""))


def check_resume_compatible(state: dict[str, Any], run: Any, source: str) -> None:
    """Refuse a resume whose weights cannot continue exactly, naming what differs. ``run``: the run
    being resumed into (engine.setup.training.TrainingRun: its config, model, sharding). What the other parts
    need of it, each checks as it loads its own state (the data source: the batch size and the
    number of processes)."""
    missing = fmt.missing_entries(state)
    if missing:
        raise CheckpointError(f"--resume {source}: not a visiontrain training checkpoint "
                              f"(no {missing[0]!r}); use --init to load its weights only")
    record = fmt.sharded_record(state)
    sharded = record is not None
    same = "resume it with the same distributed.strategy on the same number of processes"
    if sharded and run.sharded is None:
        why = f"it is sharded (written under distributed.strategy=fsdp) and this run is not; {same}"
    elif not sharded and run.sharded is not None:
        why = "an FSDP run resumes only from the sharded checkpoints it writes, and this file is a single one"
    elif fmt.strategy_of(state) == fmt.FSDP and not sharded:
        why = "it was consolidated from an FSDP run (its optimizer state is keyed by parameter name); " + same
    else:
        why = ""
    if why:
        raise CheckpointError(f"--resume {source}: {why}; or use --init {source} to start from its weights")
    from visiontrain.engine.state.sharded import sharded_shapes

    theirs = sharded_shapes(Path(source).parent, record) if sharded else shapes_of(fmt.model_weights(state))
    detail = weights_misfit(theirs, run.raw_model.state_dict())
    if detail:
        from visiontrain.core.config import config_to_dict

        theirs_text = _model_text(fmt.config_of(state), fmt.data_info_of(state))
        own_text = _model_text(config_to_dict(run.cfg), run.data_info)
        models = f"checkpoint: {theirs_text}; this run: {own_text}"
        raise CheckpointError(f"--resume {source}: the checkpoint is of another model or class count "
                              f"({models}; {detail}); use --init {source} to start from its weights instead")
