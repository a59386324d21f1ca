"""Scoring one model: a supervised model on an image set (accuracy, macro F1, AUROC), an
encoder with a representation protocol (kNN monitor, linear probe, semi-supervised
fine-tuning). The engine uses these on the server's global model and, on each client,
on the client's personal model."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from fedkit.config.schema import EvaluationConfig
from fedkit.data.datasets import ImageSet
from fedkit.evaluation.features import extract_features
from fedkit.evaluation.metrics import auroc, macro_f1
from fedkit.evaluation.protocols import knn_accuracy, linear_probe, semi_supervised
from fedkit.models.backbones import logits
from fedkit.training.batching import batches, normalize
from fedkit.training.supervised import accuracy

SUPERVISED_SCORES = ("accuracy", "f1", "auroc")
"""What ``supervised_scores`` can compute (a clustered set-up adds F1 and AUROC)."""


def capped(data: ImageSet, limit: int | None, seed: int) -> ImageSet:
    """A seeded random subset of at most ``limit`` images (all when ``limit`` is None)."""
    if limit is None or len(data) <= limit:
        return data
    idx = np.sort(np.random.default_rng(seed).choice(len(data), size=limit, replace=False))
    return data.subset(idx)


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


def supervised_scores(
    model: nn.ModuleDict, data: ImageSet, device: torch.device, scores: tuple[str, ...]
) -> dict[str, float]:
    """The ``scores`` of a supervised model on ``data``: ``accuracy``, macro ``f1`` and
    one-vs-rest ``auroc`` over the classes present. An empty set gives no score, and
    AUROC none when fewer than two classes are present (it is undefined)."""
    out: dict[str, float] = {}
    if len(data) == 0:
        return out
    if "accuracy" in scores:
        out["accuracy"] = accuracy(model, data, device)
    if "f1" in scores or "auroc" in scores:
        probs, labels = predict(model, data, device)
        if "f1" in scores:
            out["f1"] = macro_f1(probs.argmax(1), labels, data.num_classes)
        if "auroc" in scores:
            value = auroc(probs, labels, data.num_classes)
            if not np.isnan(value):
                out["auroc"] = value
    return out


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
