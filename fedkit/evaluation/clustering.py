"""Metrics of clustered runs: how well the clients' cluster identities match the true
groups (adjusted Rand index, every round), and personalized macro F1 and AUROC of each
client's cluster model on its own local test set."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from fedkit.evaluation.metrics import adjusted_rand, auroc, macro_f1
from fedkit.models.backbones import logits
from fedkit.training import batches, normalize

if TYPE_CHECKING:
    from fedkit.engine import Run


def identity_metrics(run: Run) -> dict[str, Any]:
    """ARI against the partition's true groups of every client's latest identity (``ari``)
    and of this round's sampled clients only (``ari_round``; with partial participation the
    others keep older identities), and the number of distinct clusters in use."""
    groups = run.server.data.groups
    placed = [c for c in run.clients if c.cluster is not None]
    if groups is None or not placed:
        return {}
    sampled = [c for c in placed if c.round == run.server.round]
    found = [c.cluster for c in placed]
    return {
        "ari": adjusted_rand(found, [groups[c.id] for c in placed]),
        "ari_round": adjusted_rand([c.cluster for c in sampled], [groups[c.id] for c in sampled]),
        "clusters_used": len(set(found)),
    }


@torch.no_grad()
def _predict(model: nn.ModuleDict, data, device: torch.device) -> torch.Tensor:
    model.eval()
    out = [
        torch.softmax(logits(model, normalize(x.to(device), data)), dim=1).cpu()
        for x, _ in batches(data, 512, shuffle=False)
    ]
    return torch.cat(out) if out else torch.empty(0, data.num_classes)


def personalized_metrics(run: Run, models: list[nn.ModuleDict]) -> dict[str, Any]:
    """Mean over clients of macro F1 and AUROC of their cluster model on their local test
    set (clients whose AUROC is undefined, with one class only, are left out of its mean)."""
    f1s, aurocs = [], []
    classes = run.server.data.num_classes
    for client in run.clients:
        if len(client.test) == 0:
            continue
        probs = _predict(models[client.cluster or 0], client.test, run.server.device)
        f1s.append(macro_f1(probs.argmax(1), client.test.labels, classes))
        score = auroc(probs, client.test.labels, classes)
        if not np.isnan(score):
            aurocs.append(score)
    metrics: dict[str, Any] = {}
    if f1s:
        metrics["personalized_f1"] = float(np.mean(f1s))
    if aurocs:
        metrics["personalized_auroc"] = float(np.mean(aurocs))
    return metrics
