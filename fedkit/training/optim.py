"""The recipe's optimiser and its learning rate per round (constant or cosine)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from fedkit.config.schema import FederationConfig


def round_lr(cfg: FederationConfig, round: int) -> float:
    """The learning rate for a (1-based) round: constant, or cosine decay across rounds."""
    base = cfg.optimizer.lr
    if cfg.lr_schedule.name == "cosine":
        return 0.5 * base * (1.0 + math.cos(math.pi * (round - 1) / cfg.rounds))
    return base


def make_optimizer(
    params: Iterable[nn.Parameter], cfg: FederationConfig, round: int
) -> torch.optim.Optimizer:
    """The recipe's optimiser at this round's learning rate."""
    opt, lr = cfg.optimizer, round_lr(cfg, round)
    if opt.name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
    if opt.name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=opt.weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=opt.weight_decay)
