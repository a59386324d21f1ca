"""Operating a deployment from the command line, against a fake ``flwr``: ``fedkit deploy
run`` exits with what became of the run (0 finished; 1 failed, stopped, unknown or no
SuperLink, in one last line that says why and how to resume; 130/143 interrupted, saying
how to watch and stop the run that goes on), ``status``/``log``/``stop`` call Flower's
commands with the generated connection, ``keygen`` makes its folder, ``superlink`` starts
Flower's SuperLink with fedkit's flags. The ServerApp's side (a line per round, the
``fedkit: ...`` line of a failure, the report) is checked by calling it directly.

The fake is a script written by each test: it records its arguments and the Flower
connection it was given, prints the lines a scenario names and exits with its code;
``flwr ls`` answers with the scenario's statuses in turn. The real SuperLink's side is
in tests/test_deployment.py."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import tiny_recipe
from typer.testing import CliRunner

from fedkit.cli import deploy

FAKE = """\
#!{python}
import json, os, sys, time
from pathlib import Path

scenario = json.loads(Path(os.environ["FAKE_FLWR_SCENARIO"]).read_text())
calls = Path(os.environ["FAKE_FLWR_CALLS"])
home = Path(os.environ["FLWR_HOME"]) / "config.toml"
done = calls.read_text().count("\\n") if calls.exists() else 0
previous = [json.loads(l)["args"][0] for l in calls.read_text().splitlines()] if done else []
with calls.open("a") as handle:
    handle.write(json.dumps({{"args": sys.argv[1:], "home": home.read_text()}}) + "\\n")
step = scenario[sys.argv[1]]
if isinstance(step, list):  # answers in turn, the last one repeated
    step = step[min(previous.count(sys.argv[1]), len(step) - 1)]
for line in step.get("lines", []):
    print(line, flush=True)
if step.get("json") is not None:
    print(json.dumps(step["json"], indent=2), flush=True)
if step.get("wait"):
    Path(os.environ["FAKE_FLWR_CALLS"] + ".waiting").touch()
    time.sleep(step["wait"])
sys.exit(step.get("code", 0))
"""

ADDRESS = "127.0.0.1:9"
CONNECT = ["--superlink", ADDRESS, "--insecure"]
GONE = [
    "╭─ Error ──────────────────────────────────────────────────────────────────────╮",
    "│ Connection to the SuperLink is unavailable. Please check your network        │",
    "│ connection and 'address' in the SuperLink connection configuration.          │",
    "╰──────────────────────────────────────────────────────────────────────────────╯",
]
STARTED = ["Using SuperLink: fedkit (127.0.0.1:9)", "Successfully started run 7"]
ROUND = "round   1/2  train_loss 2.2931  test_accuracy 0.1250"
CHECKPOINT = "run directory /srv/runs/deployed: started"


def status(value: str, details: str = "") -> dict:
    """``flwr ls --run-id 7 --format json``'s answer for a run in state ``value``."""
    run = {"run-id": "7", "status": value, "status-details": details}
    return {"json": {"success": True, "runs": [run]}}


@pytest.fixture
def flwr(tmp_path, monkeypatch):
    """A fake ``flwr``: ``flwr(scenario)`` sets what each command prints; the returned
    function gives the calls made so far (arguments, and the Flower config they read)."""
    pytest.importorskip("tomli_w")
    script = tmp_path / "flwr"
    script.write_text(FAKE.format(python=sys.executable))
    script.chmod(0o755)
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_FLWR_SCENARIO", str(tmp_path / "scenario.json"))
    monkeypatch.setenv("FAKE_FLWR_CALLS", str(calls))
    monkeypatch.setattr(deploy, "STATUS_PAUSE", 0.0)
    real = deploy.tool
    monkeypatch.setattr(deploy, "tool", lambda name: str(script) if name == "flwr" else real(name))

    def configure(scenario: dict) -> callable:
        (tmp_path / "scenario.json").write_text(json.dumps(scenario))

        def made() -> list[dict]:
            lines = calls.read_text().splitlines() if calls.exists() else []
            return [json.loads(line) for line in lines]

        return made

    return configure


