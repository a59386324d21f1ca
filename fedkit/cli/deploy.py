"""``fedkit deploy``: a recipe on a real Flower federation.

``node`` starts one site: one process that is the site's Flower node and runs its
fedkit client (``fedkit.flower.runner``). ``app``
writes the Flower app (a ``pyproject.toml`` naming fedkit's ServerApp and ClientApp) and
``run`` submits a recipe to a SuperLink with ``flwr run``. docs/deploy.md walks through it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from fedkit.cli.progress import CHECKPOINTED
from fedkit.errors import FedkitError
from fedkit.plugin.entrypoints import discover

app = typer.Typer(no_args_is_help=True, help="Run recipes on a Flower deployment.")

Insecure = Annotated[bool, typer.Option(help="No TLS (only on a trusted network, e.g. 127.0.0.1).")]
RootCertificates = Annotated[
    Path | None, typer.Option(help="CA certificate to verify the SuperLink (TLS).")
]

PYPROJECT = """\
# A Flower app that runs fedkit recipes (written by `fedkit deploy app`).
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fedkit-flower-app"
version = "1.0.0"
description = "Runs fedkit recipes on a Flower deployment."
license = "MIT"
dependencies = ["fedkit-fl[flower]"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "fedkit"

[tool.flwr.app.components]
serverapp = "fedkit.flower.serverapp:app"
clientapp = "fedkit.flower.clientapp:app"

[tool.flwr.app.config]
recipe = "quickstart"
out = "runs/flower"
set = ""
"""


def tool(name: str) -> str:
    """A Flower command next to this Python (the same environment), else on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.is_file() else shutil.which(name)
    if found is None:
        raise typer.BadParameter(
            f"{name} not found: install the flower extra (pip install 'fedkit-fl[flower]')"
        )
    return found


def connection(insecure: bool, root_certificates: Path | None) -> list[str]:
    """Flower's connection flags; a clear error when neither is given, or when the
    ``--root-certificates`` file cannot be read or holds no certificate."""
    if insecure:
        return ["--insecure"]
    if root_certificates is None:
        raise typer.BadParameter(
            "give --root-certificates CA.pem (TLS), or --insecure on a trusted network"
        )
    ca_certificates(root_certificates)
    return ["--root-certificates", str(root_certificates)]


def ca_certificates(path: Path) -> bytes:
    """The bytes of a CA certificate file, checked as Flower reads it (PEM text that TLS
    can verify with), or one line naming ``--root-certificates`` and the file, exit 2."""
    data = readable(path, "--root-certificates")
    why = None
    if b"-----BEGIN CERTIFICATE-----" not in data:
        why = "holds no PEM certificate"
    else:
        try:
            ssl.create_default_context(cadata=data.decode("ascii"))
        except (UnicodeDecodeError, ssl.SSLError, ValueError):
            why = "holds a PEM certificate that TLS cannot read"
    if why is not None:
        bad_file(
            "--root-certificates",
            path,
            f"{why}; expected the CA certificate that signed the SuperLink's (ca.crt from "
            "fedkit deploy certs)",
        )
    return data


@app.command("node")
def node(
    superlink: Annotated[str, typer.Option(help="The SuperLink's Fleet API, host:port.")],
    partition: Annotated[
        int, typer.Option(help="The client this site holds (its partition of the recipe's data).")
    ],
    dir: Annotated[Path, typer.Option("--dir", help="This node's folder: what its client keeps.")],
    insecure: Insecure = False,
    root_certificates: RootCertificates = None,
    auth_key: Annotated[
        Path | None,
        typer.Option(help="This node's private key, for SuperLink node authentication."),
    ] = None,
    poll: Annotated[
        float,
        typer.Option(help="Longest wait of the idle node between asks for messages (s)."),
    ] = 0.2,
    data: Annotated[
        Path | None,
        typer.Option(
            "--data",
            help="This site's own images (an ImageFolder, optionally with train/ and test/), "
            "instead of its partition of the recipe's data set.",
        ),
    ] = None,
    allow: Annotated[
        str | None,
        typer.Option(
            help="The plugins this node runs, comma-separated (default: every plugin installed "
            "here); a run whose recipe names another is refused.",
        ),
    ] = None,
    reconnect: Annotated[
        float,
        typer.Option(
            min=0,
            help="How long to keep trying to reach or rejoin the SuperLink (s) before the "
            "node stops with exit code 1 (a SuperLink restart, a key still held online), "
            "or 2 when nothing ever answered at --superlink.",
        ),
    ] = 300.0,
) -> None:
    """Start one site: a Flower node, in one process with the fedkit client it holds."""
    tool("flower-supernode")  # the flower extra is installed, or a clear error
    from fedkit.flower.internals import CALL_PATIENCE
    from fedkit.flower.node_keys import load_key_pair
    from fedkit.flower.runner import NodeStopped, serve

    connection(insecure, root_certificates)  # one of the two is given, or a clear error
    folder = dir.expanduser().resolve()
    site = data.expanduser().resolve() if data is not None else None
    if site is not None and not site.is_dir():
        bad_file("--data", data, "expected a directory of class folders")
    allowed = allowed_plugins(allow)
    certificates = None
    if not insecure and root_certificates is not None:
        certificates = ca_certificates(root_certificates)
    keys = None
    if auth_key is not None:
        try:
            keys = load_key_pair(auth_key.expanduser())
        except ValueError as error:
            fail(f"--auth-key {error}", 2)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        bad_file("--dir", dir, f"cannot make this folder ({error.strerror})")
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)  # leaves the SuperLink (deactivates this node) on the way out

    joined: list[int] = []

    def connected(node_id: int) -> None:
        joined.append(node_id)
        typer.echo(f"node {node_id} joined {superlink}, holding client {partition}")

    signal.signal(signal.SIGTERM, stop)
    typer.echo(
        f"joining the SuperLink at {superlink}; without an answer the node stops after "
        f"{reconnect:g} s of retrying (--reconnect), each try waiting up to {CALL_PATIENCE:g} s"
    )
    try:
        serve(
            superlink, partition, folder, certificates=certificates, keys=keys, site=site,
            allow=allowed, poll=poll, reconnect=reconnect, connected=connected,
        )  # fmt: skip
    except KeyboardInterrupt:
        pass
    except NodeStopped as stopped:
        typer.echo(f"the node stopped: {stopped}", err=True)
        # nothing ever answered there: the address (--superlink) is the likely fault
        raise typer.Exit(2 if stopped.unreachable and not joined else 1) from None
    except SystemExit as done:
        if done.code:  # e.g. a SuperLink that requires node authentication refused this node
            typer.echo("the node stopped: the SuperLink did not admit it (Flower's reason above)")
            raise typer.Exit(1) from None


