"""Faults under Ray: a worker that dies is replaced and its client retried, a client past
its deadline is abandoned, and runs killed with SIGKILL at seeded random moments (on Ray,
and with the disk store) resume to exactly the same results as uninterrupted ones."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
from conftest import checkpoint_round, run_all, run_fedkit, same_pools, tiny_recipe

from fedkit.config.schema import validate
from fedkit.core import runs
from fedkit.core.engine import prepare, run_round
from fedkit.core.faults import draw
from fedkit.rundir import checkpoint, logs
from fedkit.seeding import derive

pytestmark = pytest.mark.slow  # a Ray cluster, workers killed

ray = pytest.importorskip(
    "ray", reason="the ray extra is not installed (pip install 'fedkit-fl[ray]')"
)


def exactly_one(clients: int) -> float:
    """A fault probability that makes exactly one of round 1's clients meet the fault
    (the draw is seeded by (seed, round, client), so this is known in advance)."""
    draws = sorted(np.random.default_rng(derive(0, "fault", 1, c)).random() for c in range(clients))
    return (draws[0] + draws[1]) / 2


def test_a_dead_worker_is_replaced_and_its_client_retried(ray_cluster):
    raw = tiny_recipe(
        federation={"rounds": 1, "clients_per_round": 3}, faults={"crash": exactly_one(3)}
    )
    assert sum(draw(validate(raw).faults, 0, 1, c) == "crash" for c in range(3)) == 1
    crashed_rows, crashed_pool = run_all(raw, "ray")
    plain_rows, plain_pool = run_all({**raw, "faults": {}}, "sequential")
    (crashed,) = (c for c in range(3) if draw(validate(raw).faults, 0, 1, c) == "crash")
    trace = crashed_rows[0].pop("retried")  # the retry leaves a trace, nothing else
    assert list(trace) == [str(crashed)] and "its worker died" in trace[str(crashed)]
    assert crashed_rows == plain_rows  # the crashed client was retried and answered
    assert same_pools(crashed_pool, plain_pool)


def test_a_client_past_its_deadline_is_abandoned(ray_cluster):
    raw = tiny_recipe(
        data={"num_clients": 4},
        federation={"rounds": 1, "clients_per_round": 4, "client_timeout": 5.0},
        faults={"straggler": exactly_one(4), "delay": 300.0},
    )
    began = time.monotonic()
    rows, pool = run_all(raw, "ray")
    failures = rows[0].get("failures", {})
    assert len(failures) == 1 and all("client_timeout" in e for e in failures.values())
    assert len(rows[0]["per_client"]) + len(failures) == 4
    assert time.monotonic() - began < 150  # nobody waited for the 300 s straggler
    assert all(bool(torch.isfinite(v).all()) for v in pool[0].values() if v.is_floating_point())


def test_a_worker_killed_between_rounds_is_replaced_before_the_next(ray_cluster):
    """A worker process that dies while idle (here after round 1) is found dead when the
    next round checks its actors, and replaced: the run goes on, with the numbers of a
    run nobody killed (the soak in test_chaos_soak found this)."""
    raw = tiny_recipe(federation={"rounds": 2, "clients_per_round": 3})
    raw["engine"] = {"executor": "ray", "workers": 1}
    run = prepare(validate(raw))
    try:
        rows = [run_round(run, 1)]
        (actor,) = run.executor.actors
        os.kill(ray.get(actor.pid.remote()), signal.SIGKILL)
        rows.append(run_round(run, 2))
        assert run.executor.actors[0] is not actor
        pool = [dict(s) for s in run.server.pool]
    finally:
        run.close()
    plain_rows, plain_pool = run_all(raw, "sequential")
    assert rows == plain_rows and same_pools(pool, plain_pool)


def kill_and_resume(
    path, out, seed: int, rounds: int, kills: int = 5, terms: frozenset[int] = frozenset()
) -> list[int]:
    """Start the run and SIGKILL it ``kills`` times at seeded random moments — once the
    checkpoint reached a random round, plus a random fraction of a second, so kills land
    mid-round and mid-checkpoint — resuming after each; then let it finish. The kills
    numbered in ``terms`` send SIGTERM instead (as a scheduler does first), once a round
    is checkpointed: the run must exit 143. Returns the checkpointed round at each kill."""
    rng = np.random.default_rng(seed)
    targets, delays = sorted(rng.integers(0, rounds, kills).tolist()), rng.uniform(0, 0.6, kills)
    proc = run_fedkit("run", str(path), "--out", str(out), wait=False)
    killed_at = []
    for number, (target, delay) in enumerate(zip(targets, delays, strict=True)):
        term = number in terms
        deadline = time.monotonic() + 300
        while checkpoint_round(out) < max(target, 1 if term else 0) and proc.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(float(delay))
        if proc.poll() is not None:
            break
        os.kill(proc.pid, signal.SIGTERM if term else signal.SIGKILL)
        code = proc.wait(timeout=120)
        if term:  # unless the run ended first
            assert code == 143 or checkpoint_round(out) == rounds, (number, code)
        killed_at.append(checkpoint_round(out))
        if (out / "recipe.yaml").is_file():
            proc = run_fedkit("run", "--resume", str(out), wait=False)
        else:  # killed before the run directory existed: start it again
            proc = run_fedkit("run", str(path), "--out", str(out), wait=False)
    assert proc.wait(timeout=600) == 0
    return killed_at


def test_sigkill_at_random_moments_then_resume_matches(ray_cluster, write_recipe, tmp_path):
    """A Ray run with the disk store (joining this module's cluster, as a run joins an
    existing one; one worker, as each restart pays for starting its actors), killed three
    times (before its first checkpoint, after rounds 1 and 2), against an uninterrupted
    sequential run (the two executors give the same numbers, tested in test_executors).
    The second stop is a SIGTERM: Ray's own handler would abort with exit 134, fedkit's
    exits 143 (the message is checked in test_reliability)."""
    raw = tiny_recipe(
        data={"num_clients": 5, "max_train": 200},
        federation={"rounds": 4, "clients_per_round": 3},
    )
    full = tmp_path / "full"
    runs.execute(runs.start(validate(raw), full), full)
    address = ray.get_runtime_context().gcs_address
    raw["engine"] = {"executor": "ray", "workers": 1, "store": "disk", "address": address}
    path, killed = write_recipe(raw), tmp_path / "killed"
    killed_at = kill_and_resume(path, killed, seed=8, rounds=4, kills=3, terms=frozenset({1}))
    assert len(killed_at) >= 2 and max(killed_at) >= 1  # kills hit the run mid-way
    assert checkpoint_round(killed) == 4
    for read in (logs.read_metrics, logs.read_clients, logs.read_ledger):
        assert read(killed) == read(full)
    a, b = (checkpoint.read(out).pool for out in (full, killed))
    assert a.keys() == b.keys() and all(same_pools([a[k]], [b[k]]) for k in a)


class DiesOnEvaluate:
    """An actor handle whose first ``evaluate`` call kills the actor's process just after
    the call is sent, as a worker that dies mid-evaluation."""

    def __init__(self, actor) -> None:
        self.actor, self.pid, self.run, self.evaluate = actor, actor.pid, actor.run, self
        self.process = ray.get(actor.pid.remote())

    def remote(self, *args):
        ref = self.actor.evaluate.remote(*args)
        os.kill(self.process, signal.SIGKILL)
        return ref


def test_a_worker_that_dies_mid_evaluation_has_its_client_evaluated_again(ray_cluster):
    """Evaluation changes nothing, so a retry on a fresh actor scores exactly what the
    first attempt would have: the row equals a sequential run's but for the trace (the
    soak in test_chaos_soak found rows that lost a client's scores)."""
    raw = tiny_recipe(federation={"rounds": 1, "clients_per_round": 3})
    raw["engine"] = {"executor": "ray", "workers": 1}
    run = prepare(validate(raw))
    try:
        run.executor.actors[0] = DiesOnEvaluate(run.executor.actors[0])
        row = run_round(run, 1)
        assert not isinstance(run.executor.actors[0], DiesOnEvaluate)  # replaced
    finally:
        run.close()
    trace = row.pop("eval_retried")
    assert len(trace) == 1 and "its worker died" in next(iter(trace.values()))
    assert "eval_failures" not in row
    (plain,), _ = run_all(raw | {"engine": {}}, "sequential")
    assert row == plain
