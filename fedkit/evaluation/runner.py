"""Runs the recipe's evaluation protocol at the end of a round, then the evaluate hook."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedkit.data.datasets import ImageSet
from fedkit.training import accuracy

if TYPE_CHECKING:
    from fedkit.engine import Run


def due(every: int, round: int, rounds: int) -> bool:
    """Whether a round is evaluated: every ``every`` rounds, and always the last one."""
    return round == rounds or (every > 0 and round % every == 0)


def _capped(data: ImageSet, limit: int | None, seed: int) -> ImageSet:
    if limit is None or len(data) <= limit:
        return data
    idx = np.sort(np.random.default_rng(seed).choice(len(data), size=limit, replace=False))
    return data.subset(idx)


def supervised_metrics(run: Run) -> dict[str, Any]:
    """Global test accuracy (pool of one) and personalized accuracy: the mean over
    clients of their cluster model's accuracy on their own local test set."""
    server, cfg = run.server, run.recipe.evaluation
    models = [server.model(c) for c in range(len(server.pool))]
    per_client = [accuracy(models[c.cluster or 0], c.test, server.device) for c in run.clients]
    metrics: dict[str, Any] = {"personalized_accuracy": float(np.mean(per_client))}
    if len(models) == 1:
        test = _capped(server.data.test, cfg.max_eval, run.recipe.seed)
        metrics["test_accuracy"] = accuracy(models[0], test, server.device)
    return metrics


def representation_metrics(run: Run, protocol: str) -> dict[str, Any]:
    """kNN monitor or linear probe on the encoder of cluster 0 (frozen features)."""
    from fedkit.evaluation.features import extract_features
    from fedkit.evaluation.protocols import knn_accuracy, linear_probe

    server, cfg, seed = run.server, run.recipe.evaluation, run.recipe.seed
    clients = np.concatenate(server.data.clients)
    train = _capped(server.data.train.subset(np.sort(clients)), cfg.max_eval, seed)
    test = _capped(server.data.test, cfg.max_eval, seed)
    encoder = server.model(0)["encoder"]
    ftr = extract_features(encoder, train.normalized(), device=server.device)
    fte = extract_features(encoder, test.normalized(), device=server.device)
    classes = len(server.data.train.classes)
    if protocol == "knn":
        acc = knn_accuracy(
            ftr,
            train.labels,
            fte,
            test.labels,
            classes,
            k=cfg.knn_k,
            temperature=cfg.knn_temperature,
        )
        return {"knn_accuracy": acc}
    acc = linear_probe(
        ftr,
        train.labels,
        fte,
        test.labels,
        classes,
        epochs=cfg.linear_epochs,
        lr=cfg.linear_lr,
        seed=seed,
    )
    return {"linear_accuracy": acc}


@torch.no_grad()
def evaluate_round(run: Run, round: int) -> dict[str, Any]:
    """The core protocol's metrics plus every plugin's ``evaluate`` results."""
    cfg = run.recipe.evaluation
    if not due(cfg.every, round, run.recipe.federation.rounds):
        return {}
    metrics: dict[str, Any] = {}
    if cfg.protocol == "supervised":
        metrics.update(supervised_metrics(run))
    elif cfg.protocol in ("knn", "linear"):
        with torch.enable_grad():
            metrics.update(representation_metrics(run, cfg.protocol))
    for extra in run.hook.evaluate(server=run.server, round=round):
        metrics.update(extra or {})
    return metrics
