"""Evaluation of learned representations: features, protocols, metrics."""

from fedkit.evaluation.features import extract_features
from fedkit.evaluation.metrics import (
    accuracy,
    adjusted_rand,
    auroc,
    macro_f1,
    relevance_score,
)
from fedkit.evaluation.protocols import (
    class_balanced_subset,
    knn_accuracy,
    linear_probe,
    semi_supervised,
)

__all__ = [
    "accuracy",
    "adjusted_rand",
    "auroc",
    "class_balanced_subset",
    "extract_features",
    "knn_accuracy",
    "linear_probe",
    "macro_f1",
    "relevance_score",
    "semi_supervised",
]
