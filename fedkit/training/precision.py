"""Numeric precision and memory layout of training and evaluation: the recipe's
``precision`` (``fp32`` or ``bf16``) and ``channels_last``.

The engine enters ``compute`` around everything that runs models: each client's job
(wherever its worker runs), server-side set-up (``configure``: pre-training, public-set
features) and evaluation. Inside it, ``bf16`` is ``torch.autocast`` with bfloat16 on the
run's device (parameters, optimiser state and uploads stay float32; autocast runs
convolutions and matrix products in bfloat16 and keeps losses and reductions in float32),
and ``adopt_layout`` turns a model's 4-D weights to channels-last (the core fit loop
calls it on the model it trains; the server's template is converted once, so every
model copied from it starts channels-last).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING

import torch
from torch import nn

from fedkit.errors import RecipeError

if TYPE_CHECKING:
    from fedkit.config.schema import Recipe

_CHANNELS_LAST: ContextVar[bool] = ContextVar("fedkit_channels_last", default=False)


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes bfloat16 in hardware (CUDA with bf16 support; a CPU
    whose oneDNN build reports bf16 kernels, i.e. AVX-512 BF16 or AMX)."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return False


def check(precision: str, device: torch.device) -> list[str]:
    """Refuse a precision the device cannot run; return warnings for one it runs slowly."""
    if precision != "bf16":
        return []
    if device.type == "cuda" and not native_bf16(device):
        raise RecipeError(
            "precision",
            "fp32 (this CUDA device has no bfloat16 support; bf16 needs compute capability "
            "8.0 or newer)",
            precision,
        )
    if device.type == "cpu" and not native_bf16(device):
        return [
            "precision: bf16 on a CPU without bfloat16 instructions (no AVX-512 BF16 or AMX): "
            "it is emulated and runs several times slower than fp32 (see benchmarks/README.md)"
        ]
    return []


def padding_only_taps(encoder: nn.Module, image_size: int) -> list[str]:
    """Names of the 2-D convolutions in ``encoder`` with a kernel tap that sees only
    padding at ``image_size``×``image_size`` input (one forward pass of zeros).

    On CPUs with AVX-512 BF16, PyTorch's bf16 weight gradient leaves uninitialised values,
    often NaN, in such taps, where the true gradient is zero; the non-finite check then
    refuses the client's upload at random."""
    found: list[str] = []

    def inspect(name: str, conv: nn.Conv2d, x: torch.Tensor) -> None:
        if isinstance(conv.padding, str) or conv.padding_mode != "zeros":
            return  # "same"/"valid", or padding that copies real pixels
        for dim in (0, 1):
            n, k = x.shape[2 + dim], conv.kernel_size[dim]
            s, p, d = conv.stride[dim], conv.padding[dim], conv.dilation[dim]
            out = (n + 2 * p - d * (k - 1) - 1) // s + 1
            if any(all(not 0 <= o * s - p + t * d < n for o in range(out)) for t in range(k)):
                found.append(name)
                return

    convs = [(n, m) for n, m in encoder.named_modules() if isinstance(m, nn.Conv2d)]
    hooks = [m.register_forward_pre_hook(lambda m, a, n=n: inspect(n, m, a[0])) for n, m in convs]
    was_training = encoder.training
    try:
        with torch.no_grad():
            encoder.eval()(torch.zeros(1, 3, image_size, image_size))
    except RuntimeError:
        return []  # the input is too small for the model: the run itself will say so
    finally:
        for hook in hooks:
            hook.remove()
        encoder.train(was_training)
    return found


def bf16_hazards(
    encoder: nn.Module, image_size: int, precision: str, device: torch.device
) -> list[str]:
    """A warning when a bf16 run on a CPU with native bf16 trains convolutions with
    padding-only taps (see ``padding_only_taps``); none otherwise."""
    if precision != "bf16" or device.type != "cpu" or not native_bf16(device):
        return []
    taps = padding_only_taps(encoder, image_size)
    if not taps:
        return []
    return [
        f"precision: bf16 at image_size {image_size}: {len(taps)} convolution(s) of the encoder "
        f"({', '.join(taps[:3])}{', …' if len(taps) > 3 else ''}) have kernel taps that see "
        "only padding, where PyTorch's bf16 gradient on this CPU can be NaN and the client's "
        "upload is then refused; use a larger image_size, backbone.cifar_stem (ResNets) or fp32 "
        "(docs/recipes.md)"
    ]


def warnings(recipe: Recipe, device: torch.device, model: nn.ModuleDict | None) -> list[str]:
    """Everything a user should hear about the recipe's precision on ``device`` before
    the rounds start: ``check``'s refusals and warnings, then ``bf16_hazards`` of the
    model's ``encoder`` (when it has one)."""
    found = check(recipe.precision, device)
    if model is not None and "encoder" in model:
        found += bf16_hazards(model["encoder"], recipe.data.image_size, recipe.precision, device)
    return found


@contextlib.contextmanager
def compute(recipe: Recipe, device: torch.device) -> Iterator[None]:
    """Run a block at the recipe's ``precision`` and ``channels_last`` on ``device``."""
    token = _CHANNELS_LAST.set(recipe.channels_last)
    try:
        # No weight-cast cache: the block spans many optimiser steps, and a cached bf16
        # copy of a parameter would keep its value from the block's first forward pass.
        bf16 = recipe.precision == "bf16"
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16, cache_enabled=False):
            yield
    finally:
        _CHANNELS_LAST.reset(token)


def adopt_layout(model: nn.Module) -> nn.Module:
    """``model`` with channels-last 4-D weights inside a ``compute`` block that asks for
    them (in place; parameters stay the same objects, so an optimiser holding them stays
    valid); unchanged otherwise."""
    if _CHANNELS_LAST.get():
        model.to(memory_format=torch.channels_last)
    return model
