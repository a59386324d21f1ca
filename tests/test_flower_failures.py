"""Failures as data on Flower nodes, without processes: a grid whose nodes are real
``NodeHost``s answering in this process (as ``fedkit deploy node`` answers; conftest's
``NodeGrid``), which can kill a node (the SuperLink then answers for it, from node id
1), restart one with a new node id or the same one, or have one raise. A dead node is
its client's failure of the round, never the run's end; a node that comes back takes
back what its client kept and trains as if the client had only failed that round;
queries name the dead node; and two runs on the same nodes keep their files apart, so
the first resumes after the second."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import NodeGrid, on_grid, prepared, server_identity, tiny_recipe

from fedkit.config.schema import validate
from fedkit.core import runs
from fedkit.core.engine import SilentReporter
from fedkit.errors import FedkitError
from fedkit.rundir import checkpoint, logs

pytest.importorskip(
    "flwr", reason="the flower extra is not installed (pip install 'fedkit-fl[flower]')"
)

from flwr.app import RecordDict  # noqa: E402
from flwr.common.constant import ErrorCode  # noqa: E402

from fedkit.flower import internals  # noqa: E402
from fedkit.flower.flower_executor import series_of  # noqa: E402
from fedkit.flower.node import Node, checked_series  # noqa: E402


class Before:
    """A reporter that calls ``act[round]()`` as that round starts (after sampling,
    before any message is sent)."""

    def __init__(self, act: dict) -> None:
        self.act = act

    def round_started(self, round: int, clients: list[int]) -> None:
        if round in self.act:
            self.act[round]()

    client_done = round_done = SilentReporter.client_done


RECIPE = tiny_recipe(
    plugins=["fedavg", "fedbn"],
    federation={"rounds": 3, "clients_per_round": 3, "min_clients": 2},
    engine={"executor": "flower"},
)


@pytest.fixture
def grid(tmp_path, monkeypatch):
    """Three nodes, each with its own memory folder; messages made here are the
    ServerApp's (Flower's task identity)."""
    server_identity(monkeypatch)
    return NodeGrid(3, tmp_path / "nodes")


def execute(grid: NodeGrid, raw, out: Path, act: dict | None = None, overrides=None):
    if out.exists():
        run, done = runs.resume(out, overrides, on_grid(grid))
    else:
        run, done = runs.start(validate(raw), out, executor=on_grid(grid)), 0
    return runs.execute(run, out, done, Before(act or {}))


def failures(out: Path) -> list[dict]:
    path = out / "failures.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def without_failures(rows: list[dict]) -> list[dict]:
    """The rows without the failures' texts (which clients failed is kept)."""
    texts = ("failures", "eval_failures")
    return [{k: sorted(v) if k in texts else v for k, v in row.items()} for row in rows]


def kill_and_restart(grid: NodeGrid, same_id: bool) -> dict:
    """Round 2: client 1's node is dead (the SuperLink answers for it) or, keeping its
    node id, a new process that holds no setup; round 3: it is back."""
    node = grid.node_of(1)
    if same_id:
        return {2: lambda: grid.start(1, node)}
    return {2: lambda: grid.dead.add(node), 3: lambda: (grid.hosts.pop(node), grid.start(1))}


@pytest.mark.slow
@pytest.mark.parametrize("same_id", [False, True], ids=["new-node-id", "same-node-id"])
def test_a_node_that_dies_fails_its_round_and_rejoins_where_its_client_was(grid, tmp_path, same_id):
    """A dead node is its client's failure (recorded, with the reason), the round goes
    on, and the restarted node is set up, takes back the memory its client kept (FedBN's
    private layers) and trains: the run equals one where that client only raised in
    round 2."""
    out = tmp_path / "killed"
    execute(grid, RECIPE, out, kill_and_restart(grid, same_id))
    rows = logs.read_metrics(out)
    assert [row["clients"] for row in rows] == [[0, 1, 2]] * 3
    (failed,) = [f for f in failures(out) if f["client"] == 1]
    assert failed["round"] == 2
    expected = "its node restarted and lost the run's setup" if same_id else "node unavailable"
    assert failed["error"].startswith(f"unavailable: {expected}"), failed
    assert "failures" not in rows[2]  # back in round 3

    other = NodeGrid(3, tmp_path / "other-nodes")  # the same client raising in round 2 instead
    other.raising.add((other.node_of(1), 2))
    reference = tmp_path / "raised"
    execute(other, RECIPE, reference)
    assert [f["client"] for f in failures(reference)] == [1]
    assert without_failures(rows) == without_failures(logs.read_metrics(reference))
    a, b = (checkpoint.read(o).pool for o in (out, reference))
    assert all((a[k][t] == b[k][t]).all() for k in a for t in a[k])


