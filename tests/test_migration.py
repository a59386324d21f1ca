"""A plugin written for contract v2 (fedkit 0.2) keeps working where its hook is unchanged
and, where the hook changed, still runs and says in one line what to write instead; old
import paths resolve to the new homes with the same kind of notice."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest
from conftest import prepared, tiny_recipe

from fedkit import hookimpl
from fedkit.core.engine import run_round
from fedkit.plugin import migration
from fedkit.plugin.migration import FedkitDeprecationWarning


class V2Plugin:
    """Every v2 habit v3 changed: ``recipe`` arguments, a mutable metrics row, metrics
    returned from hooks, ``None`` to drop a claimed key."""

    @hookimpl
    def configure(self, recipe, server):
        server.state["seen_seed"] = recipe.seed

    @hookimpl
    def auxiliary_keys(self, recipe):
        return ["v2.*"]

    @hookimpl
    def after_local_train(self, ctx, model, before):
        return {"v2_norm": 1.5}

    @hookimpl
    def upload_selection(self, ctx, local, model):
        import torch

        return {"v2.extra": torch.ones(2), "classifier.bias": None}

    @hookimpl
    def aggregate(self, server, cluster, uploads):
        return {"v2.extra": None}

    @hookimpl
    def round_end(self, server, metrics):
        metrics["v2_clients"] = len(metrics["clients"])

    @hookimpl
    def evaluate(self, server, round):
        return {"v2_evaluated": round}


@pytest.fixture
def told():
    migration._told.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
    migration._told.clear()


def test_a_v2_plugin_runs_and_is_told_what_to_write_instead(told):
    run = prepared(tiny_recipe(plugins=["fedavg", "v2"]), v2=V2Plugin)
    row = run_round(run, 1)
    run.close()
    assert run.server.state["seen_seed"] == 0
    assert row["v2_clients"] == 3 and row["v2_evaluated"] == 1
    assert row["train_v2_norm"] == 1.5
    assert "v2.extra" not in run.server.pool[0]  # None dropped it, as in v2
    assert "classifier.bias" in run.server.pool[0]  # withheld by every client: unchanged
    assert row["bytes"]["up_aux"] > 0 and row["bytes"]["up_data"] == 0
    messages = [str(w.message) for w in told if issubclass(w.category, FedkitDeprecationWarning)]
    expected = [
        "hook 'configure' no longer takes 'recipe'; use server.recipe",
        "hook 'auxiliary_keys' no longer takes 'recipe'; use server.recipe",
        "after_local_train returned metrics; report them with ctx.log",
        "upload_selection claimed 'classifier.bias' with None; claim it with fedkit.DROP",
        "aggregate claimed 'v2.extra' with None",
        "round_end no longer receives the metrics row to change; report with server.log",
        "evaluate returned metrics; report them with server.log",
    ]
    for text in expected:
        assert any(text in m for m in messages), text
    assert all("\n" not in m and "decisions/0012" in m for m in messages)
    assert len(messages) == len(set(messages))  # once each


def test_old_import_paths_still_resolve_and_name_the_new_home(told):
    for name in [m for m in sys.modules if m in ("fedkit.client", "fedkit.server", "fedkit.fit")]:
        del sys.modules[name]
    import fedkit
    from fedkit.client import ClientContext
    from fedkit.fit import Objective
    from fedkit.server import Server

    assert ClientContext is fedkit.ClientContext and Server is fedkit.Server
    assert Objective is fedkit.Objective
    keys = importlib.import_module("fedkit.keys")
    assert keys.under is importlib.import_module("fedkit.plugin.keys").under
    messages = [str(w.message) for w in told]
    assert any("fedkit.client.ClientContext moved: import it from fedkit" in m for m in messages)
    assert any("fedkit.keys.under moved: import it from fedkit.plugin.keys" in m for m in messages)


def test_the_removed_server_data_names_what_replaced_it():
    run = prepared(tiny_recipe())
    with pytest.raises(AttributeError, match="server.num_classes, server.classes and server.own"):
        run.server.data  # noqa: B018
    run.close()
