"""What a checkpoint is: its top-level names, its format version, how an older format is read, and
the one place a checkpoint's entries are read by name.

A checkpoint is composed, not hand-written: every piece of a run that has state (the weights, the
loop's position, the data source, the log point, the best-k record, early stopping, the task, the
hooks, the RNGs...) is registered under a name in :class:`States`, and a checkpoint is
``{"format": FORMAT_VERSION, name: state_dict() for each, "config": ..., "data_info": ...}``.
Restoring hands each its own entry back. A new part with state adds an entry by being registered;
nothing here, in the checkpointer or in the trainer changes.

Every module outside this one reads a checkpoint through the functions below (a test checks that
no other module reads a top-level entry by its string). A file of an older format is turned into
the current one as it is read (:func:`read`), so that everything after works on one format; a file
of a newer format than this code knows is refused in one line naming both versions.
Torch-free, so that what reads run records (trackers, reports) may name these entries.
"""
from __future__ import annotations

from typing import Any, Protocol


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file."""

#: Version 2: the state of each registered part under its own name (format 1 was a fixed dict of
#: 14 keys). Raise it, and add a step to ``UPGRADES``, whenever an entry changes shape.
FORMAT_VERSION = 2

# What describes the run rather than a part of it.
FORMAT, CONFIG, DATA_INFO = "format", "config", "data_info"
META = (FORMAT, CONFIG, DATA_INFO)
# The engine's own entries, in the order they are restored (the RNGs last: nothing may draw after).
WEIGHTS, SCALER, PROGRESS, DATA, TASK = "weights", "scaler", "progress", "data", "task"
LOG_POINT, BEST, EARLY_STOP, HOOKS, TRACKERS, RNG = "log_point", "best", "early_stop", "hooks", "trackers", "rng"
#: Without these a file is no training checkpoint (a resume cannot be exact).
REQUIRED = (WEIGHTS, PROGRESS, DATA, RNG)
# Inside WEIGHTS: replicated files hold the tensors, an FSDP run's name its directory of shards.
MODEL, OPTIMIZER, EMA, SHARDED, STRATEGY = "model", "optimizer", "ema", "sharded", "strategy"
REPLICATED, FSDP = "replicated", "fsdp"


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class States:
    """The named states a checkpoint is composed of, saved and restored in the order registered."""

    def __init__(self) -> None:
        self._by_name: dict[str, Stateful] = {}

    def register(self, name: str, obj: Stateful) -> None:
        if not name or name in META or name in self._by_name:
            raise ValueError(f"checkpoint entry {name!r} is {'taken' if name else 'unnamed'}: each state needs "
                             f"its own name, other than {', '.join(META)}")
        self._by_name[name] = obj

    def names(self) -> list[str]:
        return list(self._by_name)

    def get(self, name: str) -> Stateful | None:
        return self._by_name.get(name)

    def compose(self, config: dict[str, Any], data_info: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint: every registered state, and what describes the run."""
        states = {name: obj.state_dict() for name, obj in self._by_name.items()}
        return {FORMAT: FORMAT_VERSION, **states, CONFIG: config, DATA_INFO: data_info}

    def restore(self, checkpoint: dict[str, Any]) -> tuple[list[str], list[str]]:
        """Each registered state loaded from its entry, in order. Returns the names the checkpoint has
        no entry for (those keep their fresh state: a part added since it was written) and the entries
        nothing here is registered for (a part this run does not have)."""
        absent = []
        for name, obj in self._by_name.items():
            state = checkpoint.get(name)
            if state is None:
                absent.append(name)
            else:
                obj.load_state_dict(state)
        unknown = [name for name in checkpoint if name not in self._by_name and name not in META]
        return absent, unknown


# ------------------------------------------------------------------ reading a file's dict
def _from_format_1(old: dict[str, Any]) -> dict[str, Any]:
    """Format 1 (commit 22eb1c6 and before): the same states under fixed names, the layout facts in
    ``progress`` and the sampler's seed on its own."""
    progress = dict(old.get(PROGRESS) or {})
    weights = {k: old[k] for k in (MODEL, OPTIMIZER, EMA, SHARDED) if k in old}
    weights[STRATEGY] = progress.pop(STRATEGY, REPLICATED)
    data = {"seed": old.get("sampler_seed"), "batch_size": progress.pop("batch_size", None),
            "world_size": progress.pop("world_size", None)}
    new = {FORMAT: 2, WEIGHTS: weights, SCALER: old.get(SCALER), PROGRESS: progress, DATA: data,
           LOG_POINT: old.get("metrics"), BEST: old.get(BEST), EARLY_STOP: old.get(EARLY_STOP), TASK: old.get(TASK),
           RNG: old.get(RNG), CONFIG: old.get(CONFIG), DATA_INFO: old.get(DATA_INFO)}
    return {k: v for k, v in new.items() if v is not None or k in (CONFIG, DATA_INFO)}


