"""Weighted k-NN classification on frozen features, as DINO evaluates its teacher.

Features are L2-normalised; each test sample takes its ``k`` most cosine-similar train samples and
each neighbour votes for its class with weight ``exp(similarity / T)``. The result is a pure
function of the features, so it can be checked on a toy case by hand.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F


@torch.no_grad()
def knn_predict(train_feats: torch.Tensor, train_labels: torch.Tensor, test_feats: torch.Tensor, *,
                num_classes: int, k: int = 20, temperature: float = 0.07, chunk: int = 1024) -> torch.Tensor:
    """Predicted class of each test row. Inputs are L2-normalised [N, D] / [M, D] features."""
    if train_feats.shape[0] == 0:
        raise ValueError("k-NN needs at least one train feature")
    k = min(k, train_feats.shape[0])
    preds = []
    for start in range(0, test_feats.shape[0], chunk):
        sim = test_feats[start:start + chunk] @ train_feats.T               # [m, N] cosine similarity
        top_sim, top_idx = sim.topk(k, dim=1)
        votes = torch.zeros(sim.shape[0], num_classes, device=sim.device, dtype=sim.dtype)
        votes.scatter_add_(1, train_labels[top_idx], (top_sim / temperature).exp())
        preds.append(votes.argmax(1))
    return torch.cat(preds) if preds else torch.zeros(0, dtype=torch.long, device=test_feats.device)


@torch.no_grad()
def extract_features(encode: Callable[[torch.Tensor], torch.Tensor], batches: Iterable[tuple[Any, slice]],
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """L2-normalised float32 features and labels of ``(images, labels), real`` batches on ``device``
    (the engine's EvalData yields them), each cut to its ``real`` rows: every batch is encoded,
    padding repeats too, since under FSDP each forward is a collective."""
    feats, labels = [], []
    for (images, y), real in batches:
        feats.append(F.normalize(encode(images).float(), dim=1)[real])
        labels.append(torch.as_tensor(y, device=device)[real])
    if not feats:
        return torch.zeros(0, 0, device=device), torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat(feats), torch.cat(labels)
