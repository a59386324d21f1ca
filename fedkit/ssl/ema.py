"""Parameter-wise moving average for BYOL-style target networks."""

from __future__ import annotations

import torch
from torch import nn


def _paired_params(dst: nn.Module, src: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    d, s = list(dst.parameters()), list(src.parameters())
    if len(d) != len(s):
        raise ValueError(f"modules differ: {len(d)} vs {len(s)} parameters")
    for i, (a, b) in enumerate(zip(d, s, strict=True)):
        if a.shape != b.shape:
            raise ValueError(
                f"parameter {i} differs in shape: {tuple(a.shape)} vs {tuple(b.shape)}"
            )
    return list(zip(d, s, strict=True))


@torch.no_grad()
def ema_update(target: nn.Module, online: nn.Module, m: float) -> None:
    """ξ ← m·ξ + (1−m)·θ for every parameter, in place and without autograd.

    Parameters only: buffers (e.g. BatchNorm running statistics) of ``target`` are left
    as they are, since the target computes its own statistics in its forward passes.
    """
    if not 0.0 <= m <= 1.0:
        raise ValueError(f"momentum m must be in [0, 1], got {m}")
    for xi, theta in _paired_params(target, online):
        xi.mul_(m).add_(theta.detach().to(xi.dtype), alpha=1.0 - m)


@torch.no_grad()
def copy_params(dst: nn.Module, src: nn.Module, *, buffers: bool = False) -> None:
    """Copy parameter values of ``src`` into ``dst`` in place (and buffers if asked).

    The modules must have the same structure; ``dst`` keeps its own tensors, so any
    optimiser holding them stays valid.
    """
    for a, b in _paired_params(dst, src):
        a.copy_(b)
    if buffers:
        db, sb = list(dst.buffers()), list(src.buffers())
        if len(db) != len(sb):
            raise ValueError(f"modules differ: {len(db)} vs {len(sb)} buffers")
        for a, b in zip(db, sb, strict=True):
            a.copy_(b)
