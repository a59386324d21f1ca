"""Secure aggregation with Flower's SecAgg+ on the ``flower`` executor
(``engine.secure_aggregation``, ``fedkit/flower/secagg.py``), on an in-process grid whose
nodes are real ``NodeHost``s answering as ``fedkit deploy node`` answers (conftest's
``NodeGrid``): the server's hooks see only the protocol's mean, the numbers match plain
FedAvg within the quantisation error, the ledger books each client's protocol bytes, a
round survives 30% of its clients dropping after sharing keys, and what cannot be summed
is refused before round 1. tests/test_deployment.py kills a real node mid-protocol."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import NodeGrid, on_grid, server_identity, tiny_recipe

from fedkit.config.schema import validate
from fedkit.core import engine
from fedkit.errors import RecipeError

pytest.importorskip(
    "flwr", reason="the flower extra is not installed (pip install 'fedkit-fl[flower]')"
)

from fedkit.flower import secagg  # noqa: E402
from fedkit.flower.records import get_meta  # noqa: E402


@pytest.fixture
def identity(monkeypatch):
    """Messages made here are the ServerApp's (Flower's task identity)."""
    server_identity(monkeypatch)


def recipe(secure, clients: int = 3, rounds: int = 2, plugins=("fedavg",), **engine_cfg):
    return validate(
        tiny_recipe(
            plugins=list(plugins),
            data={"num_clients": clients},
            federation={"rounds": rounds, "clients_per_round": clients, "min_clients": 2},
            engine={"executor": "flower", "secure_aggregation": secure, **engine_cfg},
        )
    )


def run_on(grid: NodeGrid, raw) -> tuple[list[dict], engine.Run]:
    run = engine.prepare(raw, executor=on_grid(grid))
    try:
        return list(engine.rounds(run)), run
    finally:
        run.close()


@pytest.fixture
def spied(monkeypatch):
    """What each node held for the protocol (its own upload, as a change) and every
    upload the server's aggregation received (``engine.update_cluster``: what the
    ``aggregate`` and ``server_update`` hooks are handed)."""
    seen: dict[str, list] = {"held": [], "server": []}
    hold, update = secagg.hold, engine.update_cluster

    def holding(reply, job, state):
        out = hold(reply, job, state)
        if secagg.HELD in state:
            vector = torch.from_numpy(state[secagg.HELD]["vector"].numpy().copy())
            seen["held"].append((get_meta(job)["client"], vector))
        return out

    def updating(run, cluster, uploads):
        seen["server"].append([(u.client, u.weight, u.tensors) for u in uploads])
        return update(run, cluster, uploads)

    monkeypatch.setattr("fedkit.flower.node.hold", holding)
    monkeypatch.setattr(engine, "update_cluster", updating)
    return seen


@pytest.mark.slow
def test_the_server_sees_only_the_sum_and_it_matches_plain_fedavg(identity, spied, tmp_path):
    """(a) Every upload the server's hooks get in a SecAgg+ round is the round's mean (one
    tensor dict shared by all), never a client's own; (b) that mean is the clients'
    sample-weighted mean within the quantisation error, and two rounds end where plain
    FedAvg ends within it too. The row says the server saw a sum and what SecAgg+ cost;
    (c) the ledger books that cost per client."""
    rows, run = run_on(NodeGrid(3, tmp_path / "secure"), recipe(True))
    plain_rows, plain = run_on(NodeGrid(3, tmp_path / "plain"), recipe(False))

    first = spied["server"][0]
    assert len(first) == 3 and len({id(t) for _, _, t in first}) == 1  # one sum, shared
    offer = plain.server.template.state_dict()  # round 1's offer is the template
    mean = first[0][2]
    keys = [k for k in mean if mean[k].is_floating_point()]  # integers: floored means
    summed = torch.cat([(mean[k].double() - offer[k].double()).reshape(-1) for k in keys])
    floating = torch.cat([torch.full((v.numel(),), v.is_floating_point()) for v in mean.values()])
    held = [v[floating] for _, v in sorted(spied["held"][:3], key=lambda h: h[0])]
    weights = [w for _, w, _ in first]
    expected = sum(w * v for w, v in zip(weights, held, strict=True)) / sum(weights)
    error = (summed - expected).abs().max().item()
    assert error < 1e-5, error  # quantisation: 2·8/2²² per level, a few levels at most
    assert all((summed - own).abs().max() > 100 * error for own in held)  # none is a client's

    # Two rounds on: training magnifies round 1's 4e-6 into ~5e-3 on the model's entries,
    # and the scores stay within a test image or two of plain FedAvg's (120 images).
    last, plain_last = rows[-1], plain_rows[-1]
    assert abs(last["test_accuracy"] - plain_last["test_accuracy"]) <= 2 / 120
    assert abs(last["train_loss"] - plain_last["train_loss"]) < 0.01
    assert rows[0]["server_saw"] == "sum" and "server_saw" not in plain_rows[0]
    cost = rows[0]["secagg"]
    assert cost["clients"] == 3 and cost["dropped"] == []
    assert cost["messages"] == 4 * 3 * 2  # four stages, a message and a reply per client
    model = sum(v.nbytes for v in mean.values())
    assert cost["bytes_up"] > 3 * model  # the masked vectors (int64) and the key shares

    # (c) The ledger books each client's share of the protocol as ``secagg``: per round the
    # clients' entries add up to the row's totals, a summed client's upload is booked only
    # there (int64 entries, keys and shares: no float32 ``up_model``), the downloads are the
    # plain run's, and a plain run books no ``secagg`` at all.
    entries = sum(v.numel() for v in mean.values())
    ledger, plain_ledger = run.server.ledger.to_rows(), plain.server.ledger.to_rows()
    for row in rows:
        mine = [e for e in ledger if e["round"] == row["round"]]
        for way in ("down", "up"):
            booked = [e[f"{way}_secagg"] for e in mine]
            assert sum(booked) == row["secagg"][f"bytes_{way}"] == row["bytes"][f"{way}_secagg"]
        assert all(e["up_secagg"] > 8 * entries and e["down_secagg"] > 0 for e in mine)
        assert all(e["up_model"] == e["up_aux"] == e["up_data"] == 0 for e in mine)
    assert [e["down_model"] for e in ledger] == [e["down_model"] for e in plain_ledger]
    assert all(e["down_secagg"] == e["up_secagg"] == 0 for e in plain_ledger)
    assert all(e["up_model"] == model for e in plain_ledger)


@pytest.mark.slow
def test_a_round_survives_thirty_percent_dropping_after_sharing_keys(identity, spied, tmp_path):
    """(c) Three of ten clients leave after the key-sharing stage: SecAgg+ removes their
    masks with the others' shares, the round's mean is that of the seven that stayed,
    and the three are the round's failures."""
    grid = NodeGrid(10, tmp_path / "nodes")
    grid.leave = {101, 104, 108}
    rows, run = run_on(grid, recipe(True, clients=10, rounds=1))
    (row,) = rows
    assert row["secagg"]["clients"] == 7 and row["secagg"]["dropped"] == [1, 4, 8]
    assert sorted(row["failures"]) == ["1", "4", "8"]
    assert all("after sharing its keys" in why for why in row["failures"].values())
    # a client that left booked what it was sent and the keys and shares it sent, no
    # masked vector; the round's entries add up to the row's protocol bytes
    booked = {e["client"]: e for e in run.server.ledger.to_rows()}
    gone = [booked[c]["up_secagg"] for c in (1, 4, 8)]
    assert 0 < max(gone) < min(booked[c]["up_secagg"] for c in (0, 2, 3, 5, 6, 7, 9))
    assert all(booked[c]["down_secagg"] > 0 for c in (1, 4, 8))
    for way in ("down", "up"):
        assert sum(e[f"{way}_secagg"] for e in booked.values()) == row["secagg"][f"bytes_{way}"]

    (uploads,) = spied["server"]
    assert [client for client, _, _ in uploads] == [0, 2, 3, 5, 6, 7, 9]
    mean, offer = uploads[0][2], run.server.template.state_dict()
    key = next(k for k, v in mean.items() if v.is_floating_point() and v.numel() > 100)
    start = 0
    for k, v in mean.items():  # where ``key`` lies in a held vector
        if k == key:
            break
        start += v.numel()
    held = dict(spied["held"])
    weights = {client: w for client, w, _ in uploads}
    own = {c: held[c][start : start + mean[key].numel()] for c in weights}
    expected = sum(w * own[c] for c, w in weights.items()) / sum(weights.values())
    got = (mean[key].double() - offer[key].double()).reshape(-1)
    assert (got - expected).abs().max() < 1e-5


