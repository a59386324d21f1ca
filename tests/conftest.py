"""Shared fixtures: tiny recipes on the embedded digits data, fast enough for CI."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from fedkit import hookimpl

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


class Spy:
    """Records, per (round, client), the state local training starts from and what the
    server sent; per round, the uploads the server aggregated. Trains nothing."""

    def __init__(self) -> None:
        self.loaded: dict[tuple[int, int], dict[str, Any]] = {}
        self.received: dict[tuple[int, int], dict[str, Any]] = {}
        self.uploads: dict[int, list] = {}

    @hookimpl
    def local_train(self, client, model, server):
        key = (server.round, client.id)
        self.loaded[key] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.received[key] = dict(client.received)

    @hookimpl
    def aggregate(self, server, cluster, uploads):
        self.uploads[server.round] = uploads


def spied(raw: dict[str, Any], **extra: Any):
    """A prepared run with a ``Spy`` registered next to its plugins."""
    run = prepared(raw, **extra)
    spy = Spy()
    run.plugins.pm.register(spy, name="spy")
    return run, spy
