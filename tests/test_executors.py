"""Executors: Ray gives the same numbers as the sequential executor, and no client's kept
memory reaches the driver (faults under Ray: ``test_ray_faults.py``)."""

from __future__ import annotations

import pytest
import torch
from conftest import Spy, run_all, same_pools, ssl_recipe, tiny_recipe

from fedkit.config.schema import validate
from fedkit.core.engine import prepare, run_round
from fedkit.testing import assert_same_runs, run_recipe

pytestmark = pytest.mark.slow  # a Ray cluster

ray = pytest.importorskip(
    "ray", reason="the ray extra is not installed (pip install 'fedkit-fl[ray]')"
)


# Plain FedAvg is CLOCKED["sync-deadline"] below (its rows, ledger and models), and
# test_ray_faults.py compares it again: each Ray run here costs ~10-20 s of actor start.
RECIPES = {
    "fedu+dapu": ssl_recipe("fedu", ("dapu", {"mu": 0.05}), rounds=2),
    "ifca": tiny_recipe(plugins=[{"ifca": {"num_clusters": 2}}], data={"num_clients": 4}),
}

# The virtual clock on (systems:): a synchronous round whose deadline and the clients'
# windows drop someone, and asynchronous FedBuff steps that hold jobs across steps.
CLOCKED = {
    "sync-deadline": tiny_recipe(
        data={"num_clients": 5},
        federation={"clients_per_round": 2, "rounds": 2},
        systems={
            "speed": {"median": 100.0, "sigma": 1.0},
            "availability": {"model": "diurnal", "period": 30.0, "online": 0.6},
            "deadline": 4.0,
            "over_selection": 1.5,
        },
        evaluation={"protocol": "none", "every": 0},
    ),
    "async-fedbuff": tiny_recipe(
        data={"num_clients": 5},
        federation={"clients_per_round": 1, "rounds": 3},
        plugins=["fedavg", "fedbuff"],
        systems={"mode": "async", "concurrency": 3, "speed": {"sigma": 1.0}},
        evaluation={"protocol": "none", "every": 0},
    ),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_ray_gives_the_same_metrics_as_sequential(ray_cluster, name):
    """Clients compute at ``engine.num_cpus`` (1) threads under both executors, and the
    driver keeps its own count. That the numbers do not depend on the driver's thread
    count is tests/test_reliability.py's (in one process: a two-thread driver beside the
    suite's other processes on 2 cores spins for minutes)."""
    before = torch.get_num_threads()
    seq_rows, seq_pool = run_all(RECIPES[name], "sequential")
    ray_rows, ray_pool = run_all(RECIPES[name], "ray")
    assert torch.get_num_threads() == before  # the server's side keeps the process's count
    assert ray_rows == seq_rows
    assert same_pools(ray_pool, seq_pool)


@pytest.mark.parametrize("name", list(CLOCKED))
def test_ray_gives_the_sequential_run_with_the_clock_on(ray_cluster, name):
    """Rows (``virtual_time``, failures, staleness), ledger and models are the same: both
    executors time the same bytes and samples, and Ray's actors hold async jobs alike."""
    raw = CLOCKED[name]
    sequential = run_recipe(raw)
    ray_run = run_recipe({**raw, "engine": {"executor": "ray", "workers": 2}})
    assert_same_runs(sequential, ray_run)
    rows = sequential.rows
    assert rows[-1]["virtual_time"] > 0
    if name == "sync-deadline":
        assert any("deadline" in str(row.get("failures")) for row in rows)
    else:
        assert max(row["staleness_max"] for row in rows) >= 1


class Recording:
    """Stands in for the ``ray`` module in an executor: what ``ray.get`` hands the driver
    is pickled and kept, so a test can search it for bytes that must not be there."""

    def __init__(self, ray_module) -> None:
        self.ray, self.received = ray_module, bytearray()

    def get(self, refs, *args, **kwargs):
        import pickle

        value = self.ray.get(refs, *args, **kwargs)
        self.received += pickle.dumps(value)
        return value

    def __getattr__(self, name):
        return getattr(self.ray, name)


def test_no_clients_kept_memory_reaches_the_driver(ray_cluster):
    raw = tiny_recipe(plugins=["fedavg", "fedbn"], federation={"rounds": 2})
    raw["engine"] = {"executor": "ray", "workers": 2}
    run = prepare(validate(raw))
    spy = Spy()
    run.plugins.add(spy, "spy")  # server side: sees the uploads as they arrived
    recording = run.executor.ray = Recording(ray)
    rows = [run_round(run, r) for r in (1, 2)]
    run.executor.ray = ray  # inspecting memories below fetches them: stop recording
    received = bytes(recording.received)
    template = run.server.template.state_dict()
    checked = 0
    for cid in range(3):
        kept = run.executor.memory(cid).model
        for key in sorted(run.server.private):
            value = kept[key]
            if value.numel() < 8 or torch.equal(value, template[key]):
                continue  # too short to be told apart, or still the template's
            assert value.numpy().tobytes() not in received, (
                f"client {cid}'s {key} reached the driver"
            )
            checked += 1
    assert checked >= 10
    # what clients send does reach it, and the search finds it there
    upload = spy.uploads[2][0].tensors
    key = next(k for k in upload if upload[k].numel() >= 8)
    assert upload[key].numpy().tobytes() in received
    assert rows[-1]["client_accuracy"]  # evaluation ran on the actors: scores only came back
    run.close()