def test_what_cannot_be_summed_is_refused_before_round_one(identity, tmp_path):
    """(d) A plugin that may need each client's upload (FedNova divides each client's
    change by its own step count) is refused naming it; so is another executor."""
    grid = NodeGrid(3, tmp_path / "nodes")
    with pytest.raises(RecipeError, match=r"plugins\.1: .*fednova may read each client"):
        engine.prepare(
            recipe(True, plugins=("fedavg", "fednova")),
            executor=on_grid(grid),
        )
    bad = recipe(True, secure_aggregation={"num_shares": 5, "reconstruction_threshold": 5})
    with pytest.raises(RecipeError, match="SecAgg\\+ accepts: `reconstruction_threshold` must"):
        engine.prepare(bad, executor=on_grid(grid))
    with pytest.raises(RecipeError, match="engine.secure_aggregation: expected the flower"):
        validate(tiny_recipe(engine={"executor": "sequential", "secure_aggregation": True}))
    declared = SimpleNamespace(
        recipe=recipe(True, plugins=("fedavg", "dp", "fedopt")), available=None
    )
    assert secagg.weighting(declared) == "unweighted"  # DP-FedAvg's mean weighs clients alike
    declared.recipe = recipe(True, plugins=("fedavg", "fedprox", "scaffold"))
    assert secagg.weighting(declared) == "weighted"
