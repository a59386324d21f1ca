"""Metrics of clustered runs: how well the clients' cluster identities match the true
groups (adjusted Rand index, every round), and personalized macro F1 and AUROC of each
client's own model on its local test set."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from fedkit.data.datasets import ImageSet
from fedkit.evaluation.metrics import adjusted_rand, auroc, macro_f1
from fedkit.models.backbones import logits
from fedkit.training.batching import batches, normalize

if TYPE_CHECKING:
    from fedkit.core.server import Server


def identity_metrics(server: Server) -> dict[str, Any]:
    """ARI against the partition's true groups of every client's latest reported identity
    (``ari``) and of this round's clients only (``ari_round``; with partial participation
    the others keep older identities), and the number of distinct clusters in use."""
    groups = server.data.groups
    placed = [c for c in server.roster if c.cluster is not None]
    if groups is None or not placed:
        return {}
    sampled = [c for c in placed if c.last_round == server.round]
    found = [c.cluster for c in placed]
    return {
        "ari": adjusted_rand(found, [groups[c.id] for c in placed]),
        "ari_round": adjusted_rand([c.cluster for c in sampled], [groups[c.id] for c in sampled]),
        "clusters_used": len(set(found)),
    }


@torch.no_grad()
def predict(model: nn.ModuleDict, data: ImageSet, device: torch.device) -> tuple[Tensor, Tensor]:
    """Class probabilities of a model on an image set, with the set's labels."""
    model.eval()
    out = [
        torch.softmax(logits(model, normalize(x.to(device), data)), dim=1).cpu()
        for x, _ in batches(data, 512, shuffle=False)
    ]
    probs = torch.cat(out) if out else torch.empty(0, data.num_classes)
    return probs, data.labels


def personalized_metrics(
    predictions: list[tuple[Tensor, Tensor]], num_classes: int
) -> dict[str, Any]:
    """Mean over clients of macro F1 and AUROC of their own model on their local test set
    (``predictions``: per client, probabilities and labels). Clients with an empty test
    set are left out, and so are those whose AUROC is undefined (one class only)."""
    f1s, aurocs = [], []
    for probs, labels in predictions:
        if len(labels) == 0:
            continue
        f1s.append(macro_f1(probs.argmax(1), labels, num_classes))
        score = auroc(probs, labels, num_classes)
        if not np.isnan(score):
            aurocs.append(score)
    metrics: dict[str, Any] = {}
    if f1s:
        metrics["personalized_f1"] = float(np.mean(f1s))
    if aurocs:
        metrics["personalized_auroc"] = float(np.mean(aurocs))
    return metrics