def allowed_plugins(allow: str | None) -> frozenset[str] | None:
    """``--allow``'s plugin names, each installed here, or a clear error naming it."""
    if allow is None:
        return None
    names = frozenset(n.strip() for n in allow.split(",") if n.strip())
    installed = discover()
    unknown = sorted(names - set(installed))
    if not names or unknown:
        raise typer.BadParameter(
            f"{', '.join(unknown) or 'nothing'}: name plugins installed here "
            f"({', '.join(sorted(installed))})",
            param_hint="--allow",
        )
    return names


def readable(path: Path, option: str) -> bytes:
    """The bytes of the file an option names, or one line naming the option, exit 2."""
    try:
        return path.expanduser().read_bytes()
    except OSError as error:
        bad_file(option, path, error.strerror or type(error).__name__)


def bad_file(option: str, path: Path | None, why: str) -> NoReturn:
    """One line naming the option (or argument) and its file, then exit 2."""
    fail(f"{option} {path}: {why}", 2)


@app.command("app")
def write_app(
    dir: Annotated[Path, typer.Argument(help="Folder to write the Flower app into.")],
) -> None:
    """Write the Flower app that runs fedkit recipes (for `flwr run DIR ...`)."""
    if dir.exists() and not dir.is_dir():
        bad_file("DIR", dir, "is a file; expected a folder to write the app into (made if missing)")
    try:
        dir.mkdir(parents=True, exist_ok=True)
        (dir / "pyproject.toml").write_text(PYPROJECT)
    except OSError as error:
        bad_file("DIR", dir, f"cannot write the app there ({error.strerror})")
    typer.echo(f"wrote {dir / 'pyproject.toml'}")


