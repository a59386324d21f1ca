"""Helpers for testing plugins, the way fedkit tests its own (pytest's ``pytester`` is the
model): a tiny recipe on the embedded digits that runs in seconds, a function that runs a
recipe in-process and hands back its metrics rows, ledger and models, and an assertion
that two runs are the same.

    from fedkit.testing import assert_same_runs, run_recipe, tiny_recipe

    plain = run_recipe(tiny_recipe())
    mine = run_recipe(tiny_recipe(plugins=["fedavg", {"myplugin": {"weight": 0.0}}]))
    assert_same_runs(plain, mine, ignore=["train_loss_myplugin"])

A plugin that is not installed yet can be passed by name: ``run_recipe(recipe,
plugins={"myplugin": MyPlugin})``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from fedkit.config.schema import validate
from fedkit.core.preflight import check
from fedkit.core.runs import Loaded, RunResult, run, with_plugins  # noqa: F401 - tests use Loaded
from fedkit.plugin.ledger import METRIC_FIELDS
from fedkit.plugin.manager import Plugins

TINY: dict[str, Any] = {
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


def tiny_recipe(**sections: Any) -> dict[str, Any]:
    """FedAvg on 300 digits images at 16×16, 3 clients, 2 rounds (a few seconds on a
    CPU). Keyword arguments replace sections; a mapping is merged into the section."""
    raw = copy.deepcopy(TINY)
    for name, value in sections.items():
        if isinstance(value, dict) and isinstance(raw.get(name), dict):
            raw[name] = {**raw[name], **value}
        else:
            raw[name] = value
    return raw


def activate(raw: dict[str, Any], plugins: dict[str, Any] | None = None) -> Plugins:
    """A recipe's server-side plugins (checked as ``fedkit run`` checks them), with
    ``plugins`` (name → class or object) added to the installed ones."""
    return check(validate(raw), with_plugins(plugins or {}))


def run_recipe(
    recipe: dict[str, Any] | str | Path,
    *,
    plugins: dict[str, Any] | None = None,
    overrides: list[str] | None = None,
    rounds: int | None = None,
) -> RunResult:
    """Run a recipe (a mapping, a YAML file or a shipped name) in-process, without a run
    directory: ``fedkit.run`` with in-test plugins. ``rounds``: stop after that many."""
    return run(recipe, plugins=plugins, overrides=overrides, rounds_to_run=rounds)


def assert_same_runs(a: RunResult, b: RunResult, ignore: list[str] | tuple[str, ...] = ()) -> None:
    """Two runs gave the same metrics (but for the ``ignore``d keys, in rows and in each
    client's values), the same ledger and bit-identical models. With ``ignore``, the
    bytes booked for reported values (``up_metrics``, ``eval_metrics``, hence ``total``)
    are not compared either: the ignored values change them."""
    reported = {*METRIC_FIELDS, "total"} if ignore else set()

    def booked(row: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in row.items() if k not in reported}

    def strip(row: dict[str, Any]) -> dict[str, Any]:
        row = {k: v for k, v in row.items() if k not in ignore}
        if isinstance(row.get("bytes"), dict):
            row["bytes"] = booked(row["bytes"])
        if "per_client" in row:
            row["per_client"] = {
                c: {k: v for k, v in values.items() if f"train_{k}" not in ignore}
                for c, values in row["per_client"].items()
            }
        return row

    assert [strip(r) for r in a.rows] == [strip(r) for r in b.rows], "metrics differ"
    assert [booked(r) for r in a.ledger] == [booked(r) for r in b.ledger], "ledgers differ"
    assert len(a.pool) == len(b.pool)
    for x, y in zip(a.pool, b.pool, strict=True):
        assert x.keys() == y.keys(), "models have different keys"
        for key in x:
            assert torch.equal(x[key], y[key]), f"models differ at {key}"
