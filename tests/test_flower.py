"""The ``flower`` executor: every built-in plugin, in every combination the contract tests
use, gives the same metrics and pool under Flower's simulation runtime as under the
sequential executor; nothing a client keeps privately reaches the server; cluster states
travel on demand and the ledger books what is sent; a run resumes from a checkpoint
whose client files the nodes wrote."""

from __future__ import annotations

from functools import partial

import pytest
from conftest import (
    COMBOS,
    Fleet,
    activate,
    incoming,
    prepared,
    same_pools,
    setup_message,
    ssl_recipe,
    tiny_recipe,
    with_logdir,
)

from fedkit.config.schema import EngineConfig, validate
from fedkit.core import runs
from fedkit.core.engine import prepare, run_round
from fedkit.rundir import checkpoint, logs
from fedkit.rundir.integrity import sha256_bytes
from fedkit.rundir.store import MEMORIES

pytest.importorskip(
    "flwr", reason="the flower extra is not installed (pip install 'fedkit-fl[flower]')"
)

from fedkit.flower.flower_executor import FlowerExecutor  # noqa: E402
from fedkit.flower.records import get_meta, state_keys  # noqa: E402
from fedkit.flower.simulation import SimulationLink  # noqa: E402

NODES = 6


class Recording:
    """The grid as the server uses it, keeping every reply it receives."""

    def __init__(self, grid):
        self.grid, self.replies, self.pushed = grid, [], []

    def __getattr__(self, name):
        return getattr(self.grid, name)

    def push_messages(self, messages):
        self.pushed.extend(messages)
        return self.grid.push_messages(messages)

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
    yield opened
    opened.close()


def on(link) -> partial:
    """The ``flower`` executor on the module's simulation, which it leaves open."""
    return partial(FlowerExecutor, link=link)


def rows_and_pool(raw, executor, rounds: int = 2):
    """Rounds of ``raw`` under ``executor`` (a name, or ``on(link)``), as ``prepare`` takes it."""
    run = prepare(*activate(raw), executor=executor)
    try:
        rows = [run_round(run, r) for r in range(1, rounds + 1)]
        return rows, [dict(s) for s in run.server.pool], run
    finally:
        run.close()


