"""Reading a DCP directory's ``.metadata`` without running what a stranger put in it.

torch.distributed.checkpoint's ``FileSystemReader.read_metadata`` is a bare ``pickle.load``: a
``.pt`` file made of plain dicts passes the ``weights_only`` load, and if it names a sharded
directory, that directory's ``.metadata`` would run any code it holds when validate, export,
predict, consolidate, ``--init`` or a resume reads it. ``SafeReader`` unpickles the metadata with
only the classes DCP's own metadata is made of (its dataclasses, ``torch.Size``, dtypes, layouts,
memory formats, paths); anything else is refused in one line naming the file and the global.
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from visiontrain.engine.state.files import CheckpointError

#: module -> the names a DCP ``.metadata`` may reference there (what torch 2.13 writes for model,
#: EMA and optimizer tensors, replicated or FSDP2-sharded)
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                              "TensorStorageMetadata", "ChunkStorageMetadata",
                                              "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "builtins": {"set", "frozenset", "slice"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                  torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"sharded checkpoint metadata {self.path}: refers to {module}.{name}, which DCP "
                              f"metadata never holds; refused (unpickling it could run code)")


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is unpickled with ``_ALLOWED`` classes only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f, path).load()
        except CheckpointError:
            raise
        except Exception as err:  # a truncated or foreign file: pickle raises any of a dozen types
            raise CheckpointError(f"sharded checkpoint metadata {path} cannot be read: {err}") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"sharded checkpoint metadata {path}: not DCP metadata "
                                  f"({type(metadata).__name__}); refused")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
