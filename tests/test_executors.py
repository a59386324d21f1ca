"""Executors: Ray gives the same numbers as the sequential executor, replaces a worker
that dies and retries its client, abandons a client past its deadline; runs killed with
SIGKILL at seeded random moments (on Ray, and with the disk store) resume to exactly the
same results as uninterrupted ones."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch
from conftest import Spy, tiny_recipe
from test_resume import checkpoint_round, fedkit
from test_ssl_plugins import ssl_recipe

from fedkit.config.schema import validate
from fedkit.core import runs
from fedkit.core.engine import prepare, run_round
from fedkit.core.faults import draw
from fedkit.rundir import checkpoint, logs
from fedkit.seeding import derive

ray = pytest.importorskip(
    "ray", reason="the ray extra is not installed (pip install 'fedkit[ray]')"
)


@pytest.fixture(scope="module")
def ray_cluster():
    """A small local Ray cluster for this module (2 CPUs, no dashboard), shut down after."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def run_all(raw, executor: str):
    raw = {**raw, "engine": {**raw.get("engine", {}), "executor": executor, "workers": 2}}
    run = prepare(validate(raw))
    try:
        rows = [run_round(run, r) for r in range(1, run.recipe.federation.rounds + 1)]
        return rows, [dict(s) for s in run.server.pool]
    finally:
        run.close()


def same_pools(a, b) -> bool:
    return all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


RECIPES = {
    "fedavg": tiny_recipe(federation={"rounds": 2, "clients_per_round": 3}),
    "fedu+dapu": ssl_recipe("fedu", ("dapu", {"mu": 0.05}), rounds=2),
    "ifca": tiny_recipe(plugins=[{"ifca": {"num_clusters": 2}}], data={"num_clients": 4}),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_ray_gives_the_same_metrics_as_sequential(ray_cluster, name):
    seq_rows, seq_pool = run_all(RECIPES[name], "sequential")
    ray_rows, ray_pool = run_all(RECIPES[name], "ray")
    assert ray_rows == seq_rows
    assert same_pools(ray_pool, seq_pool)


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
    assert crashed_rows == plain_rows  # the crashed client was retried and answered
    assert same_pools(crashed_pool, plain_pool)


def test_a_client_past_its_deadline_is_abandoned(ray_cluster):
    raw = tiny_recipe(
        data={"num_clients": 4},
        federation={"rounds": 1, "clients_per_round": 4, "client_timeout": 5.0},
        faults={"straggler": exactly_one(4), "delay": 60.0},
    )
    began = time.monotonic()
    rows, pool = run_all(raw, "ray")
    failures = rows[0].get("failures", {})
    assert len(failures) == 1 and all("client_timeout" in e for e in failures.values())
    assert len(rows[0]["per_client"]) + len(failures) == 4
    assert time.monotonic() - began < 50  # nobody waited for the straggler
    assert all(bool(torch.isfinite(v).all()) for v in pool[0].values() if v.is_floating_point())


def kill_and_resume(path, out, seed: int, rounds: int, kills: int = 5) -> list[int]:
    """Start the run and SIGKILL it ``kills`` times at seeded random moments — once the
    checkpoint reached a random round, plus a random fraction of a second, so kills land
    mid-round and mid-checkpoint — resuming after each; then let it finish. Returns the
    checkpointed round at each kill."""
    rng = np.random.default_rng(seed)
    targets, delays = sorted(rng.integers(0, rounds, kills).tolist()), rng.uniform(0, 0.6, kills)
    proc = fedkit("run", str(path), "--out", str(out), wait=False)
    killed_at = []
    for target, delay in zip(targets, delays, strict=True):
        deadline = time.monotonic() + 300
        while checkpoint_round(out) < target and proc.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(float(delay))
        if proc.poll() is not None:
            break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        killed_at.append(checkpoint_round(out))
        if (out / "recipe.yaml").is_file():
            proc = fedkit("run", "--resume", str(out), wait=False)
        else:  # killed before the run directory existed: start it again
            proc = fedkit("run", str(path), "--out", str(out), wait=False)
    assert proc.wait(timeout=600) == 0
    return killed_at


def test_sigkill_at_random_moments_then_resume_matches(ray_cluster, write_recipe, tmp_path):
    """A Ray run with the disk store (joining this module's cluster, as a run joins an
    existing one; one worker, as each restart pays for starting its actors), killed five
    times, against an uninterrupted sequential run (the two executors give the same
    numbers, tested above)."""
    raw = tiny_recipe(
        data={"num_clients": 5, "max_train": 200},
        federation={"rounds": 6, "clients_per_round": 3},
    )
    full = tmp_path / "full"
    runs.execute(runs.start(validate(raw), full), full)
    address = ray.get_runtime_context().gcs_address
    raw["engine"] = {"executor": "ray", "workers": 1, "store": "disk", "address": address}
    path, killed = write_recipe(raw), tmp_path / "killed"
    killed_at = kill_and_resume(path, killed, seed=7, rounds=6)
    assert len(killed_at) >= 3 and max(killed_at) >= 2  # kills hit the run mid-way
    assert checkpoint_round(killed) == 6
    for read in (logs.read_metrics, logs.read_clients, logs.read_ledger):
        assert read(killed) == read(full)
    a, b = (checkpoint.read(out).pool for out in (full, killed))
    assert a.keys() == b.keys() and all(same_pools([a[k]], [b[k]]) for k in a)
