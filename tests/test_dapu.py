"""DAPU: its divergence against a hand computation, its decision rule and log, and its
composition with FedSimSiam (differs from plain FedSimSiam only in predictor updates)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import (
    client_context,
    kept_model,
    keys_under,
    logged,
    prepared,
    run_rounds,
    same_keys,
    spied,
    ssl_recipe,
)
from torch import nn

from fedkit.core.engine import run_round
from fedkit.errors import RecipeError
from fedkit.ssl.divergence import divergence, divergence_layers
from fedkit_plugins.dapu import DAPU


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv2 = nn.Conv2d(2, 2, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(2)
        self.downsample = nn.Sequential(nn.Conv2d(2, 2, 1, bias=False))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(3, 2, 3, bias=False), nn.BatchNorm2d(2))
        self.layer1 = Block()


def filled(conv1: float, conv2: float, other: float) -> dict[str, torch.Tensor]:
    """A model state with every conv1 kernel entry = conv1, conv2 = conv2, rest = other."""
    model = nn.ModuleDict({"encoder": Encoder(), "predictor": nn.Linear(2, 2)})
    state = model.state_dict()
    for k, v in state.items():
        v.fill_(conv1 if k == "encoder.conv1.0.weight" else conv2 if "conv2" in k else other)
    return state


def test_divergence_equals_a_hand_computation_on_known_models():
    a, b = filled(0.0, 0.0, 0.0), filled(1.0, 2.0, 5.0)
    assert divergence_layers(a) == ["encoder.conv1.0.weight", "encoder.layer1.conv2.weight"]
    # conv1: 2·3·3·3 = 54 entries differing by 1 → √54; conv2: 4 entries by 2 → 4.
    # BN weights (also named conv1.1.weight), the downsample conv and the predictor
    # differ by 5 and are left out.
    expected = (math.sqrt(54) + 4.0) / 2
    assert divergence(a, b) == pytest.approx(expected, rel=1e-12)
    assert divergence(b, a) == pytest.approx(expected, rel=1e-12)
    assert divergence(a, a) == 0.0


def _context(participations: int, d: float | None):
    """Client 7 as a client-side hook sees it, having kept divergence ``d`` (if any)."""
    state = {} if d is None else {"dapu_divergence": d}
    raw = ssl_recipe("fedsimsiam", "dapu")
    return client_context(raw, participations=participations, state=state, round=2)


@pytest.mark.parametrize(
    "participations,d,decision", [(0, None, "global"), (1, 0.39, "global"), (1, 0.4, "local")]
)
def test_decision_claims_only_predictor_keys_and_is_logged(participations, d, decision):
    plugin = DAPU(DAPU.Options(mu=0.4))
    received, local = filled(0.0, 0.0, 1.0), filled(0.0, 0.0, 2.0)
    ctx = _context(participations, d)
    claims = plugin.update_client(ctx, received, local)
    assert set(claims) == set(keys_under(received, "predictor."))
    chosen = received if decision == "global" else local
    assert same_keys(claims, chosen, claims)
    used = {} if d is None else {"dapu_used": d}  # nothing used on a first participation
    assert logged(ctx) == {**used, "dapu_global": decision == "global"}


def test_new_global_reference_measures_at_update_time():
    plugin = DAPU(DAPU.Options(mu=5.0, reference="new_global"))
    received, local = filled(0.0, 0.0, 1.0), filled(1.0, 2.0, 2.0)
    ctx = _context(1, None)
    claims = plugin.update_client(ctx, received, local)
    assert logged(ctx)["dapu_used"] == pytest.approx((math.sqrt(54) + 4.0) / 2)
    assert logged(ctx)["dapu_global"] is False
    assert same_keys(claims, local, claims)  # 5.67 ≥ μ = 5 → keep the local predictor


def test_divergence_logged_per_client_per_round_matches_the_models():
    run, spy = spied(ssl_recipe("fedsimsiam", ("dapu", {"mu": 0.4})))
    rows = run_rounds(run, 2)
    for row in rows:
        assert set(row["per_client"]) == {"0", "1", "2"}
    for cid in range(3):
        log, first = rows[1]["per_client"][str(cid)], rows[0]["per_client"][str(cid)]
        measured = divergence(spy.received[(2, cid)], spy.trained[(2, cid)])
        assert log["dapu_divergence"] == pytest.approx(measured)
        assert log["dapu_used"] == pytest.approx(first["dapu_divergence"])
        assert log["dapu_global"] is (log["dapu_used"] < 0.4)
        assert first["dapu_global"] is True and "dapu_used" not in first  # first participation
    # the round's row averages the clients' divergences, weighted by sample counts
    sizes = {str(cid): len(data.train) for cid, data in run.executor.clients.items()}
    for row in rows:
        values = {cid: v["dapu_divergence"] for cid, v in row["per_client"].items()}
        mean = sum(values[c] * sizes[c] for c in values) / sum(sizes.values())
        assert row["train_dapu_divergence"] == pytest.approx(mean)


def test_new_global_reference_measures_against_the_clients_last_encoder():
    raw = ssl_recipe("fedsimsiam", ("dapu", {"mu": 0.4, "reference": "new_global"}))
    run, spy = spied(raw)
    rows = run_rounds(run, 2)
    for cid in range(3):
        measured = divergence(spy.received[(2, cid)], spy.trained[(1, cid)])
        assert rows[1]["per_client"][str(cid)]["dapu_used"] == pytest.approx(measured)


@pytest.mark.slow
def test_with_a_huge_mu_dapu_changes_nothing():
    plain = prepared(ssl_recipe("fedsimsiam"))
    composed = prepared(ssl_recipe("fedsimsiam", ("dapu", {"mu": 1e9})))
    run_rounds(plain, 2), run_rounds(composed, 2)
    assert same_keys(plain.server.pool[0], composed.server.pool[0], plain.server.pool[0])


@pytest.mark.slow
def test_fedsimsiam_with_dapu_differs_only_in_predictor_updates():
    plain, plain_spy = spied(ssl_recipe("fedsimsiam"))
    composed, spy = spied(ssl_recipe("fedsimsiam", ("dapu", {"mu": 0.0})))  # always local
    run_rounds(plain, 1), run_rounds(composed, 1)
    assert same_keys(plain.server.pool[0], composed.server.pool[0], plain.server.pool[0])
    kept = {cid: kept_model(composed, cid) for cid in range(3)}
    run_round(plain, 2), run_round(composed, 2)
    for cid in range(3):
        a, b = plain_spy.loaded[(2, cid)], spy.loaded[(2, cid)]
        predictor = keys_under(a, "predictor.")
        assert predictor and set(kept[cid]) == set(predictor)  # dapu keeps the predictor only
        assert kept_model(plain, cid) == {}  # plain fedsimsiam keeps nothing
        others = [k for k in a if k not in predictor]
        assert same_keys(a, b, others)  # encoder and projector: the same global ones
        assert same_keys(a, spy.received[(2, cid)], predictor)  # plain: global predictor
        assert same_keys(b, kept[cid], predictor)  # dapu: the client's own predictor
        assert not same_keys(a, b, predictor)


def test_dapu_needs_a_shared_predictor():
    run = prepared(ssl_recipe("fedsimclr", "dapu"))
    with pytest.raises(RecipeError, match="predictor"):
        run_round(run, 1)


def test_fedu_local_predictor_and_dapu_is_a_recipe_error():
    with pytest.raises(RecipeError, match="predictor"):
        prepared(ssl_recipe(("fedu", {"predictor": "local"}), "dapu"))


@pytest.mark.slow
def test_fedu_with_dapu_always_global_is_fedbyol():
    byol, byol_spy = spied(ssl_recipe("fedbyol"))
    fedu, fedu_spy = spied(ssl_recipe("fedu", ("dapu", {"mu": 1e9})))
    run_rounds(byol, 2), run_rounds(fedu, 2)
    assert same_keys(byol.server.pool[0], fedu.server.pool[0], byol.server.pool[0])
    for cid in range(3):
        trained = byol_spy.trained[(2, cid)]
        assert same_keys(trained, fedu_spy.trained[(2, cid)], trained)  # the full trained states
        kept = kept_model(byol, cid)  # the targets, which both keep
        assert kept and same_keys(kept, kept_model(fedu, cid), kept)
