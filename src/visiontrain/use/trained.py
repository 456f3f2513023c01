"""A trained model rebuilt from its checkpoint: the one path ``validate``, ``predict`` and
``export`` take, so that they agree on what a checkpoint is and on what ``--ema`` means.

A training checkpoint holds the config (which rebuilds the task), ``data_info`` (which sizes the
model: class count, names) and the weights of the model and of its EMA. The task's pretrained
parts are not loaded (``Task.init_weights``): the checkpoint holds every weight.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from torch import nn

from visiontrain.core import config as C
from visiontrain.engine.protocols.task import Task
from visiontrain.engine.state.checkpoint import CheckpointError, load_checkpoint
from visiontrain.engine.state.run_dir import checkpoint_in
from visiontrain.engine.state.weights import shapes_of, weights_misfit
from visiontrain.rundir import checkpoint_format as fmt
from visiontrain.tasks import build_task


@dataclass
class Trained:
    path: str                   # the checkpoint file (a run dir given names its last.pt or best.pt)
    state: dict[str, Any]
    cfg: C.Config
    task: Task

    @property
    def info(self) -> dict[str, Any]:
        return fmt.data_info_of(self.state)

    @property
    def has_ema(self) -> bool:
        return fmt.has_ema(self.state)

    @property
    def step(self) -> int:
        return fmt.step_of(self.state)

    def model(self, ema: bool = False) -> nn.Module:
        """The model with the checkpoint's weights (``ema``: the EMA's), in eval mode."""
        if ema and not self.has_ema:
            raise CheckpointError(f"{self.path}: --ema given but the checkpoint holds no EMA weights "
                                  f"(trained with ema.enabled=false)")
        weights = fmt.ema_weights(self.state) if ema else fmt.model_weights(self.state)
        which = "EMA weights" if ema else "weights"
        if not isinstance(weights, dict):
            raise CheckpointError(f"{self.path}: its {which} are no dict of tensors")
        model = self._built_model()
        misfit = weights_misfit(shapes_of(weights), model.state_dict(), extra=True)
        if misfit:  # a file edited, damaged or made to crash a loader: one line, not load_state_dict's traceback
            raise CheckpointError(f"{self.path}: its {which} do not fit the model its config builds ({misfit})")
        model.load_state_dict(weights)
        return model.eval()

    def _built_model(self) -> nn.Module:
        """The model the checkpoint's config and ``data_info`` describe. Both come from the file: a class
        count of 10**12 fails in the allocator, and the user gets that in one line naming the file."""
        try:
            return self.task.build_model(self.info)
        except (RuntimeError, MemoryError, ValueError, TypeError, OverflowError) as err:
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise CheckpointError(f"{self.path}: its config and data_info do not build a model: {reason}") from None


def load_trained(target: str | Path, overrides: Sequence[str] = (), split: str = "val") -> Trained:
    """``target``: a checkpoint file or a run dir. ``overrides``: ``key=value`` over the saved config
    (e.g. ``data.root=...`` to evaluate on data that has moved). ``split="test"``: the task evaluates
    on ``data.test_split`` instead of the validation split."""
    path = str(checkpoint_in(target))
    state = load_checkpoint(path)
    tree = fmt.config_of(state)
    if tree is None or fmt.data_info_of(state) is None:
        raise CheckpointError(f"{path}: not a visiontrain training checkpoint (no config/data_info)")
    for key, value in C.parse_overrides(list(overrides)):
        C._set_dotted(tree, key, value)
    if split == "test":
        return Trained(path, state, *_on_test_split(tree, path))
    cfg = C.config_from_dict(tree, source=path)
    return Trained(path, state, cfg, build_task(cfg))


def _on_test_split(tree: dict, path: str) -> tuple[C.Config, Task]:
    """The config (and task) of a run with ``data.test_split`` in the validation split's place. The test
    split must be one training never touched: neither the training split nor the one validated (and
    chosen best.pt by) during training."""
    fixed = type(C.config_from_dict(tree, source=path).task).unread_data_keys.get("val_split")
    if fixed:  # else its config check would say only that the task does not read data.val_split
        raise C.ConfigError(f"--split test: this run's task has fixed splits, so there is no test split to "
                            f"evaluate ({fixed}); `visiontrain validate RUN` without --split evaluates on its "
                            f"validation split")
    data = tree.setdefault("data", {})
    source = C.SECTIONS["data"].kind_class(data)  # a checkpoint from before a key: the source's default
    test = data.get("test_split", source.test_split)
    used = {"data.train_split": data.get("train_split", source.train_split),
            "data.val_split": data.get("val_split", source.val_split)}
    for key, name in used.items():
        if test == name:
            raise C.ConfigError(f"--split test: data.test_split={test} is {key}, which training used; "
                                f"name a split training never touched (data.test_split=...)")
    data["val_split"] = test
    try:
        cfg = C.config_from_dict(tree, source=path)
    except C.ConfigError as err:
        raise C.ConfigError(f"--split test: no test split for this run: {err}") from None
    return cfg, build_task(cfg)
