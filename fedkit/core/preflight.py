"""Everything checked before anything trains, in one place, once per run.

The schema (``fedkit.config.schema``) checks types and ranges; ``check`` adds what needs
the outside world: the names a recipe uses against what plugins registered (data set,
partitioner and its parameters, executor, store), timm's model list and the backbone's
input size, the data set's files, and the plugins themselves, which it builds (with
their options validated): the ``Plugins`` it returns are the run's server side.
"""

from __future__ import annotations

from typing import Any

import torch

from fedkit.config.schema import Recipe
from fedkit.data.datasets import check_data
from fedkit.data.partition import check_params
from fedkit.errors import RecipeError
from fedkit.models.backbones import check_backbone_name, create_backbone
from fedkit.plugin.manager import Plugins
from fedkit.plugin.registry import registries


def check_federation(recipe: Recipe) -> None:
    """The federation section fits the data section, and some plugin is named."""
    fed = recipe.federation
    if fed.clients_per_round > recipe.data.num_clients:
        raise RecipeError(
            "federation.clients_per_round",
            f"at most data.num_clients ({recipe.data.num_clients})",
            fed.clients_per_round,
        )
    if not recipe.plugins:
        raise RecipeError("plugins", "at least one plugin (see `fedkit plugins`)", [])


def check_input_size(recipe: Recipe) -> None:
    """The backbone must take images of ``data.image_size`` (a 1×1 image fails most)."""
    size = recipe.data.image_size
    encoder = create_backbone(recipe.backbone).eval()
    try:
        with torch.no_grad():
            encoder(torch.zeros(1, 3, size, size))
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise RecipeError(
            "data.image_size",
            f"a size backbone {recipe.backbone.name} can take (at {size}×{size}: {first})",
            size,
        ) from None


def check(recipe: Recipe, available: dict[str, Any] | None = None) -> Plugins:
    """Every check that needs no training; returns the run's server-side plugins.
    ``available``: the plugins to use instead of the installed ones (tests)."""
    check_federation(recipe)
    regs = registries(available)
    dataset = regs.datasets.get(recipe.data.dataset)
    partition = recipe.data.partition
    check_params(partition.name, regs.partitioners.get(partition.name), partition.params)
    regs.executors.get(recipe.engine.executor)
    if recipe.engine.store != "auto":
        regs.stores.get(recipe.engine.store)
    check_backbone_name(recipe.backbone.name)
    check_input_size(recipe)
    check_data(recipe.data, dataset)
    return Plugins(recipe, available)
