"""Runs the recipe's evaluation protocol at the end of a round, then the evaluate hook."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedkit.data.datasets import ImageSet
from fedkit.evaluation.clustering import identity_metrics, personalized_metrics
from fedkit.recipe import EvaluationConfig
from fedkit.training import accuracy

if TYPE_CHECKING:
    from fedkit.engine import Run
    from fedkit.server import Server


def due(every: int, round: int, rounds: int) -> bool:
    """Whether a round is evaluated: every ``every`` rounds, and always the last one."""
    return round == rounds or (every > 0 and round % every == 0)


def capped(data: ImageSet, limit: int | None, seed: int) -> ImageSet:
    """A seeded random subset of at most ``limit`` images (all when ``limit`` is None)."""
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
    if len(models) > 1 or server.data.groups is not None:
        metrics.update(personalized_metrics(run, models))
    if len(models) == 1:
        test = capped(server.data.test, cfg.max_eval, run.recipe.seed)
        metrics["test_accuracy"] = accuracy(models[0], test, server.device)
    return metrics


def score_encoder(
    encoder: torch.nn.Module,
    train: ImageSet,
    test: ImageSet,
    protocol: str,
    cfg: EvaluationConfig,
    seed: int,
    device: torch.device,
) -> dict[str, Any]:
    """Score a frozen encoder: kNN monitor, linear probe on cached features, or
    semi-supervised fine-tuning on class-balanced label fractions (``semi_fractions``).

    ``train`` holds the labelled images the protocol learns from, ``test`` the held-out
    ones; metric names are ``knn_accuracy``, ``linear_accuracy`` and ``semi_accuracy_<pct>``.
    """
    from fedkit.evaluation.features import extract_features
    from fedkit.evaluation.protocols import knn_accuracy, linear_probe, semi_supervised

    classes = len(train.classes)
    if protocol == "semi":
        out = {}
        for fraction in cfg.semi_fractions:
            out[f"semi_accuracy_{fraction * 100:g}"] = semi_supervised(
                encoder,
                train.images,
                train.labels,
                test.images,
                test.labels,
                classes,
                fraction,
                epochs=cfg.semi_epochs,
                lr=cfg.semi_lr,
                seed=seed,
                device=device,
                mean=train.mean,
                std=train.std,
            )
        return out
    ftr = extract_features(encoder, train.normalized(), device=device)
    fte = extract_features(encoder, test.normalized(), device=device)
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


def evaluation_sets(server: Server) -> tuple[ImageSet, ImageSet]:
    """The pooled clients' train images and the global test set, capped by ``max_eval``."""
    cfg, seed = server.recipe.evaluation, server.recipe.seed
    clients = np.concatenate(server.data.clients)
    train = capped(server.data.train.subset(np.sort(clients)), cfg.max_eval, seed)
    return train, capped(server.data.test, cfg.max_eval, seed)


def representation_metrics(run: Run, protocol: str) -> dict[str, Any]:
    """kNN monitor, linear probe or semi-supervised fine-tuning on cluster 0's encoder."""
    train, test = evaluation_sets(run.server)
    encoder = run.server.model(0)["encoder"]
    cfg, seed = run.recipe.evaluation, run.recipe.seed
    return score_encoder(encoder, train, test, protocol, cfg, seed, run.server.device)


@torch.no_grad()
def evaluate_round(run: Run, round: int) -> dict[str, Any]:
    """The core protocol's metrics plus every plugin's ``evaluate`` results."""
    cfg = run.recipe.evaluation
    metrics: dict[str, Any] = identity_metrics(run)
    if not due(cfg.every, round, run.recipe.federation.rounds):
        return metrics
    if cfg.protocol == "supervised":
        metrics.update(supervised_metrics(run))
    elif cfg.protocol in ("knn", "linear", "semi"):
        with torch.enable_grad():
            metrics.update(representation_metrics(run, cfg.protocol))
    for extra in run.hook.evaluate(server=run.server, round=round):
        metrics.update(extra or {})
    return metrics
