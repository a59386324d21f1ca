"""Evaluate a finished (or interrupted) run's encoder after the fact: ``fedkit eval``.

The encoder comes from the run directory's newest checkpoint (cluster 0's, or one
client's own with ``client``); the data is the run's recipe with overrides, so the same
encoder can be scored on another data set (transfer). The protocol learns from the whole
train split (``data.max_train`` limits it) and is scored on the test split, both capped
by ``evaluation.max_eval``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedkit.config.schema import Recipe, load_recipe
from fedkit.core.engine import resolve_device
from fedkit.data.datasets import check_data, load_splits
from fedkit.errors import FedkitError, RecipeError
from fedkit.evaluation.scoring import capped, score_encoder
from fedkit.models import create_backbone
from fedkit.plugin.registry import registries
from fedkit.rundir.checkpoint import Snapshot, personal_state, read, saved_part

PROTOCOLS = ("knn", "linear", "semi")


def saved_encoder(
    run_dir: Path, recipe: Recipe, client: int | None = None, snapshot: Snapshot | None = None
) -> nn.Module:
    """The encoder of cluster 0 from the run's newest intact checkpoint (or ``snapshot``),
    or ``client``'s personal one (its cluster's encoder with the keys it kept, as
    personalised evaluation uses)."""
    if client is None:
        state = saved_part(run_dir, "encoder", snapshot=snapshot)
    else:
        prefix = "encoder."
        personal = personal_state(run_dir, client, snapshot)
        state = {k[len(prefix) :]: v for k, v in personal.items() if k.startswith(prefix)}
    encoder = create_backbone(recipe.backbone)
    encoder.load_state_dict(state)
    return encoder


def evaluate_run(
    run_dir: Path,
    protocol: str,
    *,
    dataset: str | None = None,
    root: str | None = None,
    overrides: list[str] | None = None,
    client: int | None = None,
) -> dict[str, Any]:
    """Score a saved encoder with ``protocol`` on the run's data set or another one."""
    if protocol not in PROTOCOLS:
        raise RecipeError("--protocol", "one of " + ", ".join(PROTOCOLS), protocol)
    recipe_file = run_dir / "recipe.yaml"
    if not recipe_file.is_file():
        raise FedkitError(f"{run_dir}: no recipe.yaml here; expected a run directory")
    extra = [f"data.dataset={dataset}"] if dataset else []
    extra += [f"data.root={root}"] if root else []
    recipe = load_recipe(recipe_file, [*extra, *(overrides or [])])
    dataset_entry = registries().datasets.get(recipe.data.dataset)
    check_data(recipe.data, dataset_entry)
    device = resolve_device(recipe.device)
    snapshot = read(run_dir)  # the checkpoint scored, named in the result
    if snapshot is None:
        raise FedkitError(f"{run_dir}: no checkpoint yet")
    encoder = saved_encoder(run_dir, recipe, client, snapshot).to(device)
    train, test = load_splits(recipe.data, dataset_entry)
    cfg, seed = recipe.evaluation, recipe.seed
    train, test = capped(train, cfg.max_eval, seed), capped(test, cfg.max_eval, seed)
    with torch.enable_grad():
        metrics = score_encoder(encoder, train, test, protocol, cfg, seed, device)
    result = {
        "dataset": recipe.data.dataset,
        "protocol": protocol,
        "client": client,
        "round": snapshot.round,
        **metrics,
    }
    if snapshot.damaged:  # a newer checkpoint is damaged: this one is older
        result["skipped"] = snapshot.damaged
    return result
