"""A real Flower deployment on 127.0.0.1, as docs/deploy.md runs one: a SuperLink, three
``fedkit deploy node`` sites and ``fedkit deploy run``, every process started and ended
by the test. The run gives the metrics, ledger and pool of the sequential executor; no
message the server receives carries a private key or a client's memory; what clients
keep is on their nodes, not in the run directory; a second run on the same nodes keeps its
files apart and survives a node killed mid-run (a failed client, recorded; the restarted
node takes back what its client kept and trains again); running the first again with more
rounds resumes from the checkpoint and the nodes' own files, to the sequential numbers;
the SuperLink admits only the nodes whose keys were registered (TLS and node
authentication, as docs/deploy.md sets them up); and a run under SecAgg+ survives a node
killed mid-protocol, after it shared its keys (issue 51)."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from conftest import (
    certificates,
    free_port,
    group_members,
    start_process,
    stop_processes,
    tiny_recipe,
    write_images,
)

from fedkit.config.schema import validate
from fedkit.core import runs
from fedkit.rundir import checkpoint, logs

pytestmark = pytest.mark.slow  # a real Flower deployment: a SuperLink and nodes as processes

pytest.importorskip(
    "flwr", reason="the flower extra is not installed (pip install 'fedkit-fl[flower]')"
)

from fedkit.flower.node_keys import make_key_pair  # noqa: E402

BIN = Path(sys.executable).parent
DROPPED = "dropped out of secure aggregation after sharing its keys"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


READS = """
import os
import sys

_root, _log = os.environ.get("FEDKIT_TEST_READ_ROOT"), os.environ.get("FEDKIT_TEST_READS")


def _record(event, args):
    if event == "open" and _root and _log and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        if path.startswith(_root) and ("/images/" in path or "/site/" in path):
            with open(_log, "a") as handle:
                handle.write(path + "\\n")


sys.addaudithook(_record)
"""
"""A node process's ``sitecustomize``: every data file it opens, one line each."""

DIES = """
import os
import time

import fedkit.cli.app
import fedkit.flower.node
import fedkit.flower.runner
import fedkit.flower.secagg
import fedkit.plugin.entrypoints

for _plugin in fedkit.plugin.entrypoints.discover().values():
    _plugin.load()


def _die(msg, context):
    os._exit(9)


fedkit.flower.secagg.held_vector = _die
_gate = os.environ["FEDKIT_TEST_GATE"]
open(_gate + ".ready", "w").close()
while not os.path.exists(_gate):
    time.sleep(0.02)
"""
"""A node process's ``sitecustomize``: it imports what a node needs, says so
(``$FEDKIT_TEST_GATE.ready``) and waits for ``$FEDKIT_TEST_GATE`` before it goes on to
connect (a node started again then joins within a second, however loaded the machine
is); it dies (exit 9, at once) the first time SecAgg+ asks it for its masked vector,
after it shared its keys."""


def reads(tmp_path: Path, node: int) -> set[str]:
    """The data files node ``node`` opened (under images/ or site/), relative to tmp_path."""
    log = tmp_path / f"reads{node}.txt"
    lines = log.read_text().splitlines() if log.exists() else []
    return {str(Path(line).relative_to(tmp_path)) for line in lines}