CASES = {  # an attack's client hooks run in the same worker (backdoor passed here once: 20 s)
    **{name: raw for name, raw in COMBOS.items() if name != "backdoor"},
    "ifca-pool-on-demand": tiny_recipe(
        plugins=[{"ifca": {"num_clusters": 3, "random_rounds": 1, "broadcast_pool": False}}],
        data={"num_clients": 4},
    ),
    "fedu-personal-knn": ssl_recipe(
        "fedu", evaluation={"protocol": "knn", "personal": True, "knn_k": 3}
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_flower_simulation_gives_the_same_metrics_as_sequential(link, name, tmp_path):
    raw = with_logdir(CASES[name], tmp_path)
    seq_rows, seq_pool, _ = rows_and_pool(raw, "sequential")
    link.grid.replies.clear()
    fl_rows, fl_pool, run = rows_and_pool(raw, on(link))
    assert fl_rows == seq_rows
    assert same_pools(fl_pool, seq_pool)
    private = run.server.private
    for reply in link.grid.replies:
        if reply.has_error():
            continue
        content = reply.content
        assert not state_keys(content) & private, name  # no private key leaves a client
        assert "fedkit.memory" not in content and "fedkit.staged" not in content


@pytest.mark.slow
def test_on_demand_offers_book_what_is_sent(link):
    """With three clusters and random choices, a client is sent only what it fetched:
    a request for a missing state runs the job again with it."""
    raw = CASES["ifca-pool-on-demand"]
    link.grid.replies.clear()
    rows, _, run = rows_and_pool(raw, on(link), rounds=1)
    needs = [get_meta(r.content).get("need") for r in link.grid.replies if not r.has_error()]
    assert any(n is not None for n in needs)  # some state was asked for
    ledger = [r for r in run.server.ledger.to_rows() if r["client"] in rows[0]["clients"]]
    one_cluster = sum(v.nbytes for v in run.server.pool[0].values())
    assert all(row["down_model"] == one_cluster for row in ledger)
    assert rows[0]["bytes"]["down_model"] == one_cluster * len(rows[0]["clients"])


@pytest.mark.slow
def test_a_flower_run_resumes_from_the_nodes_files(link, tmp_path):
    """Three rounds straight, against one round, a stop, and two more from the
    checkpoint (the nodes forget what they kept, then adopt the checkpoint's files)."""
    raw = tiny_recipe(
        plugins=["fedavg", "fedbn"],
        federation={"rounds": 3, "clients_per_round": 3},
        engine={"executor": "flower"},
    )
    full = tmp_path / "full"
    runs.execute(runs.start(validate(raw), full, executor=on(link)), full)
    part = tmp_path / "part"
    one = validate({**raw, "federation": {**raw["federation"], "rounds": 1}})
    runs.execute(runs.start(one, part, executor=on(link)), part)
    run, done = runs.resume(part, ["federation.rounds=3"], on(link))
    runs.execute(run, part, done)
    for read in (logs.read_metrics, logs.read_ledger):
        assert read(part) == read(full)
    a, b = (checkpoint.read(out).pool for out in (full, part))
    assert a.keys() == b.keys() and all(same_pools([a[k]], [b[k]]) for k in a)


def test_a_deployed_node_answers_in_its_own_process_and_keeps_one_state_per_run(
    monkeypatch, tmp_path
):
    """``fedkit deploy node`` is one process: it pulls each message over Flower's Fleet
    API, answers it with its host, keeps the node's state per run series across messages,
    sends a raised error as the client's failure, skips a run that stopped, and while idle
    asks less and less often, up to its ``poll``."""
    from fedkit.flower import runner

    calls, slept = [], []

    class Host:
        def __init__(self, *args, **kwargs):
            pass

        def handle(self, kind, content, state, partition):
            from flwr.app import ConfigRecord, RecordDict

            value = int(content["in"]["value"])
            if value < 0:
                raise ValueError("a negative value")
            count = int(state["seen"]["count"]) + 1 if "seen" in state else 1
            state["seen"] = ConfigRecord({"count": count})
            calls.append((kind, value, partition))
            return RecordDict({"out": ConfigRecord({"value": value * 10, "seen": count})})

    messages = [
        incoming(7, "query", 1), incoming(7, "train", 2), incoming(9, "train", 3),
        incoming(5, "train", 4), incoming(7, "evaluate", -1), incoming(7, "train", 6),
    ]  # fmt: skip
    fleet = Fleet(list(messages), gone=5)
    monkeypatch.setattr(runner.internals, "connect", fleet.connect)
    monkeypatch.setattr(runner, "NodeHost", Host)
    monkeypatch.setattr(runner.time, "sleep", slept.append)
    runner.serve("127.0.0.1:1", 3, tmp_path, poll=0.1, stop=lambda: len(slept) >= 5)

    assert calls == [("query", 1, 3), ("train", 2, 3), ("train", 3, 3), ("train", 6, 3)]
    assert fleet.confirmed == [m.object_id for m in messages if m.metadata.run_id != 5]
    replies = fleet.replies()
    answered = [r for r in replies if r.has_content()]
    assert [(int(r.content["out"]["value"]), int(r.content["out"]["seen"])) for r in answered] == [
        (10, 1), (20, 2), (30, 1), (60, 3),
    ]  # fmt: skip
    (failed,) = [r for r in replies if r.has_error()]
    assert "ValueError: a negative value" in failed.error.reason
    assert all(r.metadata.dst_node_id == 1 for r in replies)
    assert slept == [0.02, 0.04, 0.08, 0.1, 0.1]


@pytest.mark.slow
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
    run = runs.start(validate(raw), out, executor=on(link))
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


@pytest.mark.slow
def test_deployed_nodes_are_told_which_files_no_kept_checkpoint_can_need(
    link, tmp_path, monkeypatch
):
    """With nodes on their own disks, every message names the oldest round any of the
    last ``keep_checkpoints + 1`` checkpoints names a file of, per client (none until that
    many were written); a simulation's messages name none (the server prunes itself)."""
    raw = tiny_recipe(
        plugins=["fedavg", "fedbn"],
        data={"num_clients": 4},
        federation={"rounds": 6, "clients_per_round": 2},
        engine={"executor": "flower"},
    )
    pushed = link.grid.pushed
    pushed.clear()
    monkeypatch.setattr(link, "remote", True)
    out = tmp_path / "run"
    runs.execute(runs.start(validate(raw), out, executor=on(link)), out)
    trained = {row["round"]: {int(c) for c in row["clients"]} for row in logs.read_metrics(out)}

    def last_trained(client: int, round: int) -> int | None:
        return max((r for r in range(1, round + 1) if client in trained[r]), default=None)

    seen = [(m.metadata.message_type, get_meta(m.content)) for m in pushed]
    seen = [(kind, meta) for kind, meta in seen if kind in ("train", "evaluate")]
    assert {kind for kind, _ in seen} == {"train", "evaluate"}
    for _, meta in seen:  # round r follows the checkpoints of rounds 0..r-1; 2 are kept
        window = range(meta["round"] - 3, meta["round"])
        named = [r for s in window if s >= 0 and (r := last_trained(meta["client"], s))]
        expected = min(named) if meta["round"] >= 3 and named else None
        assert meta["prune"] == expected, meta
    assert any(meta["prune"] for _, meta in seen)

    monkeypatch.setattr(link, "remote", False)
    pushed.clear()
    simulated = tmp_path / "simulated"
    runs.execute(runs.start(validate(raw), simulated, executor=on(link)), simulated)
    assert all(get_meta(m.content).get("prune") is None for m in pushed)


def test_a_node_removes_files_no_checkpoint_can_name(tmp_path):
    """A node removes its client's files before the round the server names, and the file
    of a result the server did not accept; the file of what the client keeps stays."""
    from flwr.app import RecordDict

    from fedkit.core.engine import jobs
    from fedkit.core.worker import Worker
    from fedkit.flower.node import Node
    from fedkit.flower.records import job_content, result_of

    run = prepared(
        tiny_recipe(plugins=["fedavg", "fedbn"], federation={"rounds": 6, "clients_per_round": 3})
    )
    folder = tmp_path / "memories"
    try:
        node = Node(Worker(run.executor.setup), run.executor.clients[1], folder)
        state = RecordDict()

        def train(round: int, settled, prune=None) -> str:
            run.record.round = round
            (job,) = jobs(run, [1])
            reply = node.handle("train", job_content(job, [0], settled, prune), state)
            result, _ = result_of(reply)
            assert result.failure is None
            return get_meta(reply)["memory"]["file"]

        def files() -> list[str]:
            return sorted(p.name for p in folder.glob("*.safetensors"))

        names = [train(1, None), train(2, [1, 0]), train(3, [2, 0])]
        assert files() == names
        late = train(4, [3, 0])  # its result is not accepted: the next message settles round 3
        train(5, [3, 0], prune=3)
        assert files() == [names[2], "1.r000005.safetensors"] and late not in files()
        train(6, [5, 0], prune=6)  # round 5's memory is kept: its file stays
        assert files() == ["1.r000005.safetensors", "1.r000006.safetensors"]
    finally:
        run.close()


def test_a_node_refuses_to_adopt_a_file_it_cannot_check(tmp_path):
    """Adopting a checkpoint's memory answers an error naming the file when the node has
    no memory folder, and when the file's bytes do not match the checkpoint's hash."""
    from flwr.app import RecordDict

    from fedkit.core.worker import Worker
    from fedkit.flower.node import Node

    run = prepared(tiny_recipe(plugins=["fedavg"]))
    try:
        worker, data = Worker(run.executor.setup), run.executor.clients[0]
        entry = {"file": "0.r000001.safetensors", "sha256": "0" * 64}
        bare = Node(worker, data, None).adopt(RecordDict(), entry)
        assert bare == "the node has no memory folder to take 0.r000001.safetensors back from"
        (tmp_path / entry["file"]).write_bytes(b"not this memory")
        damaged = Node(worker, data, tmp_path).adopt(RecordDict(), entry)
        assert damaged.endswith("0.r000001.safetensors does not match the checkpoint's hash")
    finally:
        run.close()


@pytest.mark.slow
def test_a_deployed_nodes_state_names_its_files_and_trains_as_one_that_holds_bytes(tmp_path):
    """Flower moves a node's whole state with every message: a resident host (a deployed
    node's process) keeps the setup itself and the state names the memory's file, and
    its client trains exactly as one whose state holds the bytes."""
    from flwr.app import RecordDict

    from fedkit.core.engine import jobs
    from fedkit.flower.node import NodeHost
    from fedkit.flower.records import job_content, result_of
    from fedkit.flower.runner import state_bytes

    run = prepared(
        tiny_recipe(plugins=["fedavg", "fedbn"], federation={"rounds": 3, "clients_per_round": 3})
    )
    try:
        hosts = {
            "resident": (NodeHost(tmp_path / "a", resident=True), RecordDict()),
            "bytes": (NodeHost(), RecordDict()),
        }
        uploads = {}
        for name, (host, state) in hosts.items():
            assert get_meta(host.handle("query", setup_message(run, name), state, 1))["client"] == 1
            for round, settled in ((1, None), (2, [1, 0]), (3, [2, 0])):
                run.record.round = round
                (job,) = jobs(run, [1])
                reply = host.handle("train", job_content(job, [0], settled), state, 1)
                result, _ = result_of(reply)
                assert result.failure is None
            uploads[name] = result.upload
        resident_state, bytes_state = hosts["resident"][1], hosts["bytes"][1]
        assert state_bytes(resident_state) == 0  # names and rounds only
        assert state_bytes(bytes_state) > 100_000  # the setup and the memories
        assert {k: v.tolist() for k, v in uploads["resident"].items()} == {
            k: v.tolist() for k, v in uploads["bytes"].items()
        }  # round 3 trained on the memory of round 2, read back from its file
        fresh = NodeHost(tmp_path / "a", resident=True)  # the process was restarted
        (job,) = jobs(run, [1])
        with pytest.raises(RuntimeError, match="no longer holds the run's setup"):
            fresh.handle("train", job_content(job, [0], [3, 0]), resident_state, 1)
    finally:
        run.close()


def test_deploy_keygen_writes_a_key_pair_flower_accepts_and_never_replaces_one(
    tmp_path, monkeypatch
):
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes
    from typer.testing import CliRunner

    from fedkit.cli.app import app

    monkeypatch.chdir(tmp_path)  # short paths: the messages fit on one line
    key = tmp_path / "node.key"
    made = CliRunner().invoke(app, ["deploy", "keygen", "node.key"])
    assert made.exit_code == 0, made.output
    assert key.stat().st_mode & 0o777 == 0o600  # the node's secret: its owner only
    private = load_ssh_private_key(key.read_bytes(), None)  # as the SuperNode reads it
    registered = try_load_public_key(tmp_path / "node.key.pub")  # as `flwr supernode register`
    assert registered == public_key_to_bytes(private.public_key())
    before = key.read_bytes()
    again = CliRunner().invoke(app, ["deploy", "keygen", "node.key"])
    assert again.exit_code == 2 and "node.key exists" in again.output
    assert key.read_bytes() == before and "Traceback" not in again.output
    missing = ["deploy", "register", "other.pub", "--superlink", "127.0.0.1:1"]
    refused = CliRunner().invoke(app, [*missing, "--insecure"])
    assert refused.exit_code == 2 and "other.pub is not a file" in refused.output