@pytest.fixture
def recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # short paths in the messages
    Path("recipe.yaml").write_text(yaml.safe_dump(tiny_recipe()))
    return "recipe.yaml"


def submit(recipe: str, *extra: str):
    args = ["run", recipe, "--out", "deployed", *CONNECT, *extra]
    return CliRunner().invoke(deploy.app, args)


def last_line(result) -> str:
    return result.output.strip().splitlines()[-1]


def test_a_finished_run_exits_0_after_showing_its_rounds(flwr, recipe):
    calls = flwr(
        {"run": {"lines": [*STARTED, CHECKPOINT, ROUND]}, "ls": status("finished:completed")}
    )
    done = submit(recipe)
    assert done.exit_code == 0, done.output
    assert ROUND in done.output and "fedkit:" not in done.output
    run, ls = calls()
    assert run["args"][0] == "run" and "--stream" in run["args"]
    assert ls["args"] == ["ls", "fedkit", "--run-id", "7", "--format", "json"]
    assert f'address = "{ADDRESS}"' in ls["home"] and "insecure = true" in ls["home"]


RESUME = f"to resume: fedkit deploy run recipe.yaml --out deployed --superlink {ADDRESS} --insecure"


@pytest.mark.parametrize(
    ("case", "stream", "answer", "said"),
    [
        (
            "a bug in the ServerApp",
            [
                CHECKPOINT,
                ROUND,
                "Traceback (most recent call last):",
                "KeyError: 1",
                "fedkit: KeyError: 1",
            ],
            status("finished:failed", "ServerApp failed with exception: 1"),
            f"fedkit: run 7 failed: KeyError: 1; {RESUME}",
        ),
        (
            "a killed ServerApp",
            [CHECKPOINT, ROUND],
            status("finished:failed", "Task failed because the run expired"),
            f"fedkit: run 7 failed: Task failed because the run expired; {RESUME}",
        ),
        (
            "too few nodes",
            [
                "fedkit: 2 of the recipe's 3 nodes connected within 300 s: start one "
                "`fedkit deploy node` per client"
            ],
            status("finished:failed", "ServerApp failed with exception: 2 of ..."),
            "fedkit: run 7 failed: 2 of the recipe's 3 nodes connected within 300 s: start "
            f"one `fedkit deploy node` per client; {RESUME}",
        ),
        (
            "a damaged file on a node",
            [CHECKPOINT, "fedkit: client 1's node: memories/1.r000002.safetensors: hash mismatch"],
            status("finished:failed"),
            "fedkit: run 7 failed: client 1's node: memories/1.r000002.safetensors: hash "
            f"mismatch; {RESUME}",
        ),
        (
            "a refusal by the server's folder checks",
            ["fedkit: refused the run: run config: out: expected a relative folder name"],
            status("finished:failed"),
            "fedkit: run 7 failed: refused the run: run config: out: expected a relative "
            f"folder name; {RESUME}",
        ),
        (
            "a stopped run",
            [CHECKPOINT, ROUND],
            status("finished:stopped", "Task stopped by user."),
            f"fedkit: run 7 was stopped; {RESUME}",
        ),
    ],
)
def test_a_run_that_did_not_finish_exits_1_with_one_line(flwr, recipe, case, stream, answer, said):
    flwr({"run": {"lines": [*STARTED, *stream]}, "ls": answer})
    done = submit(recipe)
    assert done.exit_code == 1, (case, done.output)
    assert last_line(done) == said, case
    assert "Traceback" not in done.output.split("KeyError: 1")[-1]


def test_a_stopped_superlink_is_named_and_the_end_unknown(flwr, recipe):
    gone = {"json": {"success": False, "error-message": "Using SuperLink\n" + GONE[1][2:]}}
    calls = flwr({"run": {"lines": [*STARTED, CHECKPOINT, ROUND, *GONE], "code": 1}, "ls": gone})
    done = submit(recipe)
    assert done.exit_code == 1
    assert last_line(done) == (
        f"fedkit: lost the SuperLink at {ADDRESS}; how run 7 ended is unknown (fedkit deploy "
        f"status 7 --superlink {ADDRESS} --insecure); {RESUME}"
    )
    assert len(calls()) == 2  # a broken stream: the status is asked once


