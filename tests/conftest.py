"""Shared fixtures: tiny recipes on the embedded digits data, fast enough for CI."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

torch.set_num_threads(int(os.environ.get("FEDKIT_TEST_THREADS", "1")))


def tiny_recipe(**sections: Any) -> dict[str, Any]:
    """A FedAvg recipe on 300 digits images, 3 clients, 2 rounds, 16×16 inputs."""
    raw: dict[str, Any] = {
        "seed": 0,
        "backbone": {"name": "test_resnet"},
        "data": {
            "dataset": "digits",
            "image_size": 16,
            "num_clients": 3,
            "max_train": 300,
            "local_test_size": 20,
            "partition": {"name": "dirichlet", "alpha": 1.0},
        },
        "federation": {
            "rounds": 2,
            "clients_per_round": 3,
            "batch_size": 32,
            "optimizer": {"name": "adam", "lr": 0.003},
        },
        "plugins": ["fedavg"],
        "evaluation": {"protocol": "supervised", "every": 1},
        "device": "cpu",
    }
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(raw.get(name), dict):
            raw[name] = {**raw[name], **value}
        else:
            raw[name] = value
    return raw


@pytest.fixture
def write_recipe(tmp_path: Path):
    """Write a recipe mapping to a YAML file and return its path."""

    def write(raw: Any, name: str = "recipe.yaml") -> Path:
        path = tmp_path / name
        path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
        return path

    return write


class LoadedEntryPoint:
    """Stands in for an ``importlib.metadata.EntryPoint`` whose target is already loaded."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def load(self) -> Any:
        return self.obj


def activate(raw: dict[str, Any], **extra: Any):
    """Validate a raw recipe and activate its plugins, with extra in-test plugins."""
    from fedkit.plugins import Plugins, discover
    from fedkit.recipe import validate

    recipe = validate(raw)
    available = {**discover(), **{k: LoadedEntryPoint(v) for k, v in extra.items()}}
    return recipe, Plugins(recipe, available)


def prepared(raw: dict[str, Any], **extra: Any):
    """A prepared ``Run`` (no run directory) for a raw recipe and in-test plugins."""
    from fedkit.engine import prepare

    recipe, plugins = activate(raw, **extra)
    return prepare(recipe, plugins)
