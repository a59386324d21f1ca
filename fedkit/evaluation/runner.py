"""Runs the recipe's evaluation protocol at the end of a round, then the evaluate hook.

Evaluation is a measurement, not part of the federated protocol, so it may look at every
client: ``Population`` (what an executor holds: each client's data and memory) gives it
each client's *personal* model, which is its cluster's current state with the client's
own values of the private keys (normalisation layers kept local, a local
predictor). Supervised runs report the mean accuracy of those personal models on each
client's local test set; representation protocols score cluster 0's encoder and, with
``evaluation.personal``, every trained client's own encoder.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn

from fedkit.config.schema import EvaluationConfig
from fedkit.data.datasets import ImageSet
from fedkit.evaluation.clustering import identity_metrics, personalized_metrics, predict
from fedkit.plugin.context import ClientData
from fedkit.rundir.store import StateStore
from fedkit.training import precision
from fedkit.training.supervised import accuracy

if TYPE_CHECKING:
    from fedkit.core.server import ClientInfo, Server
    from fedkit.plugin.manager import Plugins


class Population(Protocol):
    """Every client's data and memory (an executor is one)."""

    clients: Mapping[int, ClientData]
    store: StateStore


def due(every: int, round: int, rounds: int) -> bool:
    """Whether a round is evaluated: every ``every`` rounds, and always the last one."""
    return round == rounds or (every > 0 and round % every == 0)


def capped(data: ImageSet, limit: int | None, seed: int) -> ImageSet:
    """A seeded random subset of at most ``limit`` images (all when ``limit`` is None)."""
    if limit is None or len(data) <= limit:
        return data
    idx = np.sort(np.random.default_rng(seed).choice(len(data), size=limit, replace=False))
    return data.subset(idx)


def personal_models(
    server: Server, population: Population, trained_only: bool = False
) -> Iterator[tuple[ClientData, ClientInfo, nn.ModuleDict]]:
    """Each client's personal model (one module, reloaded per client, in eval mode).

    ``trained_only`` skips clients that never trained (they have no values of their own).
    """
    model = copy.deepcopy(server.template).to(server.device)
    template = server.template.state_dict()
    for cid, data in sorted(population.clients.items()):
        memory = population.store.get(cid)
        if trained_only and (memory is None or memory.model is None):
            continue
        info = server.roster[cid]
        own = memory.model if memory is not None and memory.model is not None else template
        state = {k: v for k, v in server.pool[info.cluster or 0].items() if k in template}
        state.update({k: own[k] for k in server.private})
        model.load_state_dict(state, strict=False)
        yield data, info, model.eval()


def supervised_metrics(server: Server, population: Population) -> dict[str, Any]:
    """Personalised accuracy (mean over clients of their personal model on their local
    test set; each client's in ``client_accuracy``), F1/AUROC for clustered set-ups, and
    global test accuracy (pool of one)."""
    cfg = server.recipe.evaluation
    clustered = len(server.pool) > 1 or server.data.groups is not None
    per_client, predictions = {}, []
    for data, _, model in personal_models(server, population):
        per_client[str(data.id)] = accuracy(model, data.test, server.device)
        if clustered:
            predictions.append(predict(model, data.test, server.device))
    metrics: dict[str, Any] = {
        "personalized_accuracy": float(np.mean(list(per_client.values()))),
        "client_accuracy": per_client,
    }
    if clustered:
        metrics.update(personalized_metrics(predictions, server.data.num_classes))
    if len(server.pool) == 1:
        test = capped(server.data.test, cfg.max_eval, server.recipe.seed)
        metrics["test_accuracy"] = accuracy(server.model(0), test, server.device)
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


def representation_metrics(
    server: Server, protocol: str, population: Population | None = None
) -> dict[str, Any]:
    """Cluster 0's encoder scored with ``protocol``; with a ``population``, also every
    trained client's personal encoder (``personal_<metric>``: the mean over clients;
    ``client_<metric>``: each client's score)."""
    train, test = evaluation_sets(server)
    cfg, seed, device = server.recipe.evaluation, server.recipe.seed, server.device
    metrics = score_encoder(server.model(0)["encoder"], train, test, protocol, cfg, seed, device)
    if population is None:
        return metrics
    scores: dict[str, dict[str, Any]] = {}
    for data, _, model in personal_models(server, population, trained_only=True):
        scores[str(data.id)] = score_encoder(
            model["encoder"], train, test, protocol, cfg, seed, device
        )
    for name in next(iter(scores.values()), {}):
        values = {cid: s[name] for cid, s in scores.items()}
        metrics[f"personal_{name}"] = float(np.mean(list(values.values())))
        metrics[f"client_{name}"] = values
    return metrics


@torch.no_grad()
def evaluate_round(
    server: Server, population: Population, plugins: Plugins, round: int
) -> dict[str, Any]:
    """The core protocol's metrics plus every plugin's ``evaluate`` results, at the
    recipe's precision and layout."""
    with precision.compute(server.recipe, server.device):
        return _evaluate(server, population, plugins, round)


def _evaluate(
    server: Server, population: Population, plugins: Plugins, round: int
) -> dict[str, Any]:
    cfg = server.recipe.evaluation
    metrics: dict[str, Any] = identity_metrics(server)
    if not due(cfg.every, round, server.recipe.federation.rounds):
        return metrics
    if cfg.protocol == "supervised":
        metrics.update(supervised_metrics(server, population))
    elif cfg.protocol in ("knn", "linear", "semi"):
        with torch.enable_grad():
            personal = population if cfg.personal else None
            metrics.update(representation_metrics(server, cfg.protocol, personal))
    for extra in plugins.call("evaluate", server=server, round=round):
        metrics.update(extra or {})
    return metrics