def test_a_superlink_that_cannot_be_reached_is_named(flwr, recipe):
    calls = flwr({"run": {"lines": ["Using SuperLink: fedkit (127.0.0.1:9)", *GONE], "code": 1}})
    done = submit(recipe)
    assert done.exit_code == 1
    assert last_line(done) == (
        f"fedkit: cannot reach the SuperLink at {ADDRESS}: is it running, and is that the "
        "address of its API (--superlink)?"
    )
    assert [c["args"][0] for c in calls()] == ["run"]


def test_flowers_own_refusal_to_start_a_run_is_one_line(flwr, recipe):
    box = ["╭─ Error ───╮", "│ [code: 3] Federation not found │", "╰───────────╯"]
    flwr({"run": {"lines": box, "code": 1}})
    done = submit(recipe)
    assert done.exit_code == 1
    assert last_line(done) == (
        "fedkit: flwr run did not start the run (exit 1): [code: 3] Federation not found"
    )


def test_resuming_keeps_only_the_set_keys_a_run_with_a_checkpoint_takes(flwr, recipe):
    refused = (
        "fedkit: --set: expected only federation.rounds or evaluation.* with --resume, "
        "found 'seed=4'"
    )
    resuming = "run directory /srv/runs/deployed: resuming its newest checkpoint"
    flwr({"run": {"lines": [*STARTED, resuming, refused]}, "ls": status("finished:failed")})
    done = submit(recipe, "--set", "seed=4", "--set", "federation.rounds=3")
    assert done.exit_code == 1
    assert last_line(done).endswith(
        f"to resume: fedkit deploy run recipe.yaml --out deployed --set federation.rounds=3 "
        f"--superlink {ADDRESS} --insecure"
    )
    assert refused.removeprefix("fedkit: ") in last_line(done)
    # no checkpoint yet (the nodes never came): the same command, every --set kept
    flwr({"run": {"lines": [*STARTED, "fedkit: 0 of 3 nodes"]}, "ls": status("finished:failed")})
    again = submit(recipe, "--set", "seed=4")
    assert last_line(again).endswith(
        f"--out deployed --set seed=4 --superlink {ADDRESS} --insecure"
    )
    from fedkit.core.runs import RESUME_KEYS

    assert deploy.RESUME_KEYS == RESUME_KEYS


def test_a_status_recorded_late_is_waited_for(flwr, recipe):
    answers = [status("running"), status("running"), status("finished:completed")]
    calls = flwr({"run": {"lines": STARTED}, "ls": answers})
    done = submit(recipe)
    assert done.exit_code == 0, done.output
    assert [c["args"][0] for c in calls()] == ["run", "ls", "ls", "ls"]


def test_a_run_still_going_after_its_stream_ended_says_how_to_watch_it(flwr, recipe, monkeypatch):
    monkeypatch.setattr(deploy, "STATUS_TRIES", 2)
    calls = flwr({"run": {"lines": STARTED}, "ls": status("running")})
    done = submit(recipe)
    assert done.exit_code == 1
    assert last_line(done).endswith(
        f"watch it: fedkit deploy log 7 --superlink {ADDRESS} --insecure"
    )
    assert len(calls()) == 3


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_deploy_run_says_the_run_goes_on_and_how_to_stop_it(
    flwr, recipe, tmp_path, signum, code
):
    calls = flwr({"run": {"lines": STARTED, "wait": 60}})
    before = signal.getsignal(signum)
    waiting = Path(str(tmp_path / "calls.jsonl") + ".waiting")

    def interrupt() -> None:
        deadline = time.monotonic() + 30
        while not waiting.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signum)

    threading.Thread(target=interrupt, daemon=True).start()
    began = time.monotonic()
    done = submit(recipe)
    assert done.exit_code == code, done.output
    assert time.monotonic() - began < 30  # the fake's 60 s wait was cut short
    assert last_line(done) == (
        "fedkit: stopped following run 7, which goes on at the SuperLink; watch it: "
        f"fedkit deploy log 7 --superlink {ADDRESS} --insecure; stop it: fedkit deploy stop "
        f"7 --superlink {ADDRESS} --insecure"
    )
    assert [c["args"][0] for c in calls()] == ["run"]  # no status asked, nothing stopped
    assert signal.getsignal(signum) is before  # the handlers are put back


