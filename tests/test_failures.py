"""Failures are data: a client that raises, uploads a non-finite value, drops out or
answers too late is left out of its round and recorded; the round goes on while at least
``federation.min_clients`` answered, otherwise the run stops with a clear message and an
intact checkpoint. Faults are seeded, so a resumed run meets the same ones."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import prepared, tiny_recipe

from fedkit import hookimpl
from fedkit.config.schema import FaultConfig, validate
from fedkit.core import runs
from fedkit.core.engine import run_round
from fedkit.core.faults import KINDS, draw
from fedkit.errors import RoundFailed
from fedkit.rundir import logs


def recipe(**faults):
    return tiny_recipe(
        data={"num_clients": 6, "max_train": 240},
        federation={"rounds": 3, "clients_per_round": 6},
        faults=faults,
    )


def finite(run) -> bool:
    return all(
        bool(torch.isfinite(v).all())
        for s in run.server.pool
        for v in s.values()
        if v.is_floating_point()
    )


class Flaky:
    """Client 1 raises inside local training."""

    @hookimpl
    def local_train(self, ctx, model):
        if ctx.id == 1:
            raise ValueError("flaky client")


def test_an_exception_leaves_the_client_out_and_is_recorded():
    run = prepared(tiny_recipe(plugins=["flaky", "fedavg"]), flaky=Flaky())
    row = run_round(run, 1)
    assert row["failures"] == {
        "1": "exception: plugin 'flaky' failed in hook 'local_train': ValueError: flaky client"
    }
    assert set(row["per_client"]) == {"0", "2"}
    assert run.server.roster[1].participations == 0 and run.executor.store.get(1) is None
    assert all(r["client"] != 1 or r["up_model"] == 0 for r in run.server.ledger.to_rows())
    assert finite(run)


@pytest.mark.slow
def test_a_nan_upload_is_refused_and_the_global_model_stays_finite():
    run = prepared(recipe(nan=0.5))
    rows = [run_round(run, r) for r in (1, 2, 3)]
    failed = [(r["round"], c, e) for r in rows for c, e in r.get("failures", {}).items()]
    assert failed and all(e.startswith("non-finite: upload key") for _, _, e in failed)
    assert all(len(r["per_client"]) + len(r.get("failures", {})) == 6 for r in rows)
    assert finite(run)


def test_dropouts_and_exceptions_follow_the_seeded_draw():
    raw = recipe(exception=0.3, dropout=0.3)
    run = prepared(raw)
    row = run_round(run, 1)
    cfg = validate(raw).faults
    expected = {c: draw(cfg, 0, 1, c) for c in range(6)}
    assert {int(c) for c in row["failures"]} == {c for c, f in expected.items() if f}
    for cid, error in row["failures"].items():
        assert error.startswith(expected[int(cid)])


@pytest.mark.slow
def test_a_client_past_the_deadline_is_a_timeout():
    raw = recipe(straggler=0.5, delay=1.5)
    raw["federation"]["client_timeout"] = 1.0
    run = prepared(raw)
    began = time.perf_counter()
    row = run_round(run, 1)
    slow = {c for c in range(6) if draw(validate(raw).faults, 0, 1, c) == "straggler"}
    assert slow and {int(c) for c in row["failures"]} == slow
    assert all("client_timeout" in row["failures"][str(c)] for c in slow)
    assert time.perf_counter() - began >= 1.5


def test_below_quorum_stops_the_run_with_its_checkpoint_intact(tmp_path):
    raw = recipe(exception=0.5)
    raw["federation"]["min_clients"] = 5
    recipe_ = validate(raw)
    answered = [sum(draw(recipe_.faults, 0, r, c) is None for c in range(6)) for r in (1, 2, 3)]
    stop = next(r for r, n in enumerate(answered, 1) if n < 5)  # the draw decides where
    out = tmp_path / "run"
    run = runs.start(recipe_, out)
    message = rf"round {stop}: {answered[stop - 1]} of 6 clients answered.*min_clients \(5\)"
    with pytest.raises(RoundFailed, match=message):
        runs.execute(run, out)
    assert [r["round"] for r in logs.read_metrics(out)] == list(range(1, stop))
    (trace,) = logs.read_stops(out)  # the failed round's clients, kept past the resume
    failed = {c for c in range(6) if draw(recipe_.faults, 0, stop, c) is not None}
    assert trace["round"] == stop and {f["client"] for f in trace["failures"]} == failed
    assert all(f["kind"] == "exception" for f in trace["failures"])
    _, done = runs.resume(out)
    assert done == stop - 1
    assert logs.read_stops(out) == [trace]


@pytest.mark.slow
def test_faults_are_the_same_on_resume(tmp_path):
    raw = recipe(exception=0.2, nan=0.2, dropout=0.1)
    full = runs.start(validate(raw), tmp_path / "full")
    runs.execute(full, tmp_path / "full")
    half = runs.start(validate(raw), tmp_path / "half")
    runs.commit(half, tmp_path / "half", [run_round(half, 1)], 1)
    resumed, done = runs.resume(tmp_path / "half")
    runs.execute(resumed, tmp_path / "half", done)
    for read in (logs.read_metrics, logs.read_clients, logs.read_ledger):
        assert read(tmp_path / "half") == read(tmp_path / "full")
    failures = logs.read_jsonl(tmp_path / "full" / "failures.jsonl")
    assert failures and failures == logs.read_jsonl(tmp_path / "half" / "failures.jsonl")


def test_fault_probabilities_must_sum_to_at_most_one():
    with pytest.raises(Exception, match="at most 1"):
        FaultConfig(exception=0.6, nan=0.6)
    assert set(KINDS) == {"exception", "dropout", "nan", "straggler", "crash"}


def test_a_non_finite_upload_is_refused_on_the_client_so_only_its_download_is_booked():
    """The worker checks its upload before sending (as a node would): nothing goes up,
    and the ledger, which books what travels, has the download alone."""
    raw = recipe(nan=0.5)
    run = prepared(raw)
    row = run_round(run, 1)
    bad = {int(c) for c, why in row.get("failures", {}).items() if why.startswith("non-finite")}
    assert bad
    for entry in run.server.ledger.to_rows():
        if entry["client"] in bad:
            assert entry["up_model"] == entry["up_aux"] == entry["up_data"] == 0
            assert entry["down_model"] > 0
        else:
            assert entry["up_model"] > 0


def test_a_retried_client_is_kept_in_failures_jsonl_as_a_trace(tmp_path):
    """An executor that ran a job again (a Ray worker died) marks the answer; the round
    keeps it, and failures.jsonl records it as retried, not as a failure."""
    out = tmp_path / "run"
    run = runs.start(validate(recipe()), out)
    row = run_round(run, 1)
    row["retried"] = {"2": "its worker died: the actor exited"}
    runs.commit(run, out, [row], 1)
    (trace,) = logs.read_failures(out)
    assert trace == {
        "round": 1,
        "client": 2,
        "error": "its worker died: the actor exited",
        "retried": True,
    }
