"""FedProx: the proximal term's value, μ = 0 reducing to the method alone bit for bit,
μ > 0 changing training, the same plugin composing with SSL methods, and one term: the
guide's walk-through and the new-plugin template show exactly the plugin's code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import prepared, ssl_recipe, tiny_recipe
from torch import nn

from fedkit.config.schema import validate
from fedkit.core.engine import run_round
from fedkit.plugin.context import ClientContext, ModelKeys
from fedkit.plugin.ledger import TENSOR_FIELDS
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
        lr=0.05,
        device=torch.device("cpu"),
        rng=torch.Generator(),
        keys=ModelKeys(frozenset(state), frozenset(state), frozenset()),
        received=received,
    )
    term = FedProx(FedProx.Options(mu=0.3)).loss_terms(ctx, model, batch=None)["prox"]
    assert term.item() == pytest.approx(0.5 * 0.3 * 8 * 0.25)  # 8 entries, (0.5)² each
    term.backward()
    assert torch.allclose(model["lin"].weight.grad, torch.full((2, 3), -0.3 * 0.5))


@pytest.mark.slow
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


@pytest.mark.slow
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


def _code(text: str) -> str:
    """A module's code after its docstring and ``from __future__`` line."""
    return text[text.index("from typing import Any") :]


def test_the_guide_and_the_template_show_the_plugins_code(tmp_path):
    """One FedProx: docs/plugins.md's walk-through shows plugins/fedprox.py as it is, and
    ``fedkit new-plugin`` writes the same code under the new plugin's name."""
    import re

    from fedkit.cli.newplugin import create

    root = Path(__file__).resolve().parent.parent
    plugin = _code((root / "plugins" / "fedprox.py").read_text())
    page = (root / "docs" / "plugins.md").read_text()
    guide = re.search(r"## FedProx, step by step.*?```python\n(.*?)```", page, re.S).group(1)
    assert guide == plugin
    written = (create("proxcheck", tmp_path) / "proxcheck" / "plugin.py").read_text()
    renamed = plugin.replace("FedProx", "Proxcheck").replace('{"prox"', '{"proxcheck"')
    assert _code(written) == renamed
