"""The deployment files docs/deploy.md ships (docs/examples/deploy/) say what they mean:
each systemd unit parses and starts a command its program accepts, the Kubernetes
manifest holds the SuperLink's Deployment and Service, the nodes' StatefulSet and a run's
Job, each starting such a command, and the Slurm script's node line parses. And
``fedkit deploy certs`` makes a CA and a SuperLink certificate that a TLS client
verifies for every name it was given, and nothing else."""

from __future__ import annotations

import configparser
import shlex
import socket
import ssl
import threading
from pathlib import Path

import click
import pytest
import typer.main
import yaml
from typer.testing import CliRunner

from fedkit.cli.app import app

pytest.importorskip("flwr", reason="the flower extra is not installed")

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples" / "deploy"
SAMPLE = {"%i": "3", "${HOSTNAME##*-}": "2", "$SLURM_ARRAY_TASK_ID": "1", "$FEDKIT_HOME": "/h"}
"""Sample values for what systemd, the shell or Slurm fill in."""


def fedkit_command(argv: list[str]) -> tuple[str, dict]:
    """The ``fedkit`` subcommand ``argv`` (without ``fedkit``) names, and its parameters
    as the CLI parses them; a click error if the CLI would refuse them."""
    command = typer.main.get_command(app)
    context = command.make_context("fedkit", list(argv))
    names = []
    while isinstance(command, click.Group):
        name, command, rest = command.resolve_command(
            context, context._protected_args + context.args
        )
        names.append(name)
        context = command.make_context(name, rest, parent=context)
    return " ".join(names), context.params


def filled(text: str) -> str:
    for key, value in SAMPLE.items():
        text = text.replace(key, value)
    return text


def words(line: str) -> list[str]:
    """A command line's words, what systemd, Slurm or the shell fill in filled in."""
    return shlex.split(filled(line))


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read_string((EXAMPLES / name).read_text())
    return parser


def test_the_systemd_units_start_commands_their_programs_accept():
    superlink = unit("fedkit-superlink.service")
    argv = words(superlink["Service"]["ExecStart"])
    assert argv[0].endswith("/bin/fedkit")
    name, params = fedkit_command(argv[1:])
    assert name == "deploy superlink" and params["enable_supernode_auth"]
    assert str(params["database"]).endswith(".db") and not params["insecure"]
    assert superlink["Install"]["WantedBy"] == "multi-user.target"

    node = unit("fedkit-node@.service")
    argv = words(node["Service"]["ExecStart"])
    assert argv[0].endswith("/bin/fedkit")
    name, params = fedkit_command(argv[1:])
    assert name == "deploy node" and params["partition"] == 3 and params["reconnect"] == 600
    assert str(params["dir"]).endswith("node-3") and node["Service"]["Restart"] == "on-failure"


def test_the_kubernetes_manifest_runs_a_superlink_nodes_and_a_run():
    documents = list(yaml.safe_load_all((EXAMPLES / "fedkit-kubernetes.yaml").read_text()))
    kinds = {doc["kind"]: doc for doc in documents}
    assert {"Deployment", "Service", "StatefulSet", "Job"} <= set(kinds)
    assert all(doc["metadata"].get("namespace", "fedkit") == "fedkit" for doc in documents)

    def container(kind):
        return kinds[kind]["spec"]["template"]["spec"]["containers"][0]

    link = container("Deployment")["command"]
    assert link[:2] == ["/bin/sh", "-c"]
    argv = words(link[2].split("&&")[1])
    assert argv[:2] == ["exec", "fedkit"]
    name, link_params = fedkit_command(argv[2:])
    assert name == "deploy superlink" and link_params["enable_supernode_auth"]
    service = kinds["Service"]["spec"]
    assert service["selector"] == kinds["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert service["ports"][0]["port"] == link_params["port"]

    shell = container("StatefulSet")["command"]
    assert shell[:2] == ["/bin/sh", "-c"]
    argv = words(shell[2])
    assert argv[0] == "exec" and argv[1] == "fedkit"
    name, params = fedkit_command(argv[2:])
    assert name == "deploy node" and params["partition"] == 2
    assert params["superlink"] == f"{kinds['Service']['metadata']['name']}:{link_params['port']}"

    name, params = fedkit_command(container("Job")["command"][1:])
    assert name == "deploy run" and params["out"] == "quickstart"
    assert kinds["Job"]["spec"]["template"]["spec"]["restartPolicy"] == "Never"


def test_the_slurm_script_starts_a_node_per_array_task():
    text = (EXAMPLES / "fedkit-node.sbatch").read_text()
    assert text.startswith("#!/bin/bash\n") and "#SBATCH --array=" in text
    (line,) = [line for line in text.splitlines() if line.startswith("srun fedkit ")]
    name, params = fedkit_command(words(line)[2:])
    assert name == "deploy node" and params["partition"] == 1
    assert str(params["auth_key"]) == "/h/keys/node-1.key"


def test_certs_makes_a_ca_and_a_superlink_certificate_for_the_names_given(tmp_path):
    done = CliRunner().invoke(
        app,
        ["deploy", "certs", str(tmp_path / "tls"), "--name", "127.0.0.1", "--name", "localhost"],
    )
    assert done.exit_code == 0, done.output
    tls = tmp_path / "tls"
    assert {p.name for p in tls.iterdir()} == {"ca.crt", "ca.key", "server.pem", "server.key"}
    assert (tls / "ca.key").stat().st_mode & 0o077 == 0
    assert (tls / "server.key").stat().st_mode & 0o077 == 0
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tls / "server.pem", tls / "server.key")

    def handshake(name: str) -> bool:
        with socket.create_server(("127.0.0.1", 0)) as listener:

            def accept():
                conn, _ = listener.accept()
                try:
                    server.wrap_socket(conn, server_side=True).close()
                except OSError:
                    conn.close()

            thread = threading.Thread(target=accept)
            thread.start()
            client = ssl.create_default_context(cafile=str(tls / "ca.crt"))
            try:
                with socket.create_connection(listener.getsockname(), timeout=5) as raw:
                    client.wrap_socket(raw, server_hostname=name).close()
                return True
            except ssl.SSLCertVerificationError:
                return False
            finally:
                thread.join(timeout=10)

    assert handshake("127.0.0.1") and handshake("localhost")
    assert not handshake("10.0.0.5")  # a name it was not given

    again = CliRunner().invoke(app, ["deploy", "certs", str(tls), "--name", "127.0.0.1"])
    assert again.exit_code == 2 and "exists" in again.output
    bad = CliRunner().invoke(app, ["deploy", "certs", str(tmp_path / "x"), "--name", "a b"])
    assert bad.exit_code == 2 and "neither an IP address nor a DNS name" in bad.output
