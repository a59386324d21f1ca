"""Classification and clustering metrics, plus the relevance score of a pre-training set.

scikit-learn is imported by the three scores that use it, when they are called: every Ray
actor, Flower node and ``fedkit run`` imports this module, and most runs score accuracy only
(``tests/test_evaluation_imports.py``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedkit.evaluation.features import extract_features


def _np(x: Tensor | np.ndarray | Sequence) -> np.ndarray:
    if isinstance(x, Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def accuracy(logits: Tensor, labels: Tensor) -> float:
    """Fraction of correct predictions; ``logits`` is N×C scores or N predicted labels."""
    pred = logits.argmax(dim=1) if logits.dim() == 2 else logits
    if pred.shape[0] == 0:
        return float("nan")
    return (pred.cpu().long() == labels.cpu().long()).float().mean().item()


def macro_f1(pred: Tensor | np.ndarray, labels: Tensor | np.ndarray, num_classes: int) -> float:
    """Macro F1 over the classes that occur in ``labels`` or ``pred``.

    Classes absent from both are skipped (a client's local test set holds a few classes
    only); ``num_classes`` is used to check the label range.
    """
    p, y = _np(pred).astype(np.int64), _np(labels).astype(np.int64)
    for name, arr in (("pred", p), ("labels", y)):
        if arr.size and (arr.min() < 0 or arr.max() >= num_classes):
            raise ValueError(f"{name} outside [0, {num_classes})")
    from sklearn.metrics import f1_score

    return float(f1_score(y, p, average="macro", zero_division=0))


def auroc(probs: Tensor | np.ndarray, labels: Tensor | np.ndarray, num_classes: int) -> float:
    """One-vs-rest macro AUROC over the classes present in ``labels``.

    ``probs`` is N×C class probabilities (or any per-class scores). A class that is
    absent from ``labels`` has no positives and is skipped; if fewer than two classes
    are present the AUROC is undefined and NaN is returned.
    """
    s, y = _np(probs), _np(labels).astype(np.int64)
    if s.ndim != 2 or s.shape[1] != num_classes:
        raise ValueError(f"probs must be N×{num_classes}, got shape {s.shape}")
    present = np.unique(y)
    if present.size < 2:
        return float("nan")
    from sklearn.metrics import roc_auc_score

    return float(np.mean([roc_auc_score(y == c, s[:, c]) for c in present]))


def adjusted_rand(
    pred_groups: Sequence[int] | np.ndarray, true_groups: Sequence[int] | np.ndarray
) -> float:
    """Adjusted Rand index between a found clustering and the true one (label-permutation free)."""
    from sklearn.metrics import adjusted_rand_score

    return float(adjusted_rand_score(_np(true_groups), _np(pred_groups)))


def relevance_score(
    encoder: nn.Module,
    images_a: Tensor,
    images_b: Tensor,
    n: int = 300,
    seed: int = 0,
    *,
    batch_size: int = 512,
    device: torch.device | str | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> float:
    """Relevance of two image sets: mean cosine similarity over all pairs of
    ``n`` encoded images drawn (seeded, without replacement) from each set."""
    g = torch.Generator().manual_seed(seed)
    ia = torch.randperm(images_a.shape[0], generator=g)[:n]
    ib = torch.randperm(images_b.shape[0], generator=g)[:n]
    fa = extract_features(encoder, images_a[ia], batch_size, device, mean=mean, std=std)
    fb = extract_features(encoder, images_b[ib], batch_size, device, mean=mean, std=std)
    return (F.normalize(fa, dim=1) @ F.normalize(fb, dim=1).t()).mean().item()


def mean_direction(
    encoder: nn.Module,
    images: Tensor,
    device: torch.device | str | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    *,
    batch_size: int = 512,
) -> Tensor:
    """The mean of the L2-normalised features of ``images`` (on the CPU, float32).

    The mean cosine similarity over all pairs of two image sets is the dot product of
    their mean directions, so two parties can compute it by exchanging one vector each.
    """
    features = extract_features(encoder, images, batch_size, device, mean=mean, std=std)
    return F.normalize(features.float(), dim=1).mean(0).cpu()
