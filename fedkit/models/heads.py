"""MLP heads: SSL projectors/predictors and classifier head variants."""

from __future__ import annotations

from torch import nn

CLASSIFIER_VARIANTS = ("c", "c-1", "c-2", "c-3")


def mlp(
    in_dim: int,
    hidden_dim: int,
    out_dim: int,
    *,
    layers: int = 2,
    bn_hidden: bool = True,
    bn_last: bool = False,
) -> nn.Sequential:
    """Linear layers with BN+ReLU between them: in → hidden → [BN] → ReLU → … → out [→ BN].

    ``layers`` counts Linear layers. ``mlp(d, 4096, 2048)`` is the BYOL family's projector
    and predictor (the BYOL tutorial page); ``mlp(d, 512, 512,
    bn_last=True)`` is the small BYOL projector used for server pre-training.
    """
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    modules: list[nn.Module] = []
    dim = in_dim
    for _ in range(layers - 1):
        modules.append(nn.Linear(dim, hidden_dim))
        if bn_hidden:
            modules.append(nn.BatchNorm1d(hidden_dim))
        modules.append(nn.ReLU(inplace=True))
        dim = hidden_dim
    modules.append(nn.Linear(dim, out_dim))
    if bn_last:
        modules.append(nn.BatchNorm1d(out_dim))
    return nn.Sequential(*modules)


def classifier_head(
    in_dim: int, num_classes: int, variant: str = "c", hidden: int = 128
) -> nn.Sequential:
    """Classifier head θ_c: "c" is one Linear; "c-k" adds k Linear+ReLU layers first."""
    if variant not in CLASSIFIER_VARIANTS:
        raise ValueError(f"variant must be one of {CLASSIFIER_VARIANTS}, got {variant!r}")
    extra = 0 if variant == "c" else int(variant[2:])
    modules: list[nn.Module] = []
    dim = in_dim
    for _ in range(extra):
        modules += [nn.Linear(dim, hidden), nn.ReLU(inplace=True)]
        dim = hidden
    modules.append(nn.Linear(dim, num_classes))
    return nn.Sequential(*modules)
