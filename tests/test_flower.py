"""The ``flower`` executor: every built-in plugin, in every combination the contract tests
use, gives the same metrics and pool under Flower's simulation runtime as under the
sequential executor; nothing a client keeps privately reaches the server; cluster states
travel on demand and the ledger books what is sent; a run resumes from a checkpoint
whose client files the nodes wrote."""

from __future__ import annotations

import pytest
from conftest import prepared, tiny_recipe
from test_contract import COMBOS, with_logdir
from test_executors import same_pools
from test_ssl_plugins import ssl_recipe

from fedkit.config.schema import EngineConfig, validate
from fedkit.core import runs
from fedkit.core.engine import run_round
from fedkit.rundir import checkpoint, logs
from fedkit.rundir.integrity import sha256_bytes
from fedkit.rundir.store import MEMORIES

pytest.importorskip(
    "flwr", reason="the flower extra is not installed (pip install 'fedkit[flower]')"
)

from fedkit.flower import supernode  # noqa: E402
from fedkit.flower.flower_executor import use_link  # noqa: E402
from fedkit.flower.records import get_meta, state_keys  # noqa: E402
from fedkit.flower.simulation import SimulationLink  # noqa: E402

NODES = 6


class Recording:
    """The grid as the server uses it, keeping every reply it receives."""

    def __init__(self, grid):
        self.grid, self.replies = grid, []

    def __getattr__(self, name):
        return getattr(self.grid, name)

    def pull_messages(self, ids):
        replies = list(self.grid.pull_messages(ids))
        self.replies.extend(replies)
        return replies


@pytest.fixture(scope="module")
def link():
    """One Flower simulation (Ray, 2 CPUs) for the whole module: runs set its nodes up
    one after another."""
    opened = SimulationLink(NODES, EngineConfig(workers=2))
    opened.grid = Recording(opened.grid)
    use_link(opened)
    yield opened
    use_link(None)
    opened.close()


def rows_and_pool(raw, executor: str, rounds: int = 2):
    run = prepared({**raw, "engine": {**raw.get("engine", {}), "executor": executor}})
    try:
        rows = [run_round(run, r) for r in range(1, rounds + 1)]
        return rows, [dict(s) for s in run.server.pool], run
    finally:
        run.close()


CASES = {
    **COMBOS,
    "ifca-pool-on-demand": tiny_recipe(
        plugins=[{"ifca": {"num_clusters": 3, "random_rounds": 1, "broadcast_pool": False}}],
        data={"num_clients": 4},
    ),
    "fedu-personal-knn": ssl_recipe(
        "fedu", evaluation={"protocol": "knn", "personal": True, "knn_k": 3}
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_flower_simulation_gives_the_same_metrics_as_sequential(link, name, tmp_path):
    raw = with_logdir(CASES[name], tmp_path)
    seq_rows, seq_pool, _ = rows_and_pool(raw, "sequential")
    link.grid.replies.clear()
    fl_rows, fl_pool, run = rows_and_pool(raw, "flower")
    assert fl_rows == seq_rows
    assert same_pools(fl_pool, seq_pool)
    private = run.server.private
    for reply in link.grid.replies:
        if reply.has_error():
            continue
        content = reply.content
        assert not state_keys(content) & private, name  # no private key leaves a client
        assert "fedkit.memory" not in content and "fedkit.staged" not in content


def test_on_demand_offers_book_what_is_sent(link):
    """With three clusters and random choices, a client is sent only what it fetched:
    a request for a missing state runs the job again with it."""
    raw = CASES["ifca-pool-on-demand"]
    link.grid.replies.clear()
    rows, _, run = rows_and_pool(raw, "flower", rounds=1)
    needs = [get_meta(r.content).get("need") for r in link.grid.replies if not r.has_error()]
    assert any(n is not None for n in needs)  # some state was asked for
    ledger = [r for r in run.server.ledger.to_rows() if r["client"] in rows[0]["clients"]]
    one_cluster = sum(v.nbytes for v in run.server.pool[0].values())
    assert all(row["down_model"] == one_cluster for row in ledger)
    assert rows[0]["bytes"]["down_model"] == one_cluster * len(rows[0]["clients"])


def test_a_flower_run_resumes_from_the_nodes_files(link, tmp_path):
    """Three rounds straight, against one round, a stop, and two more from the
    checkpoint (the nodes forget what they kept, then adopt the checkpoint's files)."""
    raw = tiny_recipe(
        plugins=["fedavg", "fedbn"],
        federation={"rounds": 3, "clients_per_round": 3},
        engine={"executor": "flower"},
    )
    full = tmp_path / "full"
    runs.execute(runs.start(validate(raw), full), full)
    part = tmp_path / "part"
    one = validate({**raw, "federation": {**raw["federation"], "rounds": 1}})
    runs.execute(runs.start(one, part), part)
    run, done = runs.resume(part, ["federation.rounds=3"])
    runs.execute(run, part, done)
    for read in (logs.read_metrics, logs.read_ledger):
        assert read(part) == read(full)
    a, b = (checkpoint.read(out).pool for out in (full, part))
    assert a.keys() == b.keys() and all(same_pools([a[k]], [b[k]]) for k in a)


def test_the_supernode_sleeps_short_after_work_and_longer_while_idle(monkeypatch):
    """Flower's SuperNode loop sleeps 3 s when idle; fedkit's starts at 20 ms after any
    work, doubles while idle, and never exceeds its limit nor what Flower asked."""
    clock, slept = [100.0], []

    class Clock:
        @staticmethod
        def monotonic() -> float:
            return clock[0]

        @staticmethod
        def sleep(seconds: float) -> None:
            slept.append(round(seconds, 3))
            clock[0] += seconds + 0.001  # an idle poll takes a millisecond

    monkeypatch.setattr(supernode, "time", Clock)
    sleeps = supernode.ShortSleeps(0.2)
    for _ in range(6):
        sleeps.sleep(3)
    clock[0] += 1.0  # a message was handled
    sleeps.sleep(3)
    sleeps.sleep(0.01)
    assert slept == [0.02, 0.04, 0.08, 0.16, 0.2, 0.2, 0.02, 0.01]


def test_a_checkpoint_sends_no_message_and_names_the_files_the_nodes_wrote(link, tmp_path):
    """Each node writes its client's new memory as it trains and names the file in its
    reply: the checkpoint's manifest is those names and hashes, and saving it sends
    nothing to the nodes."""
    raw = tiny_recipe(
        plugins=["fedavg", "fedbn"],
        federation={"rounds": 1, "clients_per_round": 3},
        engine={"executor": "flower"},
    )
    out = tmp_path / "run"
    run = runs.start(validate(raw), out)
    try:
        row = run_round(run, 1)
        sent = run.executor.messages
        files = run.executor.persist(out / MEMORIES)
        assert run.executor.messages == sent
        assert sorted(files) == sorted(int(c) for c in row["clients"])
        for entry in files.values():
            assert sha256_bytes((out / MEMORIES / entry["file"]).read_bytes()) == entry["sha256"]
    finally:
        run.close()
