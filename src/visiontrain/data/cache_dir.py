"""Where the embedded datasets are built and kept (fashion-mosaic, the digits' split): one directory
per machine, ``$VISIONTRAIN_DATA_CACHE`` or ``~/.cache/visiontrain/datasets``."""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "VISIONTRAIN_DATA_CACHE"


def data_cache_dir() -> Path:
    """Where embedded datasets are built: $VISIONTRAIN_DATA_CACHE or ~/.cache/visiontrain/datasets."""
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "visiontrain" / "datasets"))
