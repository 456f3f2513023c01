"""A dataset whose items are a packed index's entries as plain values, with the file its buffers are
mapped from in the process that read them: what tests/data/test_shared_index.py compares between a
DataLoader worker and the process that made the index."""
from __future__ import annotations

import os

import torch

from visiontrain.data.shared_arrays import mapped_file


class IndexItems(torch.utils.data.Dataset):
    """Item i: the i-th record of ``index`` (a ``RecordIndex``), its samples file's row i (a
    ``SplitSamples``) and image-folder sample i (a ``PackedSamples``), as lists and strings; the reading
    process's pid; and the files the three are mapped from there."""

    def __init__(self, records, samples, folder) -> None:
        self.records, self.samples, self.folder = records, samples, folder

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict:
        r, s = self.records[i], self.samples
        return {"pid": os.getpid(), "path": r.path, "boxes": r.boxes.tolist(), "labels": r.labels.tolist(),
                "masks": r.masks, "row": [int(s.shard[i]), int(s.start[i]), int(s.end[i]), int(s.labels["label"][i])],
                "sample": self.folder[i],
                "files": [mapped_file(self.records.boxes), mapped_file(self.records.paths.data),
                          mapped_file(self.samples.start), mapped_file(self.folder.labels)],
                "writeable": bool(self.records.boxes.flags.writeable)}