def test_status_log_and_stop_call_flowers_commands_with_the_generated_connection(
    flwr, tmp_path, monkeypatch
):
    pytest.importorskip("cryptography")
    from fedkit.flower.certificates import make_certificates

    monkeypatch.chdir(tmp_path)
    ca = tmp_path / "ca.crt"
    ca.write_bytes(make_certificates(tmp_path / "tls", ["10.0.0.5"])["ca.crt"].read_bytes())
    tls = ["--superlink", "10.0.0.5:9092", "--root-certificates", "ca.crt"]
    calls = flwr({
        "ls": {"lines": ["Run 7 finished:completed"]},
        "log": {"lines": [ROUND]},
        "stop": {"lines": ["Run 7 successfully stopped."]},
    })  # fmt: skip
    for command in (["status"], ["status", "7", "--json"], ["log", "7"], ["log", "7", "--show"],
                    ["stop", "7"]):  # fmt: skip
        done = CliRunner().invoke(deploy.app, [*command, *tls])
        assert done.exit_code == 0, done.output
    assert [c["args"] for c in calls()] == [
        ["ls", "fedkit"],
        ["ls", "fedkit", "--run-id", "7", "--format", "json"],
        ["log", "7", "fedkit", "--stream"],
        ["log", "7", "fedkit", "--show"],
        ["stop", "7", "fedkit"],
    ]
    home = calls()[0]["home"]
    assert 'address = "10.0.0.5:9092"' in home and f'root-certificates = "{ca}"' in home
    assert "insecure" not in home


def test_status_log_and_stop_exit_1_with_one_line_when_flower_fails(flwr):
    refused = {"json": {"success": False, "error-message": "Using SuperLink\nRun 9 not found"}}
    flwr({"ls": refused, "log": {"lines": GONE, "code": 1}, "stop": {"lines": ["Error: no"],
          "code": 1}})  # fmt: skip
    json_status = CliRunner().invoke(deploy.app, ["status", "9", "--json", *CONNECT])
    assert json_status.exit_code == 1  # Flower's JSON says success: false, and exits 0
    assert last_line(json_status) == "fedkit: flwr ls failed: Using SuperLink Run 9 not found"
    log = CliRunner().invoke(deploy.app, ["log", "9", *CONNECT])
    assert log.exit_code == 1
    assert last_line(log) == (
        f"fedkit: cannot reach the SuperLink at {ADDRESS}: is it running, and is that its address?"
    )
    stop = CliRunner().invoke(deploy.app, ["stop", "9", *CONNECT])
    assert stop.exit_code == 1 and last_line(stop) == "fedkit: flwr stop failed: Error: no"
    bare = CliRunner().invoke(deploy.app, ["stop", "9", "--superlink", ADDRESS])
    assert bare.exit_code == 2 and "--insecure" in bare.output


def test_keygen_makes_the_keys_folder_and_names_a_folder_it_cannot_make(tmp_path, monkeypatch):
    pytest.importorskip("flwr")
    monkeypatch.chdir(tmp_path)
    made = CliRunner().invoke(deploy.app, ["keygen", "nodes/0.key"])
    assert made.exit_code == 0, made.output
    assert (tmp_path / "nodes" / "0.key").is_file() and (tmp_path / "nodes" / "0.key.pub").is_file()
    Path("taken").write_text("a file, not a folder")
    refused = CliRunner().invoke(deploy.app, ["keygen", "taken/0.key"])
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    assert "cannot make the folder taken" in " ".join(refused.output.split())


