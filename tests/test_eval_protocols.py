"""Behaviour checks of the evaluation protocols and metrics on synthetic data."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import adjusted_rand_score, f1_score, roc_auc_score
from torch import nn

from fedkit.evaluation.features import extract_features
from fedkit.evaluation.metrics import accuracy, adjusted_rand, auroc, macro_f1, relevance_score
from fedkit.evaluation.protocols import (
    class_balanced_subset,
    knn_accuracy,
    linear_probe,
    semi_supervised,
)


def _clusters(n_per: int, num_classes: int, dim: int, noise: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    centres = torch.eye(dim)[:num_classes] * 4.0
    labels = torch.arange(num_classes).repeat_interleave(n_per)
    feats = centres[labels] + noise * torch.randn(len(labels), dim, generator=g)
    return feats, labels


def _colour_images(n_per: int, seed: int, dtype=torch.uint8):
    """3 classes of 8×8 images, each class brightest in its own channel."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(3).repeat_interleave(n_per)
    base = torch.full((len(labels), 3, 8, 8), 40.0)
    base[torch.arange(len(labels)), labels] = 200.0
    imgs = (base + 30 * torch.randn(base.shape, generator=g)).clamp(0, 255)
    return imgs.to(dtype), labels


def _small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )


# ---------------------------------------------------------------- features


def test_extract_features_eval_mode_batches_and_restores_mode():
    enc = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5), nn.Flatten())
    enc.train()
    x = torch.randn(7, 3, 5, 5)
    feats = extract_features(enc, x, batch_size=3)
    assert enc.training
    enc.eval()
    with torch.no_grad():
        assert torch.allclose(feats, enc(x), atol=1e-6)
    assert not feats.requires_grad


