"""FedEMA: a returning client's online network is μ·local + (1−μ)·global with μ from
its divergence; λ is scaled once so that the first moving-average update uses μ = τ."""

from __future__ import annotations

import pytest
import torch
from conftest import spied, ssl_recipe

from fedkit.core.engine import run_round
from fedkit.ssl.divergence import divergence

TAU = 0.7


@pytest.mark.slow
def test_update_is_a_divergence_weighted_average_of_local_and_global():
    run, spy = spied(ssl_recipe("fedbyol", ("fedema", {"tau": TAU}), rounds=3))
    params = set(run.executor.worker.keys.parameters)
    online = [k for k in params if k.split(".", 1)[0] in ("encoder", "projector", "predictor")]
    buffers = [k for k in run.server.pool[0] if k not in params]
    rows, kept = [], {}
    for r in (1, 2, 3):
        kept[r - 1] = {c: run.executor.store.get(c).model for c in range(3) if r > 1}
        rows.append(run_round(run, r))
    for cid in range(3):
        first, second, third = (rows[i]["per_client"][str(cid)] for i in range(3))
        assert "fedema_mu" not in first  # first participation: the global model whole
        assert second["fedema_mu"] == pytest.approx(TAU)  # λ = τ/d₁ makes μ = τ
        d1, d2 = first["fedema_divergence"], second["fedema_divergence"]
        assert third["fedema_mu"] == pytest.approx(min(1.0, TAU * d2 / d1))
        for r, mu in ((2, second["fedema_mu"]), (3, third["fedema_mu"])):
            loaded, received, local = spy.loaded[(r, cid)], spy.received[(r, cid)], kept[r - 1][cid]
            # a client keeps its own online parameters, not the shared buffers
            assert set(online) <= set(local) and not set(buffers) & set(local)
            for k in online:
                torch.testing.assert_close(loaded[k], (1 - mu) * received[k] + mu * local[k])
            for k in buffers:
                assert torch.equal(loaded[k], received[k])
    # the divergence is measured from the state training started at to where it ended
    last = spy.trained[(3, 0)]
    d3 = rows[2]["per_client"]["0"]["fedema_divergence"]
    assert d3 == pytest.approx(divergence(spy.loaded[(3, 0)], last))