@app.command("run")
def run(
    recipe: Annotated[
        str,
        typer.Argument(
            help="A recipe file or shipped name, read here; its YAML text is what the "
            "SuperLink receives."
        ),
    ],
    superlink: Annotated[str, typer.Option(help="The SuperLink's Control API, host:port.")],
    out: Annotated[
        str,
        typer.Option(
            help="The run directory: a relative name, under the folder the SuperLink's "
            "operator set (FEDKIT_SERVER_ROOT); resumed if it has a checkpoint."
        ),
    ],
    set: Annotated[
        list[str] | None, typer.Option("--set", help="KEY=VALUE recipe override (repeatable).")
    ] = None,
    insecure: Insecure = False,
    root_certificates: RootCertificates = None,
) -> None:
    """Submit a recipe to a SuperLink (`flwr run`), stream its log (a line per round) until
    it ends, and exit with what became of the run. Exit codes: 0 the run finished; 1 it
    failed or was stopped, its end is unknown, or the SuperLink cannot be reached (a last
    line says why and how to resume); 2 bad input, nothing submitted; 130 (Ctrl-C) or 143
    (SIGTERM) this command was interrupted while the run goes on at the SuperLink (a last
    line says how to watch and stop it)."""
    import tomli_w  # Flower's own dependency: the flower extra is installed

    from fedkit.config.schema import load_recipe
    from fedkit.config.shipped import resolve
    from fedkit.flower.server_root import relative_name

    if not relative_name(out):
        raise typer.BadParameter(
            f"{out!r}: expected a relative folder name without '..' (it is made under the "
            "SuperLink's FEDKIT_SERVER_ROOT)",
            param_hint="--out",
        )
    overrides = set or []
    try:
        path = resolve(recipe)
        load_recipe(path, overrides)  # a recipe that cannot run is refused here, not there
        text = path.read_text()
    except (FedkitError, OSError) as error:
        fail(f"RECIPE {error}", 2)
    link = Link(superlink, insecure, root_certificates)
    seen = Streamed()
    with link.home() as (env, tmp):
        app_dir = tmp / "app"
        app_dir.mkdir()
        (app_dir / "pyproject.toml").write_text(PYPROJECT)
        values = {"recipe": text, "out": out.strip(), "set": ";".join(overrides)}
        config = tmp / "run-config.toml"  # a file: the recipe's text spans lines
        config.write_text(tomli_w.dumps(values))
        command = ["run", str(app_dir), CONNECTION, "--stream", "--run-config", str(config)]
        try:
            with interruptible():
                follow(command, env, seen)
                status = None if seen.run_id is None else final_status(seen, env)
        except Interrupted as stop:
            fail(interrupted(seen, link), stop.code)
    again = link.fedkit("run", recipe, "--out", out.strip(), *resumed(overrides, seen))
    settle(seen, status, link, f"to resume: {again}")


@app.command("status")
def status(
    superlink: Annotated[str, typer.Option(help="The SuperLink's Control API, host:port.")],
    run_id: Annotated[
        int | None, typer.Argument(help="A run's id (default: list every run).")
    ] = None,
    insecure: Insecure = False,
    root_certificates: RootCertificates = None,
    as_json: Annotated[bool, typer.Option("--json", help="Flower's JSON output.")] = False,
) -> None:
    """The runs a SuperLink knows, or one run's details: status (finished:completed,
    finished:failed, ...), times, traffic (`flwr ls`). Exit 1 with one line if the
    SuperLink cannot be reached."""
    args = ["ls", CONNECTION, *(["--run-id", str(run_id)] if run_id is not None else [])]
    relay(
        [*args, *(["--format", "json"] if as_json else [])], superlink, insecure, root_certificates
    )


