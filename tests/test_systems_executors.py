"""The isolated executor (each job pickled as a worker process would receive it) gives the
sequential executor's rows, ledger and models with the virtual clock on: synchronous
rounds that drop clients (deadline, availability, over-selection) and asynchronous
FedBuff steps with jobs held across steps."""

from __future__ import annotations

import pytest

from fedkit.testing import assert_same_runs, run_recipe, tiny_recipe

DROPPING = {
    "speed": {"median": 100.0, "sigma": 1.0},
    "availability": {"model": "diurnal", "period": 30.0, "online": 0.6},
    "deadline": 4.0,
    "over_selection": 1.5,
}
ASYNC = {"mode": "async", "concurrency": 3, "speed": {"sigma": 1.0}}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("systems", "plugins", "k"),
    [(DROPPING, ["fedavg"], 2), (ASYNC, ["fedavg", "fedbuff"], 1)],
    ids=["sync-dropping", "async-fedbuff"],
)
def test_isolated_executor_gives_the_sequential_run_with_the_clock_on(systems, plugins, k):
    raw = tiny_recipe(
        data={"num_clients": 5},
        federation={"clients_per_round": k, "rounds": 2},
        plugins=plugins,
        systems=systems,
        evaluation={"protocol": "none", "every": 0},
    )
    sequential = run_recipe(raw)
    isolated = run_recipe({**raw, "engine": {**raw.get("engine", {}), "executor": "isolated"}})
    assert_same_runs(sequential, isolated)
    rows = sequential.rows
    assert rows[-1]["virtual_time"] > 0
    if systems is DROPPING:
        assert any(row.get("failures") for row in rows)  # the clock dropped someone
    else:
        assert max(row["staleness_max"] for row in rows) >= 1  # stale jobs were held
