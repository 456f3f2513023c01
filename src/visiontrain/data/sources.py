"""The built-in data sources. Importing this module registers each one's kind of ``data`` section
(``data.name: coco`` types the section by the coco reader's keys); the engine imports it with the
section's common keys, so that every run, a task of a user's included, can name any of them."""
from __future__ import annotations

from visiontrain.data.datasets import sources as classification_sources
from visiontrain.data.detection import sources as detection_sources
from visiontrain.data.section import DataConfig
from visiontrain.data.shards import source as shard_source

BUILT_IN = (classification_sources, detection_sources, shard_source)

__all__ = ["BUILT_IN", "DataConfig"]