@app.command("log")
def log(
    run_id: Annotated[int, typer.Argument(help="The run's id (`fedkit deploy status`).")],
    superlink: Annotated[str, typer.Option(help="The SuperLink's Control API, host:port.")],
    insecure: Insecure = False,
    root_certificates: RootCertificates = None,
    stream: Annotated[
        bool,
        typer.Option(
            "--stream/--show", help="Follow the log until the run ends, or print what it holds now."
        ),
    ] = True,
) -> None:
    """A run's log: what the ServerApp printed (a line per round, errors), as
    `fedkit deploy run` streamed it (`flwr log`). Ctrl-C stops following (exit 130); the
    run goes on."""
    args = ["log", str(run_id), CONNECTION, "--stream" if stream else "--show"]
    relay(args, superlink, insecure, root_certificates)


@app.command("stop")
def stop(
    run_id: Annotated[int, typer.Argument(help="The run's id (`fedkit deploy status`).")],
    superlink: Annotated[str, typer.Option(help="The SuperLink's Control API, host:port.")],
    insecure: Insecure = False,
    root_certificates: RootCertificates = None,
) -> None:
    """Stop a run at the SuperLink (`flwr stop`); its run directory keeps its newest
    checkpoint, and `fedkit deploy run` with the same --out resumes it."""
    relay(["stop", str(run_id), CONNECTION], superlink, insecure, root_certificates)


