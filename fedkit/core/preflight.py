"""Checks a validated recipe against what is installed and on disk, before any work.

The schema (``fedkit.config.schema``) checks types and ranges; these checks need the outside
world: installed plugins, timm's model list, partitioners, dataset folders.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fedkit.config.schema import DataConfig, Recipe
from fedkit.data.datasets import check_dataset_name
from fedkit.data.partition import partitioner
from fedkit.errors import RecipeError
from fedkit.models.backbones import check_backbone_name, create_backbone
from fedkit.plugin.manager import Plugins


def check_data(recipe: Recipe) -> None:
    data = recipe.data
    check_dataset_name(data.dataset)
    downloads = data.download and data.dataset != "imagefolder"  # a folder cannot be fetched
    if data.dataset != "digits" and not downloads:
        if data.root is None:
            raise RecipeError(
                "data.root",
                f"a directory holding the {data.dataset} files",
                None,
                hint=_root_hint(data),
            )
        if not Path(data.root).expanduser().is_dir():
            raise RecipeError(
                "data.root", "an existing directory", data.root, hint=_root_hint(data)
            )
    partitioner(data)


def _root_hint(data: DataConfig) -> str:
    """How to get the data when ``data.root`` is missing (docs/data.md has the details)."""
    if data.dataset == "imagefolder":
        return (
            " (a folder with train/<class>/ and test/<class>/ image folders; for CIFAR-10,"
            " --set data.dataset=cifar10 --set data.download=true fetches torchvision's"
            " files instead; see docs/data.md)"
        )
    return f" (set data.download: true to fetch {data.dataset} there; see docs/data.md)"


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


def check_recipe(recipe: Recipe) -> Plugins:
    """Every check that needs no training; returns the activated plugins."""
    fed = recipe.federation
    if fed.clients_per_round > recipe.data.num_clients:
        raise RecipeError(
            "federation.clients_per_round",
            f"at most data.num_clients ({recipe.data.num_clients})",
            fed.clients_per_round,
        )
    if not recipe.plugins:
        raise RecipeError("plugins", "at least one plugin (see `fedkit plugins`)", [])
    check_backbone_name(recipe.backbone.name)
    check_input_size(recipe)
    check_data(recipe)
    return Plugins(recipe)
