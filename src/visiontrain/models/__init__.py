"""Models: ``build_model(name, ...)`` -> ``SmallCNN`` for "small_cnn" / "plain_cnn", else a timm model.

timm imports torchvision, so it is imported lazily, after ``ensure_torchvision()``.
"""

from __future__ import annotations

import difflib
import fnmatch
import os
from typing import Any

import torch
from torch import nn

from visiontrain.core._tv_compat import ensure_torchvision
from visiontrain.models.small_cnn import SmallCNN

__all__ = ["SmallCNN", "build_model"]

#: The SmallCNN presets by name. "plain_cnn" is the network a user writes for 28 px images (three blocks,
#: flatten, PyTorch's default initialisation): a name rather than task.model_args, so that a recipe built
#: on it still runs with task.model=resnet18 (timm would refuse SmallCNN's arguments).
LOCAL_MODELS = {"small_cnn": {}, "plain_cnn": {"double_last": False, "head": "flatten", "init": "torch"}}

#: A detection narrower or lower than this (original-image pixels, after clipping to the image) is
#: dropped by every detector's post-processing, before any top-k, NMS or ``max_detections`` cut
#: (torchvision's RoI heads use the same 1e-2): a box that clipped to zero width can still score
#: 1.0, and kept it would take a detection slot and count as a false positive in AP.
MIN_BOX_SIZE = 1e-2


def _timm():
    ensure_torchvision()
    import timm

    return timm


def suggest_models(name: str, n: int = 8) -> list[str]:
    """Close timm (and local) model names for an unknown ``name``."""
    timm = _timm()
    names = list(LOCAL_MODELS) + timm.list_models()
    key = name.lower().replace("-", "_")
    prefix = sorted(m for m in names if m.startswith(key))
    close = difflib.get_close_matches(key, names, n=n, cutoff=0.6)
    stem = key.split(".")[0].rstrip("0123456789_") or key
    contains = sorted(m for m in names if fnmatch.fnmatch(m, f"*{stem}*"))
    out: list[str] = []
    for m in prefix[:3] + close + contains:
        if m not in out:
            out.append(m)
    return out[:n]


def _cached_weights(timm: Any, name: str) -> bool:
    """True if the pretrained weights of ``name`` are in the local Hugging Face cache."""
    try:
        from huggingface_hub import try_to_load_from_cache

        cfg = timm.models.get_pretrained_cfg(name)
        hub_id = getattr(cfg, "hf_hub_id", None) if cfg is not None else None
        if not hub_id:
            return False
        for filename in ("model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin"):
            hit = try_to_load_from_cache(hub_id, filename)
            if isinstance(hit, str):
                return True
    except Exception:
        return False
    return False


class PretrainedUnavailable(RuntimeError):
    """Pretrained weights that cannot be had on this machine (not cached, hub unreachable). The message
    names the switch that trains from scratch instead; the CLI reports it in one line, exit 2."""


def cached_torch_hub_weights(weights: Any, name: str, key: str = "task.pretrained_backbone") -> Any:
    """torchvision ``weights`` (an enum member) if its file is already in the torch hub cache;
    otherwise a clear error up front: training machines are often offline, and a download attempt that
    hangs or fails deep inside torchvision is worse."""
    path = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(weights.url))
    if not os.path.isfile(path):
        raise PretrainedUnavailable(
            f"{key}=true needs the torchvision {name} ImageNet weights in the local cache, but {path} does not "
            f"exist. Fixes: {key}=false (train from scratch), or download {weights.url} on a machine with "
            f"network access and copy it to {path} (TORCH_HOME moves the cache).")
    return weights


def _pretrained_error(name: str, cause: str, key: str = "task.pretrained") -> RuntimeError:
    return PretrainedUnavailable(
        f"cannot get pretrained weights for timm model {name!r}: {cause}. Fixes: {key}=false "
        "(train from scratch); run once where the Hugging Face hub is reachable so the weights land in the "
        "Hugging Face cache (HF_HOME, default ~/.cache/huggingface) and copy that cache here; or pass "
        "pretrained_cfg_overlay=dict(file='/path/to/weights.safetensors')."
    )


def check_pretrained_reachable(timm: Any, name: str, key: str) -> None:
    """Offline (HF_HUB_OFFLINE) and not in the local cache: say so now, naming the switch ``key``,
    instead of the hub client's error from deep inside timm."""
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    if offline and not _cached_weights(timm, name):
        raise _pretrained_error(name, "they are not in the local cache and HF_HUB_OFFLINE is set", key)


def pretrained_error(name: str, err: Exception, key: str) -> RuntimeError:
    """The error for weights timm could not fetch (hub unreachable, not cached), naming ``key``."""
    return _pretrained_error(name, f"{type(err).__name__}: {err}", key)


def build_model(
    name: str,
    *,
    num_classes: int,
    in_channels: int,
    image_size: int,
    pretrained: bool = False,
    **kwargs: Any,
) -> nn.Module:
    """``"small_cnn"`` / ``"plain_cnn"`` -> :class:`SmallCNN` (kwargs: widths, dropout, double_last, head, init,
    over the preset's); anything else -> timm.

    timm models get ``num_classes``/``in_chans``, and ``img_size=image_size`` where the model accepts
    it (ViT-style models).  An unknown name raises ValueError with close names; pretrained weights that
    cannot be had (not cached, hub unreachable) raise RuntimeError naming the model.
    """
    if name in LOCAL_MODELS:
        if pretrained:
            raise ValueError(f"{name} has no pretrained weights; use task.pretrained=false")
        try:
            return SmallCNN(in_channels, num_classes, image_size=image_size, **{**LOCAL_MODELS[name], **kwargs})
        except TypeError as err:  # a key SmallCNN does not take: name it, as for any config key
            raise ValueError(f"{name}: {err} (its arguments: widths, dropout, double_last, head, init; "
                             f"given as task.model_args)") from None

    timm = _timm()
    if not timm.is_model(name):
        hints = suggest_models(name)
        hint = f"; close names: {', '.join(hints)}" if hints else ""
        raise ValueError(
            f"unknown model {name!r} (not {' or '.join(map(repr, LOCAL_MODELS))} and not a timm model){hint}. "
            "List timm models with timm.list_models('*pattern*')."
        )
    own_weights = "pretrained_cfg_overlay" in kwargs or "pretrained_cfg" in kwargs
    if pretrained and not own_weights:
        check_pretrained_reachable(timm, name, "task.pretrained")

    args = dict(pretrained=pretrained, num_classes=num_classes, in_chans=in_channels, **kwargs)
    try:
        if "img_size" not in kwargs:
            try:
                return timm.create_model(name, img_size=image_size, **args)
            except TypeError as e:
                if "img_size" not in str(e):
                    raise
        return timm.create_model(name, **args)
    except (ValueError, TypeError):
        raise
    except Exception as e:
        if pretrained:
            raise pretrained_error(name, e, "task.pretrained") from e
        raise
