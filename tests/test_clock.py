"""The virtual clock (``systems:``, fedkit/core/clock.py and availability.py): durations from
work and bytes on hand numbers, availability windows, deadlines, over-selection, the same
run from the same seed, and a resumed run identical to an uninterrupted one."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import prepared

from fedkit.cli.report import RunData, pyplot, virtual_time_plot
from fedkit.config.schema import validate
from fedkit.core.clock import Clock, Device, mbps
from fedkit.core.engine import run_round
from fedkit.core.messages import ClientResult
from fedkit.core.runs import execute, resume, run
from fedkit.errors import RecipeError
from fedkit.plugin.ledger import Ledger
from fedkit.rundir.logs import read_metrics, split_row
from fedkit.testing import assert_same_runs, run_recipe, tiny_recipe


def clock(systems: dict, clients_per_round: int = 2, **sections) -> Clock:
    fed = {"clients_per_round": clients_per_round, "local_epochs": 2}
    return Clock(validate(tiny_recipe(systems=systems, federation=fed, **sections)))


class FakeServer:
    """What the clock reads of the server: the round, the ledger and the pool."""

    def __init__(self, pool_bytes: int = 4000) -> None:
        self.round = 1
        self.ledger = Ledger()
        self.pool = [{"w": torch.zeros(pool_bytes // 4)}]


def reply(client: int, samples: int, up_bytes: int = 400) -> ClientResult:
    upload = {"w": torch.zeros(up_bytes // 4)}
    return ClientResult(client, 0, float(samples), upload, [0], {"loss": 0.25})


def test_a_job_lasts_its_bytes_over_bandwidth_plus_its_samples_over_speed():
    device = Device(speed=100.0, down=mbps(8), up=mbps(4), latency=0.5)
    assert device.duration(2e6, 300, 1e6) == pytest.approx(0.5 + 2.0 + 3.0 + 2.0)
    fixed = {"speed": {"median": 10.0}, "link": {"down_mbps": 0.008, "up_mbps": 0.008}}
    c, server = clock(fixed), FakeServer()
    server.ledger.record(1, 3, "down", {"extra": torch.zeros(250)})  # a downlink: 1000 bytes
    # down: 1000 (downlink) + 4000 (the cluster it fetched); up: 400 + "loss" "0.25" (8)
    seconds = c.job_seconds(server, reply(3, samples=50), {})
    assert seconds == pytest.approx((1000 + 4000) / 1000 + 50 * 2 / 10 + (400 + 8) / 1000)


def test_speeds_and_links_are_drawn_per_client_from_the_seed_or_read_from_a_file(tmp_path):
    spread = {"speed": {"median": 100.0, "sigma": 1.0}, "link": {"sigma": 0.5}}
    a, b = clock(spread), clock(spread)
    assert [a.device(c) for c in range(5)] == [b.device(c) for c in range(5)]
    assert len({a.device(c).speed for c in range(5)}) == 5
    other = Clock(validate(tiny_recipe(systems=spread, seed=1)))
    assert other.device(0) != a.device(0)
    file = tmp_path / "devices.csv"
    file.write_text("speed,down_mbps,up_mbps,latency\n50,8,4,0.1\n25,16,8,\n")
    read = clock({"devices": str(file), "link": {"latency": 2.0}})
    assert read.device(0) == Device(50.0, 1e6, 5e5, 0.1)
    assert read.device(3) == Device(25.0, 2e6, 1e6, 2.0)  # row 3 mod 2, the link's latency
    file.write_text("speed,down_mbps\n50,8\n")
    with pytest.raises(RecipeError, match="up_mbps"):
        clock({"devices": str(file)})
    pickled = tmp_path / "client_device_capacity"
    pickled.write_bytes(b"\x80\x04K\x01.")  # FedScale's device file is a pickle
    with pytest.raises(RecipeError, match="pickles are not read"):
        clock({"devices": str(pickled)})


def test_the_clock_is_off_by_default_and_a_section_turns_it_on():
    assert not validate(tiny_recipe()).systems.enabled
    assert validate(tiny_recipe(systems={"deadline": 5})).systems.enabled
    assert not validate(tiny_recipe(systems={"enabled": False, "deadline": 5})).systems.enabled
    with pytest.raises(RecipeError, match="systems.availability"):
        validate(tiny_recipe(systems={"availability": {"model": "trace"}}))


def test_a_client_outside_its_window_is_never_sampled(tmp_path):
    diurnal = {"availability": {"model": "diurnal", "period": 100.0, "online": 0.3}}
    c = clock(diurnal, clients_per_round=3, data={"num_clients": 40})
    for r in range(1, 30):
        chosen = c.sample(r, None, 40)
        reachable = {x for x in range(40) if c.availability.until(x, c.now) is not None}
        assert chosen and set(chosen) <= reachable and len(chosen) == 3
        c.now += 7.0
    trace = tmp_path / "windows.jsonl"
    rows = ['{"client": 0, "start": 0, "end": 1000}', '{"client": 1, "start": 0, "end": 10}']
    trace.write_text("\n".join(rows) + "\n")
    spec = {"model": "trace", "trace": str(trace), "period": 1000.0}
    c = clock({"availability": spec}, clients_per_round=2, data={"num_clients": 6})
    c.now = 500.0  # odd clients follow trace client 1, reachable only in [0, 10) of 1000
    for r in range(1, 20):
        assert all(x % 2 == 0 for x in c.sample(r, None, 6))
    assert c.availability.until(3, 2005.0) == 2010.0  # the trace repeats every period
    ok, away = c.reachable([2, 3])
    assert ok == [2] and [(f.client, f.failure) for f in away] == [(3, "unavailable")]


def test_the_sampler_touches_the_cohort_not_the_population():
    diurnal = {"availability": {"model": "diurnal", "online": 0.5}}
    c = clock(diurnal, clients_per_round=5, data={"num_clients": 10})
    c.sample(1, None, 10**9)  # a billion registered clients: draws a few dozen at most
    assert len(c.availability._phases) <= 5 * 50


def test_deadline_drops_and_over_selection_keeps_the_first_k():
    fixed = {"speed": {"median": 10.0}, "link": {"down_mbps": 8.0, "up_mbps": 8.0}}
    # client c trains 10·c samples twice at 10/s: about 2c seconds (plus ~0.005 s of bytes)
    c, server = clock({**fixed, "deadline": 9.0, "over_selection": 2.0}), FakeServer()
    assert c.wanted(10) == 4 and c.wanted(3) == 3
    failed = ClientResult.failed(9, "exception", "boom")
    out = c.settle(server, [reply(5, 50), reply(2, 20), failed, reply(1, 10), reply(3, 30)])
    kinds = {r.client: r.failure for r in out}
    assert kinds == {9: "exception", 1: None, 2: None, 3: "over-selected", 5: "deadline"}
    assert c.now == pytest.approx(4.0, abs=0.01)  # the second to finish ends the round
    assert next(r for r in out if r.client == 5).fetched == [0]  # its download is booked
    c.settle(server, [reply(1, 10), reply(5, 50)])  # one kept of two wanted: to the deadline
    assert c.now == pytest.approx(4.0 + 9.0, abs=0.01)


def test_a_client_that_leaves_mid_job_drops_out(tmp_path):
    trace = tmp_path / "windows.csv"
    trace.write_text("client,start,end\n0,0,100\n1,0,3\n")
    spec = {"model": "trace", "trace": str(trace), "period": 100.0}
    fixed = {"speed": {"median": 10.0}, "link": {"down_mbps": 8.0, "up_mbps": 8.0}}
    c = clock({**fixed, "availability": spec})
    out = c.settle(FakeServer(), [reply(0, 20), reply(1, 20)])  # 4 s jobs; client 1 leaves at 3
    assert [(r.client, r.failure) for r in out] == [(0, None), (1, "unavailable")]
    assert "left at virtual time 3.0s" in out[1].error
    assert c.now == pytest.approx(4.0, abs=0.01)


SYSTEMS = {
    "speed": {"median": 100.0, "sigma": 1.0},
    "link": {"down_mbps": 20.0, "up_mbps": 10.0, "sigma": 0.5},
    "availability": {"model": "diurnal", "period": 30.0, "online": 0.6},
    "deadline": 4.0,
    "over_selection": 1.5,
}


@pytest.mark.slow
def test_without_availability_or_deadline_the_clock_only_adds_virtual_time():
    plain = run_recipe(tiny_recipe(), rounds=1)
    timed = run_recipe(tiny_recipe(systems={"speed": {"sigma": 1.0}}), rounds=1)
    assert_same_runs(plain, timed, ignore=["virtual_time"])
    assert "virtual_time" not in plain.rows[0] and timed.rows[0]["virtual_time"] > 0


@pytest.mark.slow
def test_a_resumed_run_times_and_samples_as_an_uninterrupted_one(tmp_path):
    recipe = tiny_recipe(systems=SYSTEMS, federation={"clients_per_round": 2, "rounds": 3})
    whole = run_recipe(recipe)
    times = [r["virtual_time"] for r in whole.rows]
    assert times == sorted(times) and len(set(times)) == 3
    assert [len(r["clients"]) for r in whole.rows] == [2, 3, 3]  # one away in round 1
    assert whole.rows[0]["failures"]["0"].startswith("deadline")
    first = tiny_recipe(systems=SYSTEMS, federation={"clients_per_round": 2, "rounds": 1})
    run(first, out=tmp_path / "r")
    again, done = resume(tmp_path / "r", ["federation.rounds=3"])
    assert done == 1 and again.clock is not None and again.clock.now == times[0]
    execute(again, tmp_path / "r", done)
    assert read_metrics(tmp_path / "r") == [split_row(r)[0] for r in whole.rows]
    figure = virtual_time_plot(pyplot(), RunData(tmp_path / "r"))  # the report's plot
    assert list(figure.axes[0].lines[0].get_xdata()) == times


def test_a_reply_naming_a_cluster_that_does_not_exist_is_refused_before_the_clock_times_it():
    """The clock prices a reply by the clusters it says it fetched: a reply naming one
    the pool lacks is refused where it arrives, not an IndexError that ends the round."""
    raw = tiny_recipe(systems={"deadline": 10**6}, evaluation={"protocol": "none"})
    run = prepared(raw)
    honest = run.executor.run

    def forged(jobs):
        for result in honest(jobs):
            yield dataclasses.replace(result, fetched=[7]) if result.client == 0 else result

    run.executor.run = forged
    try:
        row = run_round(run, 1)
    finally:
        run.close()
    assert 0 in row["clients"] and row["failures"]["0"].startswith("refused: fetched")