@pytest.mark.slow
def test_a_second_node_that_cannot_take_the_memory_back_leaves_the_client_where_it_was(
    grid, tmp_path, capsys
):
    """A newcomer for a client whose node still answers takes the client over only when
    it can take back the client's memory: one started on another folder is left idle,
    and the client trains on its first node without a failure."""
    first = grid.node_of(0)
    out = tmp_path / "run"
    execute(grid, RECIPE, out, {2: lambda: grid.start(0, folder="elsewhere")})  # a twin of node 0
    assert failures(out) == []
    assert "a node joined for client 0 but" in capsys.readouterr().out
    assert {node for node, client in grid.trained if client == 0} == {first}


def test_a_queried_node_that_is_gone_is_named_not_a_key_error(grid, tmp_path):
    """``adopt`` (a resume's query) with one node dead stops with the client and the
    SuperLink's reason, as a FedkitError."""
    out = tmp_path / "run"
    raw = {**RECIPE, "federation": {**RECIPE["federation"], "rounds": 1}}
    run = runs.start(validate(raw), out, executor=on_grid(grid))
    try:
        grid.dead.add(grid.node_of(2))
        with pytest.raises(FedkitError, match="client 2: unavailable: node unavailable"):
            run.executor.adopt(out / "clients", {})
    finally:
        run.close()


@pytest.mark.slow
def test_two_runs_on_the_same_nodes_keep_their_files_apart_and_the_first_resumes(grid, tmp_path):
    """Two runs with different seeds on the same nodes, then the first extended by a
    round: it resumes from its own files and equals three rounds straight. Each run
    series has its own folder on every node, named after the run directory."""
    two = {**RECIPE, "federation": {**RECIPE["federation"], "rounds": 2}}
    execute(grid, two, tmp_path / "first")
    execute(grid, {**two, "seed": 1}, tmp_path / "second")
    execute(grid, two, tmp_path / "first", overrides=["federation.rounds=3"])
    execute(grid, RECIPE, tmp_path / "straight")
    for read in (logs.read_metrics, logs.read_ledger):
        assert read(tmp_path / "first") == read(tmp_path / "straight")
    for k in range(3):
        series = sorted(p.name for p in (tmp_path / "nodes" / f"node{k}" / "memories").iterdir())
        assert [name.rsplit("-", 1)[0] for name in series] == ["first", "second", "straight"]
    sidecar = json.loads((checkpoint.folders(tmp_path / "first")[0] / "state.json").read_text())
    assert series_of(sidecar["clients"].values()).startswith("first-")


def test_every_flower_error_code_is_a_failure_kind():
    """Each of Flower's error codes reads as a fedkit failure kind of its own (a code a
    new Flower adds falls back to ``exception`` and fails here)."""
    codes = {v for k, v in vars(ErrorCode).items() if k.isupper() and isinstance(v, int)}
    kinds = {code: internals.error_kind(code) for code in codes}
    assert not [c for c, (_, words) in kinds.items() if words.startswith("Flower error")]
    assert kinds[ErrorCode.NODE_UNAVAILABLE][0] == "unavailable"
    assert kinds[ErrorCode.REPLY_MESSAGE_UNAVAILABLE][0] == "timeout"


def test_a_node_takes_back_only_its_own_clients_files(tmp_path):
    """A node reads back only a file of its own client in its memory folder (a series
    subfolder at most), and keeps only a series name that is a plain folder name."""
    from fedkit.core.worker import Worker

    run = prepared(tiny_recipe(plugins=["fedavg"]))
    try:
        node = Node(Worker(run.executor.setup), run.executor.clients[0], tmp_path)
        for name in ("1.r000001.safetensors", "../x/0.r000001.safetensors", "a/b/0.r1.safetensors"):
            error = node.adopt(RecordDict(), {"file": name, "sha256": "0" * 64})
            assert error is not None and "not a memory file of client 0" in error, name
        missing = node.adopt(RecordDict(), {"file": "s-1/0.r000001.safetensors", "sha256": "0"})
        assert "s-1/0.r000001.safetensors" in missing and "No such file" in missing
        with pytest.raises(FedkitError, match="memory series '../up'"):
            checked_series("../up")
    finally:
        run.close()
