"""A deployment node outlives its SuperLink: it waits out a SuperLink that does not answer,
joins again one that restarted (keeping its runs' states and setup), retries a key the
SuperLink still holds for a killed node, and stops with one line that says what to check
when retrying cannot help (an unregistered key after the time limit, TLS, ``--insecure``
against a TLS SuperLink, a missing key). Flower's connection itself (a fake HTTP client
under it) no longer ends the process: a 401, an unrecognised heartbeat and a refused
activation become exceptions. One real SuperLink restart closes the file."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("flwr", reason="the flower extra is not installed")

from conftest import (  # noqa: E402
    Fleet,
    certificates,
    free_port,
    group_members,
    incoming,
    start_process,
    stop_processes,
)

from fedkit.flower import internals, runner  # noqa: E402

BIN = Path(sys.executable).parent
URL = "https://127.0.0.1:1/v1/fleet/x"


def status_error(status: int, code: int | None = None) -> httpx.HTTPStatusError:
    """An error reply as Flower's SuperLink sends one (its code and public message)."""
    body = {"code": code, "detail": "Failed to activate SuperNode."} if code else {"detail": "no"}
    request = httpx.Request("POST", URL)
    reply = httpx.Response(status, json=body, request=request)
    return httpx.HTTPStatusError(f"HTTP {status}", request=request, response=reply)


def not_connected(cause: Exception) -> internals.NotConnected:
    """What joining raises when it failed with ``cause``."""
    failure = internals.NotConnected(str(cause))
    failure.__cause__ = cause
    return failure


def refused() -> internals.NotConnected:
    """What joining raises when the SuperLink does not activate the node's key."""
    return not_connected(status_error(412, 2004))


class Clock:
    """``time`` for the runner: sleeping moves the clock instead of waiting."""

    def __init__(self):
        self.now, self.slept = 1000.0, []

    def sleep(self, seconds):
        self.slept.append(round(seconds, 3))
        self.now += seconds

    def monotonic(self):
        return self.now

    perf_counter = monotonic

    def time(self):
        return self.now


class Host:
    """A node's client that counts, in the node's state, the messages of each run."""

    built = 0

    def __init__(self, *args, **kwargs):
        Host.built += 1
        self.seen = []

    def handle(self, kind, content, state, partition):
        from flwr.app import ConfigRecord, RecordDict

        count = int(state["seen"]["count"]) + 1 if "seen" in state else 1
        state["seen"] = ConfigRecord({"count": count})
        self.seen.append((int(content["in"]["value"]), count))
        Host.last = self
        return RecordDict({"out": ConfigRecord({"value": count})})


class Restarting:
    """A SuperLink that comes and goes: each ``connect`` takes the next step of ``script``,
    an exception (joining fails with it) or a list of what ``receive`` gives in turn (a
    message, ``None`` for nothing, or an exception it raises). ``send_fails`` lists the
    messages whose reply cannot be sent (the SuperLink vanished mid-push)."""

    def __init__(self, script, send_fails=()):
        self.script, self.fleet, self.send_fails = list(script), Fleet([]), list(send_fails)
        self.joins, self.outcomes, self.node = 0, [], 0

    @property
    def done(self):
        return not self.script and not self.outcomes

    def connect(self, superlink, insecure, certificates, keys):
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        self.joins += 1
        self.node += 1
        self.outcomes = list(step)
        link = self

        @contextlib.contextmanager
        def connection():
            with self.fleet.connect(superlink, insecure, certificates, keys) as conn:
                _, fleet_receive, send, *rest = conn

                def receive():
                    if not link.outcomes:
                        return None
                    got = link.outcomes.pop(0)
                    if isinstance(got, Exception):
                        raise got
                    if got is None:
                        return None
                    link.fleet.inbox.append(got)
                    return fleet_receive()

                def sending(reply, tree, seconds):
                    if link.send_fails and link.send_fails[0] == reply.metadata.reply_to_message_id:
                        link.send_fails.pop(0)
                        raise httpx.ConnectError("[Errno 111] Connection refused")
                    return send(reply, tree, seconds)

                yield (link.node, receive, sending, *rest)

        return connection()