def test_every_bad_file_is_one_line_naming_the_flag_and_the_file_and_exit_2(tmp_path, monkeypatch):
    """A CA file without a certificate (Flower's TLS raised ssl.SSLError), keys on a disk
    no file can be made on (as root, /proc and a path under a file stand in for a
    read-only disk), an app or certificate folder that is a file: one line, exit 2."""
    pytest.importorskip("flwr")
    monkeypatch.chdir(tmp_path)
    Path("a-file").write_text("a file, not a folder")
    Path("ca.crt").write_text("not a certificate\n")
    Path("cut.crt").write_text("-----BEGIN CERTIFICATE-----\nabc\n-----END CERTIFICATE-----\n")
    Path("bad.key").write_text("not a key\n")
    node = ["node", "--superlink", ADDRESS, "--partition", "0", "--dir", "site"]
    cases = {
        (*node, "--root-certificates", "ca.crt"): "--root-certificates ca.crt: holds no PEM",
        (*node, "--root-certificates", "cut.crt"): "--root-certificates cut.crt: holds a PEM",
        (*node, "--root-certificates", "none.crt"): "--root-certificates none.crt: No such file",
        (*node, "--insecure", "--auth-key", "bad.key"): "--auth-key bad.key: not an OpenSSH",
        (*node[:-1], "a-file/site", "--insecure"): "--dir a-file/site: cannot make this folder",
        ("status", "--superlink", ADDRESS, "--root-certificates", "ca.crt"): (
            "--root-certificates ca.crt: holds no PEM"
        ),
        ("keygen", "/proc/node.key"): "KEY /proc/node.key: cannot write in the folder /proc",
        ("keygen", "a-file/node.key"): "KEY a-file/node.key: cannot make the folder a-file",
        ("app", "a-file"): "DIR a-file: is a file; expected a folder",
        ("app", "/proc/app"): "DIR /proc/app: cannot write the app there",
        ("certs", "a-file", "--name", "127.0.0.1"): "DIR a-file: is a file",
        ("register", "none.pub", *CONNECT): "KEYS none.pub is not a file",
        ("run", "none.yaml", "--out", "x", *CONNECT): "RECIPE (file): expected a recipe file",
    }
    for args, said in cases.items():
        done = CliRunner().invoke(deploy.app, list(args))
        assert done.exit_code == 2, (args, done.output)
        assert done.output.strip().splitlines() == [done.output.strip()], (args, done.output)
        assert done.output.startswith(f"fedkit: {said}"), (args, done.output)
    assert not Path("site").exists()  # refused before the node made its folder


def test_a_node_that_never_reaches_its_superlink_names_it_and_exits_2(monkeypatch, tmp_path):
    """Nothing answers at --superlink: the node says where it is joining and for how long
    it tries (--reconnect), then stops with one line naming the address, exit 2 (its
    flags are the likely fault). A node that had joined and lost its SuperLink exits 1."""
    pytest.importorskip("flwr")
    import httpx

    from fedkit.flower import runner

    monkeypatch.setattr(signal, "signal", lambda *args: None)  # the command's SIGTERM handler

    def serve(superlink, partition, folder, *, reconnect, connected, **kwargs):
        if joined_before:
            connected(5)
        trouble = runner.Trouble(superlink, reconnect, insecure=True, keyed=False)
        trouble.handle(httpx.ConnectError("[Errno 111] Connection refused"))

    monkeypatch.setattr(runner, "serve", serve)
    args = ["node", "--superlink", ADDRESS, "--partition", "0", "--insecure", "--reconnect", "0"]
    for joined_before, code in ((False, 2), (True, 1)):  # noqa: B007 - serve reads it
        done = CliRunner().invoke(deploy.app, [*args, "--dir", str(tmp_path / "n")])
        assert done.exit_code == code, done.output
        lines = done.output.strip().splitlines()
        assert lines[0].startswith(f"joining the SuperLink at {ADDRESS}; without an answer")
        assert "stops after 0 s of retrying (--reconnect)" in lines[0]
        assert lines[-1].startswith(f"the node stopped: the SuperLink at {ADDRESS} did not answer")
        assert lines[-1].endswith("(--reconnect sets how long it tries)")


