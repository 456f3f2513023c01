"""Tar shards in the WebDataset layout: written by ``visiontrain shard`` from any data the project
reads (``raw``, ``writer``), and trained from with ``data.name=shards`` (``source``, ``datasets``,
``sampler``), from a directory or an fsspec URL (``storage``).

A split becomes ``SPLIT-000000.tar``, ``SPLIT-000001.tar``, ... of about ``--shard-size`` bytes
each. A sample is a run of members with one key: ``KEY.EXT``, the image file's bytes as they were
(``jpg``, ``png``, ...; never re-encoded; an in-memory set's pixels as PNG), and ``KEY.json``, its
labels and where it came from; a classification sample also has ``KEY.cls``, its class index as
text, as WebDataset readers expect, and a semantic or panoptic sample its label file ``KEY.seg.png``
or ``KEY.pan.png`` (``raw``: what each kind carries; ``segmentation``: how they are read). The
samples go in a fixed shuffle of the reader's order (``writer.written_order``), so that each shard
holds every class. ``index.json`` beside the shards lists every split's shards with their sample
counts and bytes, the class names and the source (``layout``); each split's samples file, where each
sample lies and its labels (``samples``).
"""
