"""FedProx: the proximal term's value, μ = 0 reducing to the method alone bit for bit,
μ > 0 changing training, the same plugin composing with SSL methods, and one term: the
guide's walk-through and the new-plugin template compute exactly the plugin's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import client_context, prepared, tiny_recipe
from test_ssl_plugins import ssl_recipe
from torch import nn

from fedkit.config.schema import validate
from fedkit.core.engine import run_round
from fedkit.core.ledger import TENSOR_FIELDS
from fedkit.plugin.context import ClientContext, ModelKeys
from fedkit_plugins.fedprox import FedProx

SGD = {"optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.0}}


def rows_and_pool(raw, rounds=2):
    run = prepared(raw)
    rows = [run_round(run, r) for r in range(1, rounds + 1)]
    return rows, run.server.pool[0]


def test_term_is_half_mu_times_squared_distance_to_the_global_parameters():
    model = nn.ModuleDict({"lin": nn.Linear(3, 2)})
    state = model.state_dict()
    received = {k: v + 0.5 for k, v in state.items()}  # every entry 0.5 away
    ctx = ClientContext(
        0,
        None,  # the term needs no data
        None,
        recipe=validate(tiny_recipe()),
        round=1,
        device=torch.device("cpu"),
        rng=torch.Generator(),
        keys=ModelKeys(frozenset(state), frozenset(state), frozenset()),
        received=received,
    )
    term = FedProx(FedProx.Options(mu=0.3)).loss_terms(ctx, model, batch=None)["prox"]
    assert term.item() == pytest.approx(0.5 * 0.3 * 8 * 0.25)  # 8 entries, (0.5)² each
    term.backward()
    assert torch.allclose(model["lin"].weight.grad, torch.full((2, 3), -0.3 * 0.5))


def test_mu_zero_equals_fedavg_bitwise_and_mu_positive_differs():
    base = tiny_recipe(federation=SGD)
    plain, pool = rows_and_pool(base)
    zero, pool0 = rows_and_pool({**base, "plugins": ["fedavg", {"fedprox": {"mu": 0.0}}]})
    some, pool1 = rows_and_pool({**base, "plugins": ["fedavg", {"fedprox": {"mu": 1.0}}]})
    for a, b in zip(plain, zero, strict=True):  # loss_prox is reported (and booked) besides
        assert {k: b[k] for k in a if k not in ("per_client", "bytes")} == {
            k: v for k, v in a.items() if k not in ("per_client", "bytes")
        }
        assert all(a["bytes"][k] == b["bytes"][k] for k in TENSOR_FIELDS)
        assert b["train_loss_prox"] == 0.0
    assert all(torch.equal(pool[k], pool0[k]) for k in pool)
    assert some[-1]["train_loss_prox"] > 0
    assert not torch.equal(pool["classifier.weight"], pool1["classifier.weight"])


@pytest.mark.parametrize("method", ["fedbyol", "fedsimclr"])
def test_composes_unchanged_with_ssl_methods(method):
    plain, pool = rows_and_pool(ssl_recipe(method))
    zero, pool0 = rows_and_pool(ssl_recipe(method, ("fedprox", {"mu": 0.0})))
    some, pool1 = rows_and_pool(ssl_recipe(method, ("fedprox", {"mu": 10.0})))
    assert [r["train_loss"] for r in plain] == [r["train_loss"] for r in zero]
    assert all(torch.equal(pool[k], pool0[k]) for k in pool)
    assert some[-1]["train_loss_prox"] > 0
    assert not torch.equal(pool["encoder.conv1.0.weight"], pool1["encoder.conv1.0.weight"])
    # a strong pull towards the global model keeps the clients closer to it
    drift = {
        name: (p["encoder.conv1.0.weight"] - start).norm()
        for name, p, start in (
            ("plain", pool, prepared(ssl_recipe(method)).server.pool[0]["encoder.conv1.0.weight"]),
            ("prox", pool1, prepared(ssl_recipe(method)).server.pool[0]["encoder.conv1.0.weight"]),
        )
    }
    assert drift["prox"] < drift["plain"]


def _guides_proximal() -> type:
    """The ``Proximal`` class of docs/plugins.md's FedProx walk-through."""
    import re

    page = (Path(__file__).resolve().parent.parent / "docs" / "plugins.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "class Proximal" in b)
    namespace: dict = {}
    exec(compile(block, "docs/plugins.md", "exec"), namespace)  # noqa: S102
    return namespace["Proximal"]


def _templates_plugin(tmp_path) -> type:
    """The plugin class ``fedkit new-plugin`` writes."""
    import importlib.util

    from fedkit.cli.newplugin import create

    root = create("proxcheck", tmp_path)
    spec = importlib.util.spec_from_file_location(
        "proxcheck_plugin", root / "proxcheck" / "plugin.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Proxcheck


def test_the_guide_and_the_template_compute_the_plugins_term(tmp_path):
    torch.manual_seed(0)
    model = nn.ModuleDict({"lin": nn.Linear(3, 2), "frozen": nn.Linear(2, 2)})
    model["frozen"].requires_grad_(False)
    received = {k: v + torch.randn_like(v) for k, v in model.state_dict().items()}
    ctx = client_context(tiny_recipe(), received=received)
    terms = {
        "plugin": FedProx(FedProx.Options(mu=0.3)).loss_terms(ctx, model, None)["prox"],
        "guide": (g := _guides_proximal())(g.Options(mu=0.3)).loss_terms(ctx, model, None)["prox"],
        "template": (t := _templates_plugin(tmp_path))(t.Options(weight=0.3)).loss_terms(
            ctx, model, None
        )["proxcheck"],
    }
    trained = sum(
        (w - received[name]).pow(2).sum()
        for name, w in model.named_parameters()
        if name.startswith("lin.")  # the frozen layer is left out
    )
    assert terms["plugin"].item() == pytest.approx(0.5 * 0.3 * trained.item())
    assert terms["guide"].item() == terms["plugin"].item() == terms["template"].item()
