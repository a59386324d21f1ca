"""Simulation-only knowledge, and the measurements only a simulation can make.

A simulation knows what no party of a real federation knows: the global test set, every
client's training images pooled, and the partition's true groups. The ``Evaluator`` holds
them, for the engine alone: no hook receives it, and the ``Server`` holds none of it. It
scores the server's global model (cluster 0) on the global test set or, for
representation protocols, on the pooled client images; it measures how well the clients'
reported clusters match the true groups (ARI); and it lends each client the benchmark sets
its own encoder is scored on (``evaluation.personal``), so that scores of different
clients are comparable. Client data and client memory never pass through it: a client's
personal model is scored on the client.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fedkit.config.schema import Recipe
from fedkit.core.worker import Benchmark
from fedkit.data.datasets import ImageSet
from fedkit.data.federated import FederatedData
from fedkit.evaluation.metrics import adjusted_rand
from fedkit.evaluation.scoring import capped, score_encoder, supervised_scores
from fedkit.plugin.server import ClientInfo, Server

REPRESENTATION = ("knn", "linear", "semi")


def due(every: int, round: int, rounds: int) -> bool:
    """Whether a round is evaluated: every ``every`` rounds, and always the last one."""
    return round == rounds or (every > 0 and round % every == 0)


def monitored(every: int, round: int) -> bool:
    """Whether the kNN monitor runs this round (``evaluation.monitor_every``)."""
    return every > 0 and round % every == 0


class Evaluator:
    """What only the simulation knows (see the module docstring)."""

    def __init__(self, recipe: Recipe, data: FederatedData) -> None:
        cfg, seed = recipe.evaluation, recipe.seed
        self.recipe = recipe
        self.groups = data.groups
        self.test = capped(data.test, cfg.max_eval, seed)
        self._pooled: ImageSet | None = None
        if cfg.protocol in REPRESENTATION:
            clients = np.concatenate(data.clients)
            self._pooled = capped(data.train.subset(np.sort(clients)), cfg.max_eval, seed)

    def benchmark(self) -> Benchmark | None:
        """The sets each client's own encoder is scored on, when the recipe asks for it."""
        cfg = self.recipe.evaluation
        if cfg.protocol in REPRESENTATION and cfg.personal and self._pooled is not None:
            return self._pooled, self.test
        return None

    def client_scores(self, pool_size: int) -> tuple[str, ...]:
        """What the core's protocol asks of each client's personal model."""
        cfg = self.recipe.evaluation
        if cfg.protocol == "supervised":
            clustered = pool_size > 1 or self.groups is not None
            return ("accuracy", "f1", "auroc") if clustered else ("accuracy",)
        if cfg.protocol in REPRESENTATION and cfg.personal:
            return ("encoder",)
        return ()

    def identity(self, roster: Sequence[ClientInfo], round: int) -> dict[str, Any]:
        """ARI against the partition's true groups of every client's latest reported
        identity (``ari``) and of this round's clients only (``ari_round``; with partial
        participation the others keep older identities), and the number of distinct
        clusters in use."""
        if self.groups is None:
            return {}
        placed = [c for c in roster if c.cluster is not None]
        if not placed:
            return {}
        groups = self.groups
        sampled = [c for c in placed if c.last_round == round]
        found = [c.cluster for c in placed]
        return {
            "ari": adjusted_rand(found, [groups[c.id] for c in placed]),
            "ari_round": adjusted_rand(
                [c.cluster for c in sampled], [groups[c.id] for c in sampled]
            ),
            "clusters_used": len(set(found)),
        }

    def monitor(self, server: Server) -> dict[str, Any]:
        """The kNN monitor of cluster 0's encoder on the pooled client images
        (``knn_accuracy``), whatever the recipe's protocol."""
        return self._encoder_scores(server, "knn")

    def _encoder_scores(self, server: Server, protocol: str) -> dict[str, Any]:
        """Cluster 0's encoder scored with ``protocol`` on the pooled client images."""
        if self._pooled is None:
            return {}
        cfg, device = self.recipe.evaluation, server.device
        with torch.enable_grad():
            encoder = server.model(0)["encoder"]
            return score_encoder(
                encoder, self._pooled, self.test, protocol, cfg, self.recipe.seed, device
            )

    def global_model(self, server: Server) -> dict[str, Any]:
        """Cluster 0's model on the global test set (supervised, with a pool of one), or
        its encoder with the representation protocol on the pooled client images."""
        cfg, device = self.recipe.evaluation, server.device
        if cfg.protocol == "supervised":
            if len(server.pool) != 1:
                return {}
            scores = supervised_scores(server.model(0), self.test, device, ("accuracy",))
            return {"test_accuracy": scores.get("accuracy", 0.0)}
        if cfg.protocol in REPRESENTATION:
            return self._encoder_scores(server, cfg.protocol)
        return {}
