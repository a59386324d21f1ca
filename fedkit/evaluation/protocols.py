"""Evaluation protocols for learned representations: kNN monitor, linear probe,
semi-supervised fine-tuning. All return accuracy as a fraction in [0, 1], measured
at the end of training (never the best epoch on the test set).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedkit.evaluation.features import extract_features, module_device, prepare_images
from fedkit.ssl.augment import TwoViewAugment
from fedkit.training.loop import Objective, run_loop


def _as_long(labels: Tensor | np.ndarray | Sequence[int]) -> Tensor:
    return torch.as_tensor(np.asarray(labels) if not isinstance(labels, Tensor) else labels).long()


@torch.no_grad()
def knn_accuracy(
    train_feats: Tensor,
    train_labels: Tensor,
    test_feats: Tensor,
    test_labels: Tensor,
    num_classes: int,
    k: int = 200,
    temperature: float = 0.1,
    *,
    chunk_size: int = 1024,
) -> float:
    """Weighted kNN classifier on cosine similarity (the usual SSL training monitor).

    Each test feature votes over its k most similar train features (k is clipped to the
    train size) with weight exp(sim/τ); the class with the largest total wins.
    """
    train = F.normalize(train_feats.float(), dim=1)
    test = F.normalize(test_feats.float().to(train.device), dim=1)
    ytrain = _as_long(train_labels).to(train.device)
    ytest = _as_long(test_labels).to(train.device)
    if train.shape[0] == 0 or test.shape[0] == 0:
        raise ValueError("knn_accuracy needs non-empty train and test features")
    k = max(1, min(k, train.shape[0]))
    correct = 0
    for start in range(0, test.shape[0], chunk_size):
        sim = test[start : start + chunk_size] @ train.t()
        top_sim, top_idx = sim.topk(k, dim=1)
        weights = torch.exp(top_sim / temperature)
        votes = torch.zeros(sim.shape[0], num_classes, device=train.device)
        votes.scatter_add_(1, ytrain[top_idx], weights)
        correct += (votes.argmax(dim=1) == ytest[start : start + chunk_size]).sum().item()
    return correct / test.shape[0]


def _cross_entropy(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def _seeded_linear(in_dim: int, out_dim: int, seed: int) -> nn.Linear:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(in_dim, out_dim)


def linear_probe(
    train_feats: Tensor,
    train_labels: Tensor,
    test_feats: Tensor,
    test_labels: Tensor,
    num_classes: int,
    epochs: int = 200,
    lr: float = 3e-3,
    batch_size: int = 2048,
    seed: int = 0,
    *,
    device: torch.device | str | None = None,
) -> float:
    """Train a linear classifier (Adam) on frozen, cached features; final test accuracy.

    Features are used as given (no normalisation). Shuffling and the classifier's
    initialisation are seeded; the global RNG is left untouched.
    """
    dev = torch.device(device) if device is not None else train_feats.device
    xtr, ytr = train_feats.float().to(dev), _as_long(train_labels).to(dev)
    xte, yte = test_feats.float().to(dev), _as_long(test_labels).to(dev)
    clf = _seeded_linear(xtr.shape[1], num_classes, seed).to(dev)
    opt = torch.optim.Adam(clf.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)

    def epoch() -> Iterator[tuple[Tensor, Tensor]]:
        perm = torch.randperm(xtr.shape[0], generator=g).to(dev)
        for start in range(0, xtr.shape[0], batch_size):
            idx = perm[start : start + batch_size]
            yield xtr[idx], ytr[idx]

    run_loop(clf, Objective(_cross_entropy, epoch), opt, epochs)
    with torch.no_grad():
        return (clf(xte).argmax(dim=1) == yte).float().mean().item()


def class_balanced_subset(
    labels: Tensor | np.ndarray | Sequence[int], fraction: float, seed: int
) -> np.ndarray:
    """Sorted indices of a seeded subset with round(fraction·n_c) samples of each class c
    (at least one per class present in ``labels``)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    y = _as_long(labels).cpu().numpy()
    rng = np.random.default_rng(seed)
    picked = []
    for c in np.unique(y):
        members = np.flatnonzero(y == c)
        take = min(len(members), max(1, int(round(fraction * len(members)))))
        picked.append(rng.choice(members, size=take, replace=False))
    if not picked:
        return np.empty(0, dtype=np.int64)
    return np.sort(np.concatenate(picked)).astype(np.int64)


def _feature_dim(encoder: nn.Module, sample: Tensor) -> int:
    was_training = encoder.training
    encoder.eval()
    with torch.no_grad():
        dim = encoder(sample).flatten(1).shape[1]
    encoder.train(was_training)
    return dim


def semi_supervised(
    encoder: nn.Module | Callable[[], nn.Module],
    train_images: Tensor,
    train_labels: Tensor,
    test_images: Tensor,
    test_labels: Tensor,
    num_classes: int,
    fraction: float,
    epochs: int = 100,
    lr: float = 1e-3,
    batch_size: int = 256,
    seed: int = 0,
    device: torch.device | str | None = None,
    augment: bool = False,
    *,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    eval_batch_size: int = 512,
) -> float:
    """Fine-tune a copy of the whole encoder plus a new linear classifier on a
    class-balanced ``fraction`` of the labelled train set (Adam); final test accuracy.

    ``encoder`` is an ``nn.Module`` (deep-copied, the original is untouched) or a factory
    returning a fresh one. ``lr``/``batch_size`` defaults are fedkit's, not the papers'.
    Images follow the evaluation convention (uint8 → scaled and normalised with
    ``mean``/``std``; float → model-ready). ``augment=True`` applies batched random
    resized crop + horizontal flip (no colour ops) and needs uint8 images. A last
    batch of a single sample is skipped (BatchNorm needs two).
    """
    if augment and train_images.dtype != torch.uint8:
        raise ValueError("augment=True needs uint8 train images (augmentation works on [0, 1])")
    model = copy.deepcopy(encoder) if isinstance(encoder, nn.Module) else encoder()
    dev = torch.device(device) if device is not None else module_device(model)
    model.to(dev)
    idx = torch.from_numpy(class_balanced_subset(train_labels, fraction, seed))
    x_lab = train_images[idx]
    y_lab = _as_long(train_labels)[idx]
    probe = prepare_images(x_lab[:2].to(dev), mean, std)
    head = _seeded_linear(_feature_dim(model, probe), num_classes, seed).to(dev)
    net = nn.Sequential(model, nn.Flatten(1), head)
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    aug = None
    if augment:
        c_mean = mean if mean is not None else (0.0, 0.0, 0.0)
        c_std = std if std is not None else (1.0, 1.0, 1.0)
        size = tuple(x_lab.shape[-2:])
        aug = TwoViewAugment(size, c_mean, c_std, jitter_p=0.0, gray_p=0.0)
    n = x_lab.shape[0]

    def epoch() -> Iterator[tuple[Tensor, Tensor]]:
        perm = torch.randperm(n, generator=g)
        for start in range(0, n, batch_size):
            bidx = perm[start : start + batch_size]
            if bidx.numel() < 2:
                continue
            xb = x_lab[bidx].to(dev)
            xb = aug.augment_one(xb, g) if aug is not None else prepare_images(xb, mean, std)
            yield xb, y_lab[bidx].to(dev)

    run_loop(net, Objective(_cross_entropy, epoch), opt, epochs)
    logits = extract_features(net, test_images, eval_batch_size, dev, mean=mean, std=std)
    return (logits.argmax(dim=1) == _as_long(test_labels)).float().mean().item()
