"""Every hook goes through pluggy's hook call: a hook-call monitor sees claims and chain
hooks too, a wrapper on a claims hook runs around the plugins' implementations and sees
their claims, pluggy's hook implementations are never changed by fedkit, the recipe's
order is the call order, and ``tryfirst``/``trylast`` (which would change it) are refused."""

from __future__ import annotations

import pytest
from conftest import activate, prepared, tiny_recipe

from fedkit import hookimpl
from fedkit.core.engine import run_round
from fedkit.errors import RecipeError
from fedkit.plugin.manager import Claim
from fedkit.plugin.registry import hook_kind, hook_names


class Order:
    """Logs its name in hooks of every kind (client side: ``ctx.log``)."""

    name = "?"

    @hookimpl
    def loss_terms(self, ctx, model, batch, outputs):
        ctx.scratch.setdefault("order", []).append(self.name)

    @hookimpl
    def process_upload(self, ctx, upload):
        order = ctx.scratch.setdefault("chain", [])
        if self.name not in order:
            order.append(self.name)
            ctx.log(chain=",".join(order))


class First(Order):
    name = "first"


class Second(Order):
    name = "second"


def test_the_recipe_order_is_the_call_order_for_every_kind():
    for names in (["first", "second"], ["second", "first"]):
        run = prepared(tiny_recipe(plugins=["fedavg", *names]), first=First, second=Second)
        row = run_round(run, 1)
        run.close()
        assert {v["chain"] for v in row["per_client"].values()} == {",".join(names)}


def test_a_hookcall_monitor_sees_claims_and_chain_hooks():
    run = prepared(tiny_recipe(plugins=["fedavg", "first"]), first=First)
    seen: list[str] = []
    undo = run.executor.worker.plugins.pm.add_hookcall_monitoring(
        lambda hook, impls, kwargs: seen.append(hook), lambda *args: None
    )
    server_seen: list[str] = []
    run.plugins.pm.add_hookcall_monitoring(
        lambda hook, impls, kwargs: server_seen.append(hook), lambda *args: None
    )
    run_round(run, 1)
    undo()
    run.close()
    for hook in ("update_client", "loss_terms", "upload_selection", "process_upload"):
        assert hook in seen, hook
    for hook in ("downlink", "aggregate", "server_update", "round_end"):
        assert hook in server_seen, hook


class Timing:
    """A new-style wrapper around a claims hook: it sees every plugin's claims."""

    seen: list[list[Claim]] = []

    @hookimpl(wrapper=True)
    def aggregate(self, server, cluster, uploads):
        result = yield
        Timing.seen.append(list(result))
        return result


class Claims:
    @hookimpl
    def aggregate(self, server, cluster, uploads):
        return {"classifier.bias": uploads[0].tensors["classifier.bias"]}


def test_a_wrapper_on_a_claims_hook_runs_and_sees_the_claims():
    Timing.seen = []
    run = prepared(
        tiny_recipe(plugins=["fedavg", "claims", "timing"]), claims=Claims, timing=Timing
    )
    run_round(run, 1)
    run.close()
    assert len(Timing.seen) == 1
    [claim] = Timing.seen[0]
    assert claim.plugin == "claims" and set(claim.values) == {"classifier.bias"}


def test_pluggy_hook_implementations_are_left_as_registered():
    _, plugins = activate(tiny_recipe(plugins=["fedavg", "first"]), first=First)
    for name in hook_names():
        for impl in getattr(plugins.pm.hook, name).get_hookimpls():
            assert getattr(impl.plugin, name) is impl.function, (name, impl.plugin_name)


class Early:
    @hookimpl(tryfirst=True)
    def round_end(self, server):
        pass


def test_tryfirst_and_trylast_are_refused_naming_the_plugin_and_hook():
    with pytest.raises(RecipeError, match=r"early.*'round_end'.*order of plugins"):
        activate(tiny_recipe(plugins=["fedavg", "early"]), early=Early)


def test_every_hook_has_a_kind():
    assert {hook_kind(h) for h in hook_names()} == {"all", "firstresult", "claims", "chain"}