@pytest.fixture
def node(monkeypatch, tmp_path):
    """``serve`` driven over a ``Restarting`` SuperLink, on a clock that does not wait;
    returns what it printed, the nodes it joined as, and the clock."""
    clock = Clock()
    monkeypatch.setattr(runner, "time", clock)
    monkeypatch.setattr(runner, "NodeHost", Host)
    Host.built = 0

    def drive(script, *, keys=("private", "public"), reconnect=300.0, send_fails=(), tls=True):
        link = Restarting(script, send_fails)
        monkeypatch.setattr(runner.internals, "connect", link.connect)
        joined = []
        runner.serve(
            "10.0.0.5:9092", 3, tmp_path, certificates=b"CA" if tls else None,
            keys=keys, reconnect=reconnect, stop=lambda: link.done, connected=joined.append,
        )  # fmt: skip
        return link, joined

    return drive, clock


def test_a_node_joins_a_restarted_superlink_again_and_keeps_its_runs(node, capsys):
    """The SuperLink restarts (the node's next request is refused as unknown), then
    refuses the key twice (it restarted, or still holds the key's node); the node joins
    again once it is admitted, with the same client and the same run state."""
    drive, clock = node
    lost = internals.NodeLost("[code: 0] refused (401)")
    link, joined = drive(
        [[incoming(7, "train", 1), lost], refused(), refused(), [incoming(7, "train", 2)]]
    )
    out = capsys.readouterr().out
    assert joined == [1, 2]
    assert Host.built == 1 and Host.last.seen == [(1, 1), (2, 2)]  # one host, one state
    assert out.count("no longer knows this node") == 1
    assert out.count(
        "does not know this node yet: it restarted, or this key was admitted less than 60 s ago"
    ) == 1  # fmt: skip
    assert "retrying for up to 300 s ([code: 2004] Failed to activate SuperNode.)" in out
    assert clock.slept == [1.0, 2.0]  # rejoining a lost node waits for nothing


def test_a_key_refused_past_the_time_limit_stops_the_node_asking_whether_it_is_registered(
    node, capsys
):
    drive, clock = node
    with pytest.raises(runner.NodeStopped) as stopped:
        drive([refused() for _ in range(50)], reconnect=30)
    assert str(stopped.value).startswith("not admitted: is this key registered (fedkit deploy")
    assert "refused it for 30 s" in str(stopped.value)
    assert clock.slept == [1.0, 2.0, 4.0, 8.0, 10.0, 5.0]  # doubling, at most 10 s, to 30 s
    assert capsys.readouterr().out.count("does not know this node yet") == 1


def test_a_superlink_that_stops_answering_is_waited_for_and_a_lost_reply_is_said(node, capsys):
    """Mid-session the SuperLink does not answer: the node keeps its connection and asks
    again, backing off; a reply it could not send is one line (the server counts the
    client as not answering). Past the time limit the node stops."""
    drive, clock = node
    gone = httpx.ConnectError("[Errno 111] Connection refused")
    first = incoming(7, "train", 1)
    link, joined = drive(
        [[first, gone, gone, gone, incoming(7, "train", 2)]], send_fails=[first.object_id]
    )
    out = capsys.readouterr().out
    assert joined == [1] and Host.last.seen == [(1, 1), (2, 2)]
    assert len(link.fleet.trees) == 1  # the first reply was lost, the second sent
    assert "a message of run 7 got no reply (ConnectError: [Errno 111] Connection refused)" in out
    assert out.count("does not answer (ConnectError") == 1
    assert out.count("answers again") == 1
    assert clock.slept[:4] == [1.0, 2.0, 4.0, 8.0]

    with pytest.raises(runner.NodeStopped, match=r"did not answer for 20 s .*--reconnect"):
        drive([not_connected(gone) for _ in range(50)], reconnect=20)


@pytest.mark.parametrize(
    ("cause", "tls", "words"),
    [
        (httpx.RemoteProtocolError("Server disconnected"), False, "started with --insecure"),
        (httpx.ConnectError("[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"), True,
         "does its certificate name 10.0.0.5, and did the CA in --root-certificates sign it"),
        (status_error(412, 2001), True, "start this node with --auth-key KEY"),
        (status_error(400, 2003), True, "refused this node: [code: 2003]"),
    ],
)  # fmt: skip
def test_what_retrying_cannot_mend_stops_the_node_at_once(node, monkeypatch, cause, tls, words):
    drive, clock = node
    monkeypatch.setattr(runner, "speaks_tls", lambda address: True)
    with pytest.raises(runner.NodeStopped, match=re.escape(words)):
        drive([not_connected(cause)] * 3, tls=tls)
    assert clock.slept == []