@app.command("superlink")
def superlink_command(
    runs: Annotated[
        Path | None,
        typer.Option(
            help="The folder runs are written under (sets FEDKIT_SERVER_ROOT; default: that "
            "variable, which must then be set)."
        ),
    ] = None,
    data: Annotated[
        Path | None,
        typer.Option(
            help="The folder the server reads data sets from, and downloads into (sets "
            "FEDKIT_SERVER_DATA)."
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on (0.0.0.0: every one).")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(help="Port of the SuperLink's one HTTP API.")] = 9091,
    insecure: Insecure = False,
    ssl_ca_certfile: Annotated[Path | None, typer.Option(help="The CA certificate (TLS).")] = None,
    ssl_certfile: Annotated[
        Path | None, typer.Option(help="The server's certificate, signed by the CA (TLS).")
    ] = None,
    ssl_keyfile: Annotated[
        Path | None, typer.Option(help="The server's private key (TLS).")
    ] = None,
    enable_supernode_auth: Annotated[
        bool,
        typer.Option(help="Admit only nodes whose keys were registered (needs TLS)."),
    ] = False,
    database: Annotated[
        Path | None,
        typer.Option(help="Keep the SuperLink's state in this SQLite file (default: memory)."),
    ] = None,
) -> None:
    """Start Flower's SuperLink as a fedkit deployment needs it: ServerApps in
    subprocesses, no runtime dependency installation, FEDKIT_SERVER_ROOT set, and this
    environment's bin first on PATH (the SuperLink starts `flower-superexec` and
    `flwr-serverapp` by name). It replaces this process, so a service manager's signals
    reach the SuperLink itself."""
    from fedkit.flower.server_root import DATA_ENV, ROOT_ENV, data_root, server_root

    binary = tool("flower-superlink")
    env = dict(os.environ)
    if runs is not None:
        env[ROOT_ENV] = str(runs.expanduser().absolute())
    if data is not None:
        env[DATA_ENV] = str(data.expanduser().absolute())
    try:
        server_root(env)
        data_root(env)
    except FedkitError as error:
        fail(f"--runs / --data: {error}", 2)
    tls = {
        "--ssl-ca-certfile": ssl_ca_certfile,
        "--ssl-certfile": ssl_certfile,
        "--ssl-keyfile": ssl_keyfile,
    }
    given = {option: path for option, path in tls.items() if path is not None}
    if insecure == bool(given) or (given and len(given) < len(tls)):
        raise typer.BadParameter(
            "give --ssl-ca-certfile, --ssl-certfile and --ssl-keyfile (TLS), or --insecure "
            "on a trusted network",
            param_hint="--insecure",
        )
    if insecure and enable_supernode_auth:
        raise typer.BadParameter(
            "node authentication needs TLS", param_hint="--enable-supernode-auth"
        )
    command = [
        binary, "--isolation", "subprocess", "--disable-runtime-dependency-installation",
        "--host", host, "--port", str(port),
    ]  # fmt: skip
    for option, path in given.items():
        readable(path, option)
        command += [option, str(path.expanduser().absolute())]
    command += ["--insecure"] if insecure else []
    command += ["--enable-supernode-auth"] if enable_supernode_auth else []
    command += ["--database", str(database.expanduser().absolute())] if database is not None else []
    bin_dir = str(Path(binary).parent)
    env["PATH"] = os.pathsep.join([bin_dir, env.get("PATH", "")]) if env.get("PATH") else bin_dir
    env.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    shown = shlex.join(["flower-superlink", *command[1:]])
    typer.echo(f"fedkit: {shown} ({ROOT_ENV}={env[ROOT_ENV]}; {bin_dir} first on PATH)", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(binary, command, env)


@app.command("keygen")
def keygen(
    key: Annotated[
        Path,
        typer.Argument(help="Where to write the node's private key (its public key: KEY.pub)."),
    ],
) -> None:
    """Make a node's key pair for SuperLink node authentication (P-384, OpenSSH format);
    the key's folder is made if missing."""
    tool("flower-supernode")  # the flower extra (and its cryptography) is installed
    from fedkit.flower.node_keys import make_key_pair

    private = key.expanduser()
    try:
        private.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        bad_file("KEY", key, f"cannot make the folder {private.parent} ({error.strerror})")
    try:
        public = make_key_pair(private)
    except FileExistsError as error:
        fail(f"KEY {error}", 2)
    except OSError as error:
        bad_file("KEY", key, f"cannot write in the folder {private.parent} ({error.strerror})")
    typer.echo(f"wrote {key} (keep it on the node) and {public} (register it with the SuperLink)")


@app.command("register")
def register(
    keys: Annotated[
        list[Path], typer.Argument(help="Public keys of the nodes to admit (KEY.pub files).")
    ],
    superlink: Annotated[str, typer.Option(help="The SuperLink's Control API, host:port.")],
    insecure: Insecure = False,
    root_certificates: RootCertificates = None,
) -> None:
    """Admit nodes to a SuperLink started with --enable-supernode-auth (`flwr supernode
    register`, once per key)."""
    for key in keys:
        if not key.is_file():
            fail(f"KEYS {key} is not a file; expected a node's KEY.pub (fedkit deploy keygen)", 2)
    with flower_home(superlink, insecure, root_certificates) as (env, _):
        flwr = tool("flwr")
        calls = [  # one Flower CLI process per key, all at once: each spends ~1.5 s starting
            subprocess.Popen([flwr, "supernode", "register", str(key.resolve()), "fedkit"], env=env)
            for key in keys
        ]
        codes = [(key, call.wait()) for key, call in zip(keys, calls, strict=True)]
        for key, code in codes:
            if code != 0:
                typer.echo(f"{key}: the SuperLink did not register it (flwr exit {code})", err=True)
        if any(code != 0 for _, code in codes):
            raise typer.Exit(1)


@contextlib.contextmanager
def flower_home(
    superlink: str, insecure: bool, root_certificates: Path | None
) -> Iterator[tuple[dict[str, str], Path]]:
    """An environment whose ``FLWR_HOME`` names one SuperLink connection, ``fedkit``, for
    Flower's CLI (``flwr run``, ``flwr supernode``), and a temporary folder beside it."""
    connection(insecure, root_certificates)  # one of the two is given, or a clear error
    connect: dict[str, object] = {"address": superlink}
    if insecure or root_certificates is None:
        connect["insecure"] = True
    else:
        connect["root-certificates"] = str(root_certificates.resolve())
    with tempfile.TemporaryDirectory(prefix="fedkit-flower-") as tmp:
        home = Path(tmp) / "home"
        home.mkdir()
        lines = ["[superlink]", 'default = "fedkit"', "[superlink.fedkit]"]
        lines += [f"{k} = {_toml(v)}" for k, v in connect.items()]
        (home / "config.toml").write_text("\n".join(lines) + "\n")
        yield {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0"}, Path(tmp)


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


CONNECTION = "fedkit"
"""The name of the one SuperLink connection in the Flower config ``flower_home`` writes."""

UNAVAILABLE = "SuperLink is unavailable"
"""What Flower's CLI says when it cannot connect to the SuperLink (1.42)."""

STARTED = re.compile(r"started run (\d+)")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
STATUS_TRIES, STATUS_PAUSE = 10, 1.0
"""Asks of ``flwr ls``, and seconds between them, for a run whose log stream ended before
the SuperLink recorded its end."""

RESUME_KEYS = ("federation.rounds", "evaluation.")
"""The ``--set`` keys a run that holds a checkpoint takes (``fedkit.core.runs.RESUME_KEYS``,
repeated here so that a failing ``deploy run`` need not import torch to say so)."""


@dataclass(frozen=True)
class Link:
    """How to reach a SuperLink: its address and TLS (or not)."""

    address: str
    insecure: bool
    root_certificates: Path | None

    def home(self) -> contextlib.AbstractContextManager[tuple[dict[str, str], Path]]:
        return flower_home(self.address, self.insecure, self.root_certificates)

    def fedkit(self, command: str, *args: object) -> str:
        """The ``fedkit deploy COMMAND ARGS`` line that reaches this SuperLink, to print."""
        if self.insecure or self.root_certificates is None:
            connect = ["--insecure"]
        else:
            connect = ["--root-certificates", str(self.root_certificates)]
        words = ["fedkit", "deploy", command, *map(str, args), "--superlink", self.address]
        return shlex.join([*words, *connect])


@dataclass
class Streamed:
    """What a Flower command printed, as far as fedkit reads it: the run id ``flwr run``
    names, the ServerApp's last ``fedkit: ...`` line (why the run failed), whether the run
    directory holds a checkpoint, and the last lines (for Flower's own errors)."""

    code: int | None = None
    run_id: int | None = None
    error: str | None = None
    checkpointed: bool = False
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=60))

    def note(self, raw: str) -> None:
        line = ANSI.sub("", raw).rstrip()
        self.tail.append(line)
        if self.run_id is None and (found := STARTED.search(line)):
            self.run_id = int(found.group(1))
        elif line.startswith("fedkit: "):
            self.error = line.removeprefix("fedkit: ").strip()
        elif line.startswith(CHECKPOINTED):
            self.checkpointed = True

    @property
    def unreachable(self) -> bool:
        return UNAVAILABLE in flat(self.tail)


@dataclass(frozen=True)
class RunStatus:
    """A run's status as ``flwr ls`` gives it (``finished:failed``, ...), or ``None`` and
    why it could not be read."""

    status: str | None
    details: str = ""
    error: str = ""


class Interrupted(Exception):
    """Ctrl-C (exit code 130) or SIGTERM (143) while a Flower command ran."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Ctrl-C and SIGTERM raise ``Interrupted`` inside (click would print "Aborted!")."""

    def handler(signum: int, frame: object) -> None:
        raise Interrupted(130 if signum == signal.SIGINT else 143)

    before = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, old in before.items():
            signal.signal(s, old)


def flat(lines: Iterable[str]) -> str:
    """Lines as one line: Flower's boxed errors without their frame, spaces collapsed."""
    return " ".join(" ".join(lines).replace("│", " ").split())


def flower_error(lines: Iterable[str]) -> str:
    """What Flower's CLI said went wrong: the text of its last "Error" box, else its last
    line."""
    text = list(lines)
    boxes = [i for i, line in enumerate(text) if "─ Error ─" in line]
    if boxes:
        return flat(line for line in text[boxes[-1] + 1 :] if not line.lstrip().startswith("╰"))
    return next((line.strip() for line in reversed(text) if line.strip()), "no output")


def follow(args: list[str], env: dict[str, str], seen: Streamed) -> None:
    """Run ``flwr ARGS``, show its output line by line as it comes, and note in ``seen``
    what it said. If interrupted, the Flower command is ended, never the run."""
    process = subprocess.Popen(
        [tool("flwr"), *args],
        env={**env, "PYTHONUNBUFFERED": "1"},  # its lines as they come, not in blocks
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    try:
        for line in process.stdout or ():
            typer.echo(line, nl=False)
            seen.note(line)
        seen.code = process.wait()
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.stdout is not None:
            process.stdout.close()


def flower(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    """``flwr ARGS``, its exit code and what it printed."""
    done = subprocess.run(
        [tool("flwr"), *args], env=env, capture_output=True, text=True, errors="replace"
    )
    return done.returncode, done.stdout + done.stderr


def json_answer(text: str) -> dict[str, Any] | None:
    """The JSON object Flower's ``--format json`` printed in ``text``, if any."""
    start = text.find("{")
    if start < 0:
        return None
    try:
        found, _ = json.JSONDecoder().raw_decode(text[start:])
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def read_status(text: str) -> RunStatus:
    """A run's status from ``flwr ls --run-id N --format json``'s output."""
    answer = json_answer(text)
    if answer is None:
        return RunStatus(None, error=flower_error(text.splitlines()))
    if not answer.get("success") or not answer.get("runs"):
        said = str(answer.get("error-message", "")).splitlines()
        return RunStatus(None, error=flat(said[-2:]) or "no run in the answer")
    run = answer["runs"][0]
    return RunStatus(str(run.get("status", "")), str(run.get("status-details", "")))


def final_status(seen: Streamed, env: dict[str, str]) -> RunStatus:
    """The run's status once its log stream ended. The stream ends as the run finishes,
    and the SuperLink may record the end a moment later: a run still "running" after a
    stream that ended cleanly is asked about again, for a few seconds."""
    args = ["ls", CONNECTION, "--run-id", str(seen.run_id), "--format", "json"]
    found = read_status(flower(args, env)[1])
    for _ in range(STATUS_TRIES - 1):
        if found.status is None or found.status.startswith("finished") or seen.code != 0:
            break
        time.sleep(STATUS_PAUSE)
        found = read_status(flower(args, env)[1])
    return found


def resumed(overrides: list[str], seen: Streamed) -> list[str]:
    """The ``--set`` options to run the same command again: all of them while the run
    directory holds no checkpoint (it starts afresh), else those a resume takes."""
    kept = [
        item
        for item in overrides
        if not seen.checkpointed
        or any(
            (key := item.split("=", 1)[0].strip()) == k or (k.endswith(".") and key.startswith(k))
            for k in RESUME_KEYS
        )
    ]
    return [word for item in kept for word in ("--set", item)]


def fail(message: str, code: int = 1) -> NoReturn:
    """One line on stderr, then exit ``code``."""
    typer.echo(f"fedkit: {message}", err=True)
    raise typer.Exit(code)


def interrupted(seen: Streamed, link: Link) -> str:
    """What an interrupted ``deploy run`` says: the run goes on, and how to watch and stop it."""
    if seen.run_id is None:
        return (
            "interrupted before the SuperLink named the run (it may have started); list "
            f"its runs: {link.fedkit('status')}"
        )
    return (
        f"stopped following run {seen.run_id}, which goes on at the SuperLink; watch it: "
        f"{link.fedkit('log', seen.run_id)}; stop it: {link.fedkit('stop', seen.run_id)}"
    )


def settle(seen: Streamed, status: RunStatus | None, link: Link, resume: str) -> None:
    """Return if the run finished; else exit 1 with one line saying what became of it."""
    if status is None:  # no run was started
        if seen.unreachable:
            fail(
                f"cannot reach the SuperLink at {link.address}: is it running, and is that "
                "the address of its API (--superlink)?"
            )
        fail(f"flwr run did not start the run (exit {seen.code}): {flower_error(seen.tail)}")
    run = f"run {seen.run_id}"
    if status.status == "finished:completed":
        return
    if status.status is None:
        if seen.unreachable or UNAVAILABLE in status.error:
            lost = f"lost the SuperLink at {link.address}"
        else:
            lost = f"could not read the status of {run} ({status.error})"
        fail(f"{lost}; how {run} ended is unknown ({link.fedkit('status', seen.run_id)}); {resume}")
    if status.status == "finished:failed":
        why = seen.error or status.details or "no reason given"
        fail(f"{run} failed: {why}; {resume}")
    if status.status == "finished:stopped":
        fail(f"{run} was stopped; {resume}")
    fail(
        f"{run} is {status.status} at the SuperLink, but its log stream ended "
        f"({flower_error(seen.tail)}); watch it: {link.fedkit('log', seen.run_id)}"
    )


def relay(args: list[str], superlink: str, insecure: bool, root_certificates: Path | None) -> None:
    """Run ``flwr ARGS`` against the SuperLink, showing its output; exit 1 with one line
    if it failed, 130/143 if interrupted."""
    link = Link(superlink, insecure, root_certificates)
    seen = Streamed()
    with link.home() as (env, _):
        try:
            with interruptible():
                follow(args, env, seen)
        except Interrupted as stop:
            raise typer.Exit(stop.code) from None
    answer = json_answer("\n".join(seen.tail)) if "--format" in args else None
    refused = answer is not None and answer.get("success") is False  # Flower exits 0 then
    if seen.code == 0 and not refused:
        return
    if seen.unreachable:
        fail(
            f"cannot reach the SuperLink at {link.address}: is it running, and is that its address?"
        )
    said = (
        flat(str(answer.get("error-message", "")).splitlines()[-2:])
        if refused and answer
        else flower_error(seen.tail)
    )
    fail(f"flwr {args[0]} failed: {said}")


@app.command("certs")
def certs(
    dir: Annotated[
        Path, typer.Argument(help="Folder to write ca.crt, ca.key, server.pem, server.key.")
    ],
    name: Annotated[
        list[str],
        typer.Option(
            "--name",
            help="An IP address or DNS name the nodes dial to reach the SuperLink (repeatable).",
        ),
    ],
    days: Annotated[int, typer.Option(min=1, help="How long the certificates are valid.")] = 365,
) -> None:
    """Make a CA and a SuperLink TLS certificate it signs for the given names."""
    from fedkit.flower.certificates import make_certificates

    if dir.expanduser().exists() and not dir.expanduser().is_dir():
        bad_file("DIR", dir, "is a file; expected a folder for the certificates (made if missing)")
    try:
        paths = make_certificates(dir.expanduser(), name, days)
    except FileExistsError as error:
        fail(f"DIR {error}", 2)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--name") from None
    except OSError as error:
        bad_file("DIR", dir, f"cannot write the certificates there ({error.strerror})")
    typer.echo(
        f"wrote {paths['server.pem']} and {paths['server.key']} (the SuperLink's), "
        f"{paths['ca.crt']} (hand it to every node and submitter: --root-certificates) and "
        f"{paths['ca.key']} (keep it private, off the SuperLink if you can)"
    )