def test_superlink_starts_flower_with_fedkits_flags_and_its_bin_on_path(tmp_path, monkeypatch):
    pytest.importorskip("flwr")
    started = []
    monkeypatch.setattr(os, "execve", lambda binary, argv, env: started.append((binary, argv, env)))
    monkeypatch.delenv("FEDKIT_SERVER_ROOT", raising=False)
    monkeypatch.setenv("PATH", "/usr/bin")
    runs = tmp_path / "runs"
    runs.mkdir()
    tls = {}
    for name in ("ca.crt", "server.pem", "server.key"):
        tls[name] = tmp_path / name
        tls[name].write_text(name)
    args = [
        "superlink", "--runs", str(runs), "--port", "9092", "--ssl-ca-certfile", str(tls["ca.crt"]),
        "--ssl-certfile", str(tls["server.pem"]), "--ssl-keyfile", str(tls["server.key"]),
        "--enable-supernode-auth",
    ]  # fmt: skip
    done = CliRunner().invoke(deploy.app, args)
    assert done.exit_code == 0, done.output
    ((binary, argv, env),) = started
    bin_dir = Path(sys.executable).parent
    assert binary == str(bin_dir / "flower-superlink") and argv[0] == binary
    assert argv[1:] == [
        "--isolation", "subprocess", "--disable-runtime-dependency-installation",
        "--host", "127.0.0.1", "--port", "9092",
        "--ssl-ca-certfile", str(tls["ca.crt"]), "--ssl-certfile", str(tls["server.pem"]),
        "--ssl-keyfile", str(tls["server.key"]), "--enable-supernode-auth",
    ]  # fmt: skip
    assert env["PATH"] == f"{bin_dir}{os.pathsep}/usr/bin"  # flower-superexec is found
    assert env["FEDKIT_SERVER_ROOT"] == str(runs)

    def refused(*extra: str) -> str:
        done = CliRunner().invoke(deploy.app, ["superlink", *extra])
        assert done.exit_code == 2, done.output
        return " ".join(done.output.split())

    assert "FEDKIT_SERVER_ROOT is not set" in refused("--insecure")
    assert "expected an existing directory" in refused("--runs", "nowhere", "--insecure")
    assert "--ssl-keyfile" in refused("--runs", str(runs), "--ssl-ca-certfile", str(tls["ca.crt"]))
    assert "needs TLS" in refused("--runs", str(runs), "--insecure", "--enable-supernode-auth")
    assert len(started) == 1


def test_the_serverapp_prints_a_line_per_round_and_one_line_when_it_fails(
    tmp_path, monkeypatch, capsys
):
    pytest.importorskip("flwr")
    from flwr.app import Context, RecordDict

    from fedkit.cli.progress import LineReporter
    from fedkit.errors import FedkitError
    from fedkit.flower import serverapp

    LineReporter(2).round_done(1, {"round": 1, "train_loss": 2.5, "test_accuracy": 0.25})
    assert capsys.readouterr().out == "round   1/2  train_loss 2.5000  test_accuracy 0.2500\n"

    class TwoNodes:
        def get_node_ids(self):
            return [11, 12]

    root = tmp_path / "server"
    root.mkdir()
    monkeypatch.setenv("FEDKIT_SERVER_ROOT", str(root))
    monkeypatch.setattr(serverapp, "NODE_WAIT", 0.0)
    config = {"recipe": yaml.safe_dump(tiny_recipe()), "out": "deployed", "set": ""}
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config)
    with pytest.raises(FedkitError):
        serverapp.main(TwoNodes(), context)
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "fedkit: 2 of the recipe's 3 nodes connected within 0 s: start one "
        "`fedkit deploy node` per client"
    ]
    assert serverapp.failure(KeyError(1)) == "KeyError: 1"
    assert serverapp.failure(FedkitError("a\nb")) == "a"


def test_a_server_without_matplotlib_gets_one_line_instead_of_a_report(
    tmp_path, monkeypatch, capsys
):
    pytest.importorskip("flwr")
    from fedkit.cli import report
    from fedkit.errors import FedkitError
    from fedkit.flower import serverapp

    def missing():
        raise FedkitError("fedkit report needs matplotlib (pip install 'fedkit-fl[report]')")

    monkeypatch.setattr(report, "pyplot", missing)
    monkeypatch.setenv("FEDKIT_REPORT", "0")  # off, as for `fedkit run`: not even a note
    serverapp.write_report(tmp_path)
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("FEDKIT_REPORT", "1")
    serverapp.write_report(tmp_path)
    assert capsys.readouterr().out == (
        "no report: fedkit report needs matplotlib (pip install 'fedkit-fl[report]')\n"
    )
    assert not (tmp_path / "report.html").exists()