def test_speaks_tls_tells_a_tls_server_from_a_plain_one_and_from_none(tmp_path):
    paths = certificates(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(paths["cert"], paths["key"])

    def serve_once(listener, wrap):
        conn, _ = listener.accept()
        with contextlib.suppress(OSError):
            if wrap:
                context.wrap_socket(conn, server_side=True).close()
        conn.close()

    for wrap in (True, False):
        with socket.create_server(("127.0.0.1", 0)) as listener:
            thread = threading.Thread(target=serve_once, args=(listener, wrap))
            thread.start()
            assert runner.speaks_tls(f"127.0.0.1:{listener.getsockname()[1]}") is wrap
            thread.join(timeout=10)
    assert runner.speaks_tls(f"127.0.0.1:{free_port()}") is False


def test_the_node_command_exits_1_with_the_nodes_line(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from fedkit.cli.app import app

    def refuse(*args, **kwargs):
        assert kwargs["reconnect"] == 5
        raise runner.NodeStopped("not admitted: is this key registered (fedkit deploy register)?")

    monkeypatch.setattr(runner, "serve", refuse)
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # the command's SIGTERM handler
    args = ["deploy", "node", "--superlink", "127.0.0.1:1", "--partition", "0", "--insecure"]
    result = CliRunner().invoke(app, [*args, "--dir", str(tmp_path / "n"), "--reconnect", "5"])
    assert result.exit_code == 1
    assert "the node stopped: not admitted: is this key registered" in result.output


# Flower's own connection, over a fake HTTP client


class Client:
    """Flower's Fleet HTTP client as its connection calls it: each method answers from
    ``replies`` (a value, or an exception to raise), else with an empty success."""

    def __init__(self, **replies):
        self.replies, self.calls = replies, []

    def __getattr__(self, name):
        from flwr.proto import fleet_pb2, heartbeat_pb2

        def call(request, **kwargs):
            self.calls.append(name)
            answer = self.replies.get(name)
            if isinstance(answer, list):
                answer = answer.pop(0) if answer else None
            if isinstance(answer, Exception):
                raise answer
            if answer is not None:
                return answer
            if name == "SendNodeHeartbeat":
                return heartbeat_pb2.SendNodeHeartbeatResponse(success=True)
            if name in ("RegisterNode", "ActivateNode"):
                kind = "RegisterNodeFleetResponse" if name == "RegisterNode" else name + "Response"
                return getattr(fleet_pb2, kind)(node_id=7)
            return getattr(fleet_pb2, name + "Response", fleet_pb2.PullMessagesResponse)()

        return call


@pytest.fixture
def flower(monkeypatch):
    """Flower's connection over ``Client``; its modules are restored afterwards, and a
    SIGINT the process sends itself, or a thread that dies, is recorded, not acted on."""
    from flwr.supercore.retry import http_retry
    from flwr.supernode import fleet_http_connection as fleet

    for name in ("flwr_exit", "os", "HeartbeatSender", "make_simple_http_retry_invoker"):
        monkeypatch.setattr(fleet, name, getattr(fleet, name))
    monkeypatch.setattr(http_retry, "os", http_retry.os)
    monkeypatch.setattr(internals, "CALL_PATIENCE", 0.3)
    interrupts, deaths = [], []
    monkeypatch.setattr(threading, "excepthook", deaths.append)
    previous = signal.signal(signal.SIGINT, lambda *args: interrupts.append(args))

    def using(client):
        class Factory:
            @staticmethod
            def from_server_address(*args, **kwargs):
                return contextlib.nullcontext(client)

        monkeypatch.setattr(fleet, "FleetHttpClient", Factory)
        return internals.connect("127.0.0.1:1", True, None, None)

    yield using
    signal.signal(signal.SIGINT, previous)
    assert interrupts == [] and deaths == []


def test_flowers_connection_raises_where_it_would_end_the_process(flower):
    with pytest.raises(internals.NotConnected) as joining:
        with flower(Client(ActivateNode=status_error(412, 2004))):
            pass
    assert internals.diagnose(joining.value) == internals.REFUSED
    assert internals.describe(joining.value) == "[code: 2004] Failed to activate SuperNode."
    with pytest.raises(internals.NotConnected) as joining:
        with flower(Client(RegisterNode=status_error(412, 2001))):
            pass
    assert internals.diagnose(joining.value) == internals.NEEDS_KEY
    ssl_error = httpx.ConnectError("[SSL: WRONG_VERSION_NUMBER] wrong version number")
    with pytest.raises(internals.NotConnected) as joining:
        with flower(Client(ActivateNode=ssl_error)):
            pass
    assert internals.diagnose(joining.value) == internals.TLS


def test_a_401_or_an_unrecognised_heartbeat_loses_the_node_without_a_signal(flower):
    from flwr.proto import heartbeat_pb2

    client = Client(PullMessages=status_error(401))
    with flower(client) as (node_id, receive, *_):
        assert node_id == 7
        with pytest.raises(internals.NodeLost):
            receive()
    assert "DeactivateNode" in client.calls  # left as Flower leaves

    unknown = heartbeat_pb2.SendNodeHeartbeatResponse(success=False)
    client = Client(SendNodeHeartbeat=unknown)
    with flower(client) as (node_id, receive, *_):
        deadline = time.monotonic() + 10
        while "SendNodeHeartbeat" not in client.calls:  # the heartbeat thread's first beat
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.05)
        with pytest.raises(internals.NodeLost, match="does not recognize"):
            receive()

    # a call that needed retries is followed by a heartbeat, which finds the node unknown
    gone = httpx.ConnectError("[Errno 111] Connection refused")
    yes, no = (heartbeat_pb2.SendNodeHeartbeatResponse(success=s) for s in (True, False))
    client = Client(PullMessages=[gone], SendNodeHeartbeat=[yes, no, no, no])
    with flower(client) as (node_id, receive, *_):
        deadline = time.monotonic() + 10
        while "SendNodeHeartbeat" not in client.calls:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(internals.NodeLost):
            receive()
    assert client.calls.count("PullMessages") == 2


# one real restart


@pytest.mark.slow
def test_a_node_rejoins_a_superlink_restarted_under_tls_and_node_authentication(tmp_path):
    """A TLS SuperLink that admits registered nodes only, kept in memory: restarting it
    forgets the node and its key. The node says so, retries until the key is registered
    again, and joins; it never exits, and prints no traceback."""
    port = free_port()
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr"), "FLWR_TELEMETRY_ENABLED": "0"}
    env["OMP_NUM_THREADS"] = "1"
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    from typer.testing import CliRunner

    from fedkit.cli.app import app

    made = CliRunner().invoke(
        app, ["deploy", "certs", str(tmp_path / "tls"), "--name", "127.0.0.1"]
    )
    assert made.exit_code == 0, made.output  # the certificates docs/deploy.md makes
    tls = {
        k: tmp_path / "tls" / f
        for k, f in (("ca", "ca.crt"), ("cert", "server.pem"), ("key", "server.key"))
    }
    superlink = [
        str(BIN / "flower-superlink"), "--ssl-ca-certfile", str(tls["ca"]),
        "--ssl-certfile", str(tls["cert"]), "--ssl-keyfile", str(tls["key"]),
        "--isolation", "subprocess", "--host", "127.0.0.1", "--port", str(port),
        "--enable-supernode-auth",
    ]  # fmt: skip
    key = tmp_path / "node.key"
    from fedkit.flower.node_keys import make_key_pair

    public = make_key_pair(key)
    address = f"127.0.0.1:{port}"
    register = [
        str(BIN / "fedkit"), "deploy", "register", str(public), "--superlink", address,
        "--root-certificates", str(tls["ca"]),
    ]  # fmt: skip
    node = [
        str(BIN / "fedkit"), "deploy", "node", "--superlink", address, "--partition", "0",
        "--dir", str(tmp_path / "node"), "--root-certificates", str(tls["ca"]),
        "--auth-key", str(key), "--reconnect", "60",
    ]  # fmt: skip
    log = tmp_path / "node.log"

    def until(words, count=1, limit=60):
        deadline = time.monotonic() + limit
        while log.read_text().count(words) < count:
            assert procs[1].poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)

    def link_up():
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                assert time.monotonic() < deadline, "the SuperLink did not start"
                time.sleep(0.1)

    procs = [start_process(superlink, tmp_path / "superlink1.log", env)]
    try:
        link_up()
        subprocess.run(register, env=env, check=True, capture_output=True, timeout=60)
        procs.append(start_process(node, log, env))
        until("joined")
        stop_processes(procs[:1])  # the SuperLink restarts, forgetting the node and its key
        procs[0] = start_process(superlink, tmp_path / "superlink2.log", env)
        link_up()
        until("does not know this node yet")
        subprocess.run(register, env=env, check=True, capture_output=True, timeout=60)
        until("joined", count=2)
        text = log.read_text()
        assert "no longer knows this node" in text
        assert "Traceback" not in text and procs[1].poll() is None
    finally:
        stop_processes(procs[1:])
        stop_processes(procs[:1])
        time.sleep(0.3)
        left = [pid for proc in procs for pid in group_members(proc.pid)]
        assert left == [], f"processes left behind: {left}"
