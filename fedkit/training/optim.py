"""The recipe's optimiser and its learning rate per round (constant or cosine)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from fedkit.config.schema import FederationConfig, OptimizerConfig
from fedkit.errors import since_v3


def round_lr(cfg: FederationConfig, round: int) -> float:
    """The learning rate for a (1-based) round: constant, or cosine decay across rounds.
    The engine computes it once per round and sends it in every job (``ctx.lr``)."""
    base = cfg.optimizer.lr
    if cfg.lr_schedule.name == "cosine":
        return 0.5 * base * (1.0 + math.cos(math.pi * (round - 1) / cfg.rounds))
    return base


def make_optimizer(
    params: Iterable[nn.Parameter], opt: OptimizerConfig, lr: float
) -> torch.optim.Optimizer:
    """The recipe's optimiser (``federation.optimizer``) at the learning rate it is given:
    on a client, ``ctx.lr``, the round's rate the server sent."""
    if not isinstance(opt, OptimizerConfig):  # the old call: (params, federation, round)
        raise TypeError(since_v3("make_optimizer(federation, round)"))
    if opt.name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
    if opt.name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=opt.weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=opt.weight_decay)
