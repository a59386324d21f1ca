"""FedNova: the effective step count a_i, the normalised update on known numbers, the
same model as FedAvg when every client takes the same number of steps, another one when
they do not, and a_i booked as auxiliary in the ledger."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import prepared, tiny_recipe

from fedkit import DROP, Upload
from fedkit.core.engine import run_round
from fedkit_plugins.fednova import STEPS, FedNova, effective_steps

SGD = {"optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9}, "local_epochs": 2}


def test_effective_steps_are_the_momentum_sum_and_the_step_count_without_momentum():
    rho, tau = 0.9, 5
    # a_i = Σ_{k<τ} (1 − ρ^{τ−k}) / (1 − ρ): each step's gradient counted as its
    # momentum carries it up to the last step
    direct = sum((1 - rho ** (tau - k)) / (1 - rho) for k in range(tau))
    assert effective_steps(tau, rho) == pytest.approx(direct)
    assert effective_steps(7, 0.0) == 7.0
    assert effective_steps(0, 0.9) == 0.0


def test_update_normalises_each_change_by_its_step_count():
    x = torch.tensor([1.0, 2.0])
    server = SimpleNamespace(pool=[{"w": x, "count": torch.tensor(3)}])
    uploads = [
        Upload(
            0, 1.0, {"w": torch.tensor([0.0, 2.0]), STEPS: torch.tensor(1.0, dtype=torch.float64)}
        ),
        Upload(
            1, 3.0, {"w": torch.tensor([1.0, 0.0]), STEPS: torch.tensor(4.0, dtype=torch.float64)}
        ),
    ]
    claims = FedNova().aggregate(server, 0, uploads)
    # p = (1/4, 3/4); Σ p a = 1/4 + 3 = 3.25; Σ p (x − x_i)/a = (1/4)(1, 0) + (3/4)(0, 2)/4
    expected = x - 3.25 * torch.tensor([0.25, 0.375])
    assert torch.allclose(claims["w"], expected)
    assert claims[STEPS] is DROP and "count" not in claims  # integers: FedAvg's mean


def final_model(raw, rounds=1):
    """The run after ``rounds`` rounds (one by default: training amplifies the 1e-7
    differences of float sums in different orders, so later rounds are compared only
    through their own aggregation)."""
    run = prepared(raw)
    rows = [run_round(run, r) for r in range(1, rounds + 1)]
    return run, rows


@pytest.mark.slow
def test_equal_steps_give_fedavg_and_unequal_steps_do_not():
    iid = {"partition": {"name": "iid"}}
    equal = tiny_recipe(federation=SGD, data=iid)  # 100 images each: 4 batches of 32 an epoch
    run_avg, _ = final_model(equal)
    run_nova, rows = final_model({**equal, "plugins": ["fedavg", "fednova"]})
    sizes = {info.num_samples for info in run_nova.server.roster}
    assert sizes == {100}
    for key, value in run_avg.server.pool[0].items():
        if value.is_floating_point():
            assert torch.allclose(run_nova.server.pool[0][key], value, atol=1e-6), key
    skewed = tiny_recipe(federation=SGD)  # Dirichlet(1): 123, 91 and 86 images
    run_avg, _ = final_model(skewed)
    run_nova, _ = final_model({**skewed, "plugins": ["fedavg", "fednova"]})
    assert len({info.num_samples for info in run_nova.server.roster}) > 1
    key = "classifier.weight"
    gap = (run_nova.server.pool[0][key] - run_avg.server.pool[0][key]).abs().max()
    assert gap > 1e-4


def test_the_step_count_travels_as_auxiliary_and_stays_out_of_the_model():
    raw = {**tiny_recipe(federation=SGD), "plugins": ["fedavg", "fednova"]}
    run, rows = final_model(raw, rounds=2)
    assert rows[-1]["bytes"]["up_aux"] == 3 * 8  # one float64 per client
    assert STEPS not in run.server.pool[0]
