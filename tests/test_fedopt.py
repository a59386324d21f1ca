"""FedOpt: FedAvgM with β = 0 and η = 1 is FedAvg; FedAdam's first step follows the
formula; moments are server tensors that checkpoints keep."""

from __future__ import annotations

import pytest
import torch
from conftest import prepared, tiny_recipe

from fedkit.core.engine import run_round


def run_two(*plugins):
    run = prepared(tiny_recipe(plugins=["fedavg", *plugins]))
    start = {k: v.clone() for k, v in run.server.pool[0].items()}
    rows = [run_round(run, r) for r in (1, 2)]
    return run, start, rows


@pytest.mark.slow
def test_avgm_without_momentum_at_lr_one_is_fedavg():
    plain, _, _ = run_two()
    avgm, _, _ = run_two({"fedopt": {"optimizer": "avgm", "beta1": 0.0, "lr": 1.0}})
    for k, v in plain.server.pool[0].items():
        assert torch.allclose(v.double(), avgm.server.pool[0][k].double(), atol=1e-6), k


def test_adam_first_step_follows_the_formula_and_buffers_take_the_average():
    lr, b1, b2, tau = 0.05, 0.9, 0.99, 1e-3
    opts = {"optimizer": "adam", "lr": lr, "beta1": b1, "beta2": b2, "tau": tau}
    plain = prepared(tiny_recipe())
    run = prepared(tiny_recipe(plugins=["fedavg", {"fedopt": opts}]))
    x = {k: v.clone() for k, v in run.server.pool[0].items()}
    run_round(plain, 1), run_round(run, 1)
    mean = plain.server.pool[0]  # the same clients trained the same model: FedAvg's mean
    params = run.server.parameter_keys
    for key in ("classifier.weight", "encoder.conv1.0.weight"):
        assert key in params
        delta = mean[key].double() - x[key].double()
        m = (1 - b1) * delta
        v = b2 * tau**2 + (1 - b2) * delta.pow(2)
        expected = x[key].double() + lr * m / (v.sqrt() + tau)
        assert torch.allclose(run.server.pool[0][key].double(), expected, atol=1e-6)
        assert torch.allclose(run.server.tensors[f"fedopt/0/m/{key}"], m)
    buffers = [k for k in x if k not in params and x[k].is_floating_point()]
    assert buffers and all(torch.equal(run.server.pool[0][k], mean[k]) for k in buffers)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["avgm", "adam", "yogi"])
def test_each_server_optimiser_moves_the_model_differently_from_fedavg(optimizer):
    plain, _, _ = run_two()
    other, _, rows = run_two({"fedopt": {"optimizer": optimizer}})
    key = "classifier.weight"
    assert not torch.equal(plain.server.pool[0][key], other.server.pool[0][key])
    assert all(torch.isfinite(v).all() for v in other.server.pool[0].values())
    assert 0.0 <= rows[-1]["test_accuracy"] <= 1.0