def test_extract_features_normalises_uint8():
    enc = nn.Flatten()
    x = torch.randint(0, 256, (2, 3, 2, 2), dtype=torch.uint8)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.1, 0.3)
    expect = (x.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(
        1, 3, 1, 1
    )
    got = extract_features(enc, x, mean=mean, std=std)
    assert torch.allclose(got, expect.flatten(1), atol=1e-6)


# ---------------------------------------------------------------- protocols


def test_knn_separable_clusters_is_perfect():
    tr, ytr = _clusters(20, 3, 8, 0.3, seed=0)
    te, yte = _clusters(10, 3, 8, 0.3, seed=1)
    assert knn_accuracy(tr, ytr, te, yte, num_classes=3) == pytest.approx(1.0)
    assert knn_accuracy(tr, ytr, te, yte, num_classes=3, k=1) == pytest.approx(1.0)


def test_knn_random_labels_near_chance():
    g = torch.Generator().manual_seed(0)
    tr, te = torch.randn(500, 16, generator=g), torch.randn(500, 16, generator=g)
    ytr = torch.randint(0, 10, (500,), generator=g)
    yte = torch.randint(0, 10, (500,), generator=g)
    assert knn_accuracy(tr, ytr, te, yte, num_classes=10, k=50) < 0.2


def test_linear_probe_separable_and_seeded():
    tr, ytr = _clusters(50, 4, 6, 0.5, seed=0)
    te, yte = _clusters(25, 4, 6, 0.5, seed=1)
    acc = linear_probe(tr, ytr, te, yte, num_classes=4, epochs=100, batch_size=64, seed=3)
    assert acc > 0.9
    again = linear_probe(tr, ytr, te, yte, num_classes=4, epochs=100, batch_size=64, seed=3)
    assert acc == again


def test_class_balanced_subset_counts():
    labels = np.array([0] * 100 + [1] * 50 + [2] * 3)
    idx = class_balanced_subset(labels, 0.1, seed=0)
    counts = np.bincount(labels[idx], minlength=3)
    assert counts.tolist() == [10, 5, 1]
    assert len(np.unique(idx)) == len(idx) and np.all(np.diff(idx) > 0)
    assert np.array_equal(idx, class_balanced_subset(torch.as_tensor(labels), 0.1, seed=0))
    assert not np.array_equal(idx, class_balanced_subset(labels, 0.1, seed=1))
    assert len(class_balanced_subset(labels, 0.001, seed=0)) == 3
    with pytest.raises(ValueError):
        class_balanced_subset(labels, 0.0, seed=0)


@pytest.mark.parametrize("augment", [False, True])
def test_semi_supervised_learns_and_leaves_encoder_untouched(augment):
    xtr, ytr = _colour_images(20, seed=0)
    xte, yte = _colour_images(10, seed=1)
    enc = _small_cnn()
    before = [p.clone() for p in enc.parameters()]
    opts = dict(epochs=30, lr=1e-2, batch_size=16, seed=0, mean=(0.5,) * 3, std=(0.25,) * 3)
    acc = semi_supervised(enc, xtr, ytr, xte, yte, 3, 0.5, augment=augment, **opts)
    assert acc > 0.9
    assert all(torch.equal(a, b) for a, b in zip(before, enc.parameters(), strict=True))


def test_semi_supervised_accepts_factory_and_rejects_float_augment():
    xtr, ytr = _colour_images(6, seed=0)
    acc = semi_supervised(_small_cnn, xtr, ytr, xtr, ytr, 3, 1.0, epochs=1, batch_size=8)
    assert 0.0 <= acc <= 1.0
    with pytest.raises(ValueError):
        semi_supervised(_small_cnn, xtr.float(), ytr, xtr, ytr, 3, 1.0, epochs=1, augment=True)


# ---------------------------------------------------------------- metrics


def test_accuracy_from_logits_and_labels():
    logits = torch.tensor([[2.0, 1.0], [0.0, 3.0], [5.0, 1.0], [0.0, 1.0]])
    labels = torch.tensor([0, 1, 1, 1])
    assert accuracy(logits, labels) == pytest.approx(0.75)
    assert accuracy(torch.tensor([0, 0, 1, 0]), labels) == pytest.approx(0.5)


def test_macro_f1_matches_sklearn():
    rng = np.random.default_rng(0)
    y, p = rng.integers(0, 5, 100), rng.integers(0, 5, 100)
    assert macro_f1(torch.as_tensor(p), torch.as_tensor(y), 5) == pytest.approx(
        f1_score(y, p, average="macro")
    )
    sub_y, sub_p = np.array([1, 1, 3, 3]), np.array([1, 3, 3, 3])
    assert macro_f1(sub_p, sub_y, num_classes=10) == pytest.approx(
        f1_score(sub_y, sub_p, average="macro")
    )


def test_auroc_matches_sklearn_and_handles_absent_classes():
    rng = np.random.default_rng(1)
    probs = torch.softmax(torch.as_tensor(rng.normal(size=(60, 4))), dim=1).numpy()
    y = np.arange(60) % 4
    expect = roc_auc_score(y, probs, multi_class="ovr", average="macro")
    assert auroc(probs, y, 4) == pytest.approx(expect)
    y_sub = np.where(y == 3, 0, y)  # class 3 absent
    got = auroc(probs, y_sub, 4)
    per_class = [roc_auc_score(y_sub == c, probs[:, c]) for c in (0, 1, 2)]
    assert got == pytest.approx(np.mean(per_class))
    assert np.isnan(auroc(probs, np.zeros(60, dtype=int), 4))


def test_adjusted_rand_matches_sklearn_and_ignores_naming():
    truth = [0, 0, 1, 1, 2, 2]
    assert adjusted_rand([2, 2, 0, 0, 1, 1], truth) == pytest.approx(1.0)
    pred = [0, 1, 1, 1, 2, 0]
    assert adjusted_rand(pred, truth) == pytest.approx(adjusted_rand_score(truth, pred))


def test_relevance_score_self_beats_noise():
    g = torch.Generator().manual_seed(0)
    pattern = torch.rand(1, 3, 6, 6, generator=g)
    a = pattern + 0.05 * torch.randn(400, 3, 6, 6, generator=g)
    noise = torch.randn(400, 3, 6, 6, generator=g)
    enc = nn.Flatten()
    same = relevance_score(enc, a, a, n=300, seed=0)
    cross = relevance_score(enc, a, noise, n=300, seed=0)
    assert same > 0.9 and abs(cross) < 0.2 and same > cross
    assert relevance_score(enc, a, noise, n=300, seed=0) == cross