#: format N -> the function that turns it into format N + 1.
UPGRADES = {1: _from_format_1}


def read(raw: dict[str, Any], source: Any) -> dict[str, Any]:
    """A loaded file's dict in the current format. A dict without a format version is returned as it
    is: no training checkpoint (a state dict of tensors, another tool's file), which ``--init`` reads."""
    if FORMAT not in raw:
        return raw
    version = raw[FORMAT]
    if not isinstance(version, int) or version < 1:
        raise CheckpointError(f"checkpoint {source}: format {version!r} is no checkpoint format version")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {source} has format {version}, newer than format {FORMAT_VERSION} that "
                              f"this visiontrain reads: update visiontrain to read it")
    while raw[FORMAT] < FORMAT_VERSION:
        raw = UPGRADES[raw[FORMAT]](raw)
    return raw


def is_training_checkpoint(ckpt: dict[str, Any]) -> bool:
    return FORMAT in ckpt


def missing_entries(ckpt: dict[str, Any]) -> list[str]:
    """The entries a resume needs that ``ckpt`` lacks (all of them for a file that is no checkpoint)."""
    return [name for name in REQUIRED if ckpt.get(name) is None]


# ------------------------------------------------------------------ what commands read
def config_of(ckpt: dict[str, Any]) -> dict[str, Any] | None:
    return ckpt.get(CONFIG)


def data_info_of(ckpt: dict[str, Any]) -> dict[str, Any] | None:
    return ckpt.get(DATA_INFO)


def step_of(ckpt: dict[str, Any]) -> int:
    return int(ckpt[PROGRESS]["step"])


def entry(ckpt: dict[str, Any], name: str) -> Any:
    """A registered state's entry (None: absent), e.g. a part's own for a test or a tool."""
    return ckpt.get(name)


def weights_entry(ckpt: dict[str, Any]) -> dict[str, Any]:
    return ckpt.get(WEIGHTS) or {}


def strategy_of(ckpt: dict[str, Any]) -> str:
    return weights_entry(ckpt).get(STRATEGY, REPLICATED)


def sharded_record(ckpt: dict[str, Any]) -> dict[str, Any] | None:
    """The directory of shards (and the optimizer's groups) an FSDP run's file names; None otherwise."""
    record = weights_entry(ckpt).get(SHARDED)
    return record if isinstance(record, dict) else None


def model_weights(ckpt: dict[str, Any]) -> dict[str, Any] | None:
    """The model's state dict: a checkpoint's (None while its weights are sharded), or, for a file
    that is no checkpoint, its ``model`` entry or the dict itself (what ``--init`` accepts)."""
    if not is_training_checkpoint(ckpt):
        inner = ckpt.get(MODEL)
        return inner if isinstance(inner, dict) else ckpt
    return weights_entry(ckpt).get(MODEL)


def optimizer_state(ckpt: dict[str, Any]) -> dict[str, Any] | None:
    return weights_entry(ckpt).get(OPTIMIZER)


def has_ema(ckpt: dict[str, Any]) -> bool:
    return weights_entry(ckpt).get(EMA) is not None


def ema_weights(ckpt: dict[str, Any]) -> dict[str, Any] | None:
    """The EMA's state dict (None: no EMA, or its weights are sharded)."""
    ema = weights_entry(ckpt).get(EMA)
    return ema.get("module") if isinstance(ema, dict) else None


def with_full_weights(ckpt: dict[str, Any], model: dict[str, Any], optimizer: dict[str, Any],
                      ema: dict[str, Any] | None) -> dict[str, Any]:
    """``ckpt`` as the single file it stands for once its shards are gathered (``engine.fsdp``): the
    full tensors in place of the name of their directory; the strategy stays ``fsdp``, so that a
    resume knows the optimizer state is keyed by parameter name."""
    weights = {k: v for k, v in weights_entry(ckpt).items() if k != SHARDED}
    weights.update({MODEL: model, OPTIMIZER: optimizer})
    if weights.get(EMA) is not None:
        weights[EMA] = {"module": ema, "updates": weights[EMA]["updates"]}
    return {**ckpt, WEIGHTS: weights}