@pytest.fixture
def federation(tmp_path):
    """A SuperLink that admits only registered nodes (TLS and node authentication), three
    nodes holding partitions, a fourth holding a site's own images and a fifth whose key
    was never registered (and a registered spare key, for a node started again); afterwards
    every one of their processes has ended."""
    port = free_port()
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr"), "FLWR_TELEMETRY_ENABLED": "0"}
    env["FEDKIT_FLOWER_AUDIT"] = str(tmp_path / "audit.jsonl")
    env["FEDKIT_SERVER_ROOT"] = str(tmp_path / "server")  # where the ServerApp writes runs
    (tmp_path / "server").mkdir()
    env["OMP_NUM_THREADS"] = "1"
    env["FEDKIT_REPORT"] = "1"  # the ServerApp writes report.html (conftest turns it off)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # the SuperLink starts Flower commands
    tls = certificates(tmp_path / "tls")
    superlink = [
        str(BIN / "flower-superlink"), "--ssl-ca-certfile", str(tls["ca"]),
        "--ssl-certfile", str(tls["cert"]), "--ssl-keyfile", str(tls["key"]),
        "--isolation", "subprocess", "--disable-runtime-dependency-installation",
        "--host", "127.0.0.1", "--port", str(port), "--enable-supernode-auth",
    ]  # fmt: skip
    procs = [start_process(superlink, tmp_path / "superlink.log", env)]
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "the SuperLink did not start"
            time.sleep(0.2)
    site = tmp_path / "site"
    write_images(site / "train", {"3": 6, "7": 4})
    write_images(site / "test", {"3": 2, "7": 2}, seed=1)
    keys = {k: tmp_path / "keys" / f"node{k}.key" for k in range(6)}  # the sixth: a spare
    keys[0].parent.mkdir()
    public = [make_key_pair(keys[k]) for k in range(6)]
    admit = [
        str(BIN / "fedkit"), "deploy", "register", *map(str, public[:4]), str(public[5]),
        "--superlink", f"127.0.0.1:{port}", "--root-certificates", str(tls["ca"]),
    ]  # fmt: skip
    done = subprocess.run(admit, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count("registered successfully") == 5
    images = tmp_path / "images"  # the federation's data set, each node reading its part
    write_images(images / "train", {"3": 50, "7": 40, "9": 30})
    write_images(images / "test", {"3": 12, "7": 12, "9": 12}, seed=2)
    audit = tmp_path / "audit-hook"
    audit.mkdir()
    (audit / "sitecustomize.py").write_text(READS)
    dies = tmp_path / "dies-hook"
    dies.mkdir()
    (dies / "sitecustomize.py").write_text(DIES)
    for k in range(5):  # the fourth is a real site with its own images (--data)
        reads = {"FEDKIT_TEST_READS": str(tmp_path / f"reads{k}.txt")}
        node_env = {
            **env,
            "PYTHONPATH": str(audit),
            "FEDKIT_TEST_READ_ROOT": str(tmp_path),
            **reads,
        }
        node = [
            str(BIN / "fedkit"), "deploy", "node", "--superlink", f"127.0.0.1:{port}",
            "--partition", str(k % 4), "--dir", str(tmp_path / f"node{k}"),
            "--root-certificates", str(tls["ca"]), "--auth-key", str(keys[k]),
            *(["--reconnect", "5"] if k == 4 else []),  # the unregistered key: stop soon
            *(["--data", str(site)] if k == 3 else []),
        ]  # fmt: skip
        procs.append(start_process(node, tmp_path / f"node{k}.log", node_env))

    def spare(k: int) -> Callable[[], subprocess.Popen]:
        """Start node ``k``'s replacement on its folder with the spare key (the SuperLink
        holds a killed node's key online for a minute: two missed heartbeats), waiting
        at its gate with its imports done; the function returned kills node ``k`` (-9)
        and opens the gate ``after`` seconds later: after the server sent the round under
        way to the dead node (it does so within milliseconds of writing the previous
        round's row) and long before that round's client_timeout ends, so the new node
        joins for the next round, however loaded the machine is. The new process dies
        when SecAgg+ first asks it for its masked vector (``DIES``)."""
        gate = tmp_path / f"gate{k}"
        node = [
            str(BIN / "fedkit"), "deploy", "node", "--superlink", f"127.0.0.1:{port}",
            "--partition", str(k), "--dir", str(tmp_path / f"node{k}"),
            "--root-certificates", str(tls["ca"]), "--auth-key", str(keys[5]),
        ]  # fmt: skip
        restarted = {**env, "PYTHONPATH": str(dies), "FEDKIT_TEST_GATE": str(gate)}
        procs.append(start_process(node, tmp_path / f"node{k}-restarted.log", restarted))
        waiting, deadline = procs[-1], time.monotonic() + 120
        while not Path(f"{gate}.ready").exists():
            assert waiting.poll() is None and time.monotonic() < deadline, "no spare node"
            time.sleep(0.05)

        def kill_and_restart(after: float) -> subprocess.Popen:
            os.killpg(procs[1 + k].pid, signal.SIGKILL)
            procs[1 + k].wait()
            time.sleep(after)
            gate.touch()
            return waiting

        return kill_and_restart

    try:
        yield port, env, procs[-1], spare  # the fifth node's key was not registered
    finally:
        # the nodes first, so none is left asking a SuperLink that is gone
        stop_processes(procs[1:])
        stop_processes(procs[:1])
        time.sleep(0.5)
        left = [pid for proc in procs for pid in group_members(proc.pid)]
        assert left == [], f"processes left behind: {left}"


def test_a_deployment_gives_the_sequential_numbers_and_keeps_memories_on_nodes(
    federation, tmp_path
):
    port, env, intruder, spare = federation
    raw = tiny_recipe(
        federation={"rounds": 2, "clients_per_round": 3},
        plugins=["fedavg", "fedbn"],
        data={"dataset": "imagefolder", "root": str(tmp_path / "images")},
    )
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "server" / "deployed"  # the run directory, under FEDKIT_SERVER_ROOT
    command = [
        str(BIN / "fedkit"), "deploy", "run", str(path), "--superlink", f"127.0.0.1:{port}",
        "--out", "deployed", "--root-certificates", str(tmp_path / "tls" / "ca.crt"),
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "round   1/2" in done.stdout and "round   2/2" in done.stdout  # progress, streamed
    assert (out / "report.html").is_file()
    seq = tmp_path / "sequential"
    run = runs.start(validate(raw), seq)
    private = run.server.private

    # each node opened its own client's images and nothing else of the data set
    opened = {k: reads(tmp_path, k) for k in range(5)}
    trained = {k: {p for p in opened[k] if p.startswith("images/train/")} for k in range(3)}
    for k in range(3):
        client = run.data.client(k)
        train = {p for p in opened[k] if p.startswith("images/train/")}
        test = {p for p in opened[k] if p.startswith("images/test/")}
        assert opened[k] == train | test, k
        assert (len(train), len(test)) == (len(client.train), len(client.test)), k
        assert all(not trained[k] & trained[j] for j in range(3) if j != k)  # (tests may share)
    assert opened[3] == set() and opened[4] == set()  # the site and the refused node
    runs.execute(run, seq)
    assert logs.read_metrics(out) == logs.read_metrics(seq)
    assert logs.read_ledger(out) == logs.read_ledger(seq)
    a, b = (checkpoint.read(o).pool for o in (seq, out))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k][t], b[k][t]) for k in a for t in a[k])
    sidecar = json.loads((checkpoint.folders(out)[0] / "state.json").read_text())
    assert sorted(sidecar["clients"]) == ["0", "1", "2"]
    assert all(entry["on_node"] for entry in sidecar["clients"].values())
    assert not list((out / "clients").glob("*.safetensors"))
    for k in range(3):  # in the run series' own folder, named after the run directory
        assert list((tmp_path / f"node{k}" / "memories").glob(f"deployed-*/{k}.r*.safetensors"))
    audit = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert {line["kind"] for line in audit} == {"train", "evaluate"}  # checkpoints ask nothing
    sent = {k for line in audit for k in line["keys"]}
    assert private and sent and not sent & private  # FedBN's normalisation layers stay home
    assert all("fedkit.memory" not in line["records"] for line in audit)

    # a second run, with another seed, on the same nodes; one node is killed (-9) mid-run:
    # the run goes on without it (a failed client, recorded), and the node started again
    # (a new node id) takes back what its client kept and trains in the next round. Every
    # client sleeps 1.5 s before training (a straggler fault): the node dies before its
    # round-2 answer. The run's files are its own: they used to overwrite the first run's,
    # whose resume below then failed every hash check.
    lossy = {
        **raw,
        "seed": 1,
        "federation": {**raw["federation"], "rounds": 3, "min_clients": 2, "client_timeout": 8},
        "evaluation": {**raw.get("evaluation", {}), "every": 0},  # the last round only
        "faults": {"straggler": 1.0, "delay": 1.5},
    }
    (tmp_path / "lossy.yaml").write_text(yaml.safe_dump(lossy))
    killed = tmp_path / "server" / "killed"
    second = [command[0], *command[1:3], str(tmp_path / "lossy.yaml"), *command[4:6]]
    kill_and_restart = spare(1)
    running = subprocess.Popen(
        [*second, "--out", "killed", *command[-2:]], env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (killed / "metrics.jsonl").exists() or not logs.read_metrics(killed):
            assert running.poll() is None and time.monotonic() < deadline, "no round 1"
            time.sleep(0.1)
        restarted = kill_and_restart(after=3.0)  # of client_timeout 8 s
        output, _ = running.communicate(timeout=300)
    finally:
        stop_processes([running])
    assert running.returncode == 0, output[-3000:]
    rows = logs.read_metrics(killed)
    assert [row["clients"] for row in rows] == [[0, 1, 2]] * 3
    failed = [json.loads(line) for line in (killed / "failures.jsonl").read_text().splitlines()]
    assert [(f["round"], f["client"]) for f in failed] == [(2, 1)], failed
    assert failed[0]["error"].startswith("timeout"), failed
    assert "failures" not in rows[2] and "eval_failures" not in rows[2]  # client 1 is back
    for k in range(3):
        series = sorted(p.name for p in (tmp_path / f"node{k}" / "memories").iterdir())
        assert [name.rsplit("-", 1)[0] for name in series] == ["deployed", "killed"], series
    assert (
        next((tmp_path / "node1" / "memories").glob("killed-*")) / "1.r000003.safetensors"
    ).exists()

    # the same command with more rounds resumes: a new ServerApp, the nodes adopt their files
    more = subprocess.run(
        [*command, "--set", "federation.rounds=3"], env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    three = {**raw, "federation": {**raw["federation"], "rounds": 3}}
    seq3 = tmp_path / "sequential3"
    runs.execute(runs.start(validate(three), seq3), seq3)
    assert logs.read_metrics(out) == logs.read_metrics(seq3)
    assert logs.read_ledger(out) == logs.read_ledger(seq3)
    for k in range(3):  # its series' folder, on node 1's restarted process too
        assert len(list((tmp_path / f"node{k}" / "memories").glob("deployed-*"))) == 1

    # a fourth client, on the site's own ten train and four test images
    site_out = tmp_path / "server" / "site-run"
    four = [
        str(BIN / "fedkit"), "deploy", "run", str(path), "--superlink", f"127.0.0.1:{port}",
        "--out", "site-run", "--root-certificates", str(tmp_path / "tls" / "ca.crt"),
        "--set", "federation.rounds=1",
        "--set", "data.num_clients=4", "--set", "federation.clients_per_round=4",
    ]  # fmt: skip
    done = subprocess.run(four, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = logs.read_metrics(site_out)
    assert 3 in row["clients"]
    (clients,) = map(json.loads, (site_out / "clients.jsonl").read_text().splitlines())
    assert math.isfinite(clients["per_client"]["3"]["loss"])
    log = (tmp_path / "node3.log").read_text()
    assert "client 3 trains on 10 images and is tested on 4" in log
    assert "https://127.0.0.1" in (tmp_path / "superlink.log").read_text()  # TLS throughout

    # node authentication: the node whose key was not registered was refused, and said so
    assert intruder.wait(timeout=60) != 0
    refused = (tmp_path / "node4.log").read_text()
    assert "Failed to activate SuperNode" in refused
    assert "not admitted: is this key registered (fedkit deploy register)?" in refused
    assert not list((tmp_path / "node4" / "memories").glob("*"))

    # SecAgg+ with a node killed mid-protocol: node 1's restarted process dies when the
    # protocol asks for its masked vector in round 1, after it shared its keys. The round
    # sums clients 0 and 2 (their shares rebuild node 1's masks) and fails client 1, the
    # next goes on without it, and the run ends as usual, its report written.
    secure = {
        **raw,
        "seed": 2,
        "plugins": ["fedavg"],
        "federation": {**raw["federation"], "min_clients": 2, "client_timeout": 5},
        "engine": {"executor": "flower", "secure_aggregation": True},
        "evaluation": {"protocol": "none"},  # a dead node's evaluation waits the timeout too
    }
    (tmp_path / "secure.yaml").write_text(yaml.safe_dump(secure))
    summed = tmp_path / "server" / "secure"
    done = subprocess.run(
        [*command[:3], str(tmp_path / "secure.yaml"), *command[4:6], "--out", "secure",
         *command[-2:]], env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert restarted.wait(timeout=10) == 9  # it died where DIES kills it
    rows = logs.read_metrics(summed)
    assert [row["server_saw"] for row in rows] == ["sum", "sum"]
    assert [(r["secagg"]["clients"], r["secagg"]["dropped"]) for r in rows] == [(2, [1]), (2, [])]
    failed = [json.loads(line) for line in (summed / "failures.jsonl").read_text().splitlines()]
    assert [(f["round"], f["client"]) for f in failed] == [(1, 1), (2, 1)], failed
    assert failed[0]["error"] == "unavailable: " + DROPPED, failed
    assert "only the sum" in (summed / "report.html").read_text()
