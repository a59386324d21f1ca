"""Asynchronous aggregation (``systems.mode: async``; fedkit/core/asynchronous.py and
plugins/asynchronous.py): FedBuff's and FedAsync's arithmetic on hand-made uploads with
stalenesses, arrivals in the order of their virtual finish, refusals, and a run resumed
from a checkpoint taken with jobs in flight equal to the uninterrupted run."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import activate, prepared

from fedkit.config.schema import validate
from fedkit.core.engine import prepare, run_round
from fedkit.core.runs import execute, start
from fedkit.errors import RecipeError
from fedkit.plugin.server import Upload
from fedkit.rundir import checkpoint
from fedkit.rundir.logs import read_metrics, split_row
from fedkit.testing import run_recipe, tiny_recipe
from fedkit_plugins.asynchronous import FedAsync, FedBuff, staleness_weight


class FakeServer:
    """What the aggregation hooks read of the server: the pool."""

    pool = [{"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}]


def up(client: int, w: list[float], staleness: int = 0, delta: list[float] | None = None):
    d = None if delta is None else {"w": torch.tensor(delta)}
    return Upload(client, 10.0, {"w": torch.tensor(w), "n": torch.tensor(5)}, staleness, d)


def test_fedbuff_averages_staleness_scaled_deltas_times_the_server_lr():
    # client 1 started 3 steps ago: its delta is from that version, not from today's w
    uploads = [up(0, [3.0, 2.0], 0, [2.0, 0.0]), up(1, [9.0, 9.0], 3, [0.0, 4.0])]
    out = FedBuff(FedBuff.Options(lr=0.5)).aggregate(FakeServer(), 0, uploads)
    # w + 0.5 · ([2, 0]/√1 + [0, 4]/√4) / 2
    assert torch.allclose(out["w"], torch.tensor([1.5, 2.5]))
    assert set(out) == {"w"}  # the integer buffer keeps the core's default
    plain = FedBuff(FedBuff.Options(scale_staleness=False)).aggregate(FakeServer(), 0, uploads)
    assert torch.allclose(plain["w"], torch.tensor([2.0, 4.0]))
    synchronous = [up(0, [3.0, 2.0]), up(1, [1.0, 4.0])]  # no delta: upload − the pool's w
    out = FedBuff(FedBuff.Options()).aggregate(FakeServer(), 0, synchronous)
    assert torch.allclose(out["w"], torch.tensor([2.0, 3.0]))


def test_fedasync_mixes_each_upload_in_turn_by_its_staleness():
    plugin = FedAsync(FedAsync.Options(alpha=0.5, staleness="polynomial", a=1.0))
    uploads = [up(0, [3.0, 3.0], staleness=1), up(1, [0.0, 0.0], staleness=0)]
    out = plugin.aggregate(FakeServer(), 0, uploads)
    # α = 0.5/2 for client 0: [1.5, 2.25]; then α = 0.5 for client 1: half of that
    assert torch.allclose(out["w"], torch.tensor([0.75, 1.125]))
    assert staleness_weight("constant", 7, 0.5, 4) == 1.0
    assert staleness_weight("hinge", 4, 10.0, 4.0) == 1.0
    assert staleness_weight("hinge", 6, 10.0, 4.0) == pytest.approx(1 / 21)
    assert staleness_weight("polynomial", 3, 0.5, 4.0) == pytest.approx(0.5)


def async_recipe(rounds: int, *plugins, concurrency: int = 3, **systems):
    return tiny_recipe(
        data={"num_clients": 5},
        federation={"clients_per_round": 1, "rounds": rounds},
        plugins=["fedavg", *plugins],
        systems={"mode": "async", "concurrency": concurrency, "speed": {"sigma": 1.0}, **systems},
        evaluation={"protocol": "supervised", "every": 2},
    )


def test_async_keys_are_checked_in_one_line():
    with pytest.raises(RecipeError, match="concurrency"):
        validate(tiny_recipe(systems={"concurrency": 2}))  # sync has no concurrency
    with pytest.raises(RecipeError, match="Flower"):
        validate({**async_recipe(2), "engine": {"executor": "flower"}})
    with pytest.raises(RecipeError, match="over_selection"):
        validate(async_recipe(2, over_selection=1.5))


@pytest.mark.slow
def test_what_async_cannot_run_is_refused_before_round_one():
    with pytest.raises(RecipeError, match=r"clients_per_round \(2\) ≤ concurrency"):
        raw = async_recipe(2, concurrency=1)
        prepared({**raw, "federation": {**raw["federation"], "clients_per_round": 2}})
    clustered = {**async_recipe(2), "plugins": [{"ifca": {"num_clusters": 2}}]}
    with pytest.raises(RecipeError, match="clustered"):
        prepared(clustered)


def test_each_step_hears_the_jobs_that_finish_first_in_virtual_time():
    diurnal = {"model": "diurnal", "period": 1e5, "online": 0.9}
    recipe, plugins = activate(async_recipe(4, "fedasync", availability=diurnal), fedasync=FedAsync)
    run = prepare(recipe, plugins)
    assert run.flight is not None and run.clock is not None
    heard: list[tuple[float, int]] = []
    for r in range(1, 5):
        before = {j.client: j for j in run.flight.jobs}
        row = run_round(run, r)
        arrived = list(run.flight.arrived.values())
        assert len(arrived) == 1 and len(run.flight.jobs) == 2  # K = 1 of C = 3 in flight
        (job,) = arrived
        heard.append((job.end, job.client))
        assert row["virtual_time"] == round(job.end, 3) == round(run.clock.now, 3)
        assert all(j.end >= job.end for j in run.flight.jobs)  # nobody still out finished first
        assert row["client_staleness"] == {str(job.client): r - job.round}
        if job.client in before:  # started in an earlier step: it is stale
            assert job.round < r
    assert heard == sorted(heard)
    assert max(r - j.round for j in run.flight.jobs) >= 1
    drawn = run.flight.sample(5, 0, 3, set(), None, 10**9)  # a billion registered clients
    assert len(drawn) == 3 and len(run.clock.availability._phases) <= 5 + 3 * 50
    run.close()


@pytest.mark.slow
def test_a_run_resumed_with_jobs_in_flight_equals_the_uninterrupted_run(tmp_path):
    whole_raw = async_recipe(4, {"fedprox": {"mu": 0.01}}, "fedbuff")
    whole = run_recipe(whole_raw, plugins={"fedbuff": FedBuff})
    assert max(r["staleness_max"] for r in whole.rows) >= 1
    first_raw = async_recipe(4, {"fedprox": {"mu": 0.01}}, "fedbuff")
    first_raw["federation"]["rounds"] = 2
    recipe, plugins = activate(first_raw, fedbuff=FedBuff)
    execute(start(recipe, tmp_path, plugins), tmp_path)
    snapshot = checkpoint.read(tmp_path)
    assert snapshot is not None and snapshot.round == 2
    assert len(snapshot.sidecar["flight"]) == 2 and snapshot.held  # two jobs held mid-buffer
    saved = json.loads(json.dumps(snapshot.sidecar["flight"]))
    recipe, plugins = activate(whole_raw, fedbuff=FedBuff)
    again = prepare(recipe, plugins, snapshot=snapshot, out=tmp_path)
    assert [j.meta() for j in again.flight.jobs] == saved
    execute(again, tmp_path, 2)
    assert read_metrics(tmp_path) == [split_row(r)[0] for r in whole.rows]


@pytest.mark.slow
def test_failed_jobs_free_their_slots_and_dp_and_the_ledger_compose():
    skewed = {"speed": {"median": 100.0, "sigma": 1.5}, "deadline": 4.0}
    raw = async_recipe(4, {"dp": {"clip": 1.0, "noise_multiplier": 0.5}}, concurrency=3)
    raw["federation"]["clients_per_round"] = 2
    raw["systems"].update(skewed)
    result = run_recipe(raw)
    failures = [(r["round"], c, e) for r in result.rows for c, e in r.get("failures", {}).items()]
    assert failures and all(e.startswith("deadline") for _, _, e in failures)
    for row in result.rows:  # every step heard two successes, refilling failed slots
        assert len(row["client_staleness"]) == 2
        assert not set(row["client_staleness"]) & set(row.get("failures", {}))
        assert row["bytes"]["up_model"] > 0 and "dp_epsilon" in row
    uploads = {(e["round"], e["client"]) for e in result.ledger if e.get("up_model")}
    heard = {(r["round"], int(c)) for r in result.rows for c in r["client_staleness"]}
    assert uploads == heard  # the ledger books each upload in the step that heard it
