"""``fedkit deploy``: a recipe on a real Flower federation.

``node`` starts one site: one process that is the site's Flower node and runs its
fedkit client (``fedkit.flower.runner``). ``app``
writes the Flower app (a ``pyproject.toml`` naming fedkit's ServerApp and ClientApp) and
``run`` submits a recipe to a SuperLink with ``flwr run``. docs/deploy.md walks through it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

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


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def connection(insecure: bool, root_certificates: Path | None) -> list[str]:
    if insecure:
        return ["--insecure"]
    if root_certificates is None:
        raise typer.BadParameter(
            "give --root-certificates CA.pem (TLS), or --insecure on a trusted network"
        )
    return ["--root-certificates", str(root_certificates)]


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
) -> None:
    """Start one site: a Flower node, in one process with the fedkit client it holds."""
    tool("flower-supernode")  # the flower extra is installed, or a clear error
    from fedkit.flower.node_keys import load_key_pair
    from fedkit.flower.runner import serve

    connection(insecure, root_certificates)  # one of the two is given, or a clear error
    folder = dir.expanduser().resolve()
    site = data.expanduser().resolve() if data is not None else None
    if site is not None and not site.is_dir():
        raise typer.BadParameter(f"{data} is not a directory of class folders", param_hint="--data")
    allowed = allowed_plugins(allow)
    certificates = None
    if not insecure and root_certificates is not None:
        certificates = readable(root_certificates, "--root-certificates")
    keys = None
    if auth_key is not None:
        try:
            keys = load_key_pair(auth_key.expanduser())
        except ValueError as error:
            raise typer.BadParameter(str(error), param_hint="--auth-key") from None
    folder.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)  # leaves the SuperLink (deactivates this node) on the way out

    def connected(node_id: int) -> None:
        typer.echo(f"node {node_id} joined {superlink}, holding client {partition}")

    signal.signal(signal.SIGTERM, stop)
    try:
        serve(
            superlink, partition, folder, certificates=certificates, keys=keys, site=site,
            allow=allowed, poll=poll, connected=connected,
        )  # fmt: skip
    except KeyboardInterrupt:
        pass
    except SystemExit as done:
        if done.code:  # e.g. a SuperLink that requires node authentication refused this node
            typer.echo("the node stopped: the SuperLink did not admit it (Flower's reason above)")
            raise typer.Exit(1) from None


def allowed_plugins(allow: str | None) -> frozenset[str] | None:
    """``--allow``'s plugin names, each installed here, or a clear error naming it."""
    if allow is None:
        return None
    from fedkit.plugin.entrypoints import discover

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
    """The bytes of the file an option names, or a clear error naming the option."""
    try:
        return path.expanduser().read_bytes()
    except OSError as error:
        raise typer.BadParameter(f"{path}: {error.strerror}", param_hint=option) from None


@app.command("app")
def write_app(
    dir: Annotated[Path, typer.Argument(help="Folder to write the Flower app into.")],
) -> None:
    """Write the Flower app that runs fedkit recipes (for `flwr run DIR ...`)."""
    dir.mkdir(parents=True, exist_ok=True)
    (dir / "pyproject.toml").write_text(PYPROJECT)
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
    """Submit a recipe to a SuperLink (`flwr run`) and stream its log until it ends."""
    import tomli_w  # Flower's own dependency: the flower extra is installed

    from fedkit.config.schema import load_recipe
    from fedkit.config.shipped import resolve
    from fedkit.errors import FedkitError
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
        raise typer.BadParameter(str(error), param_hint="RECIPE") from None
    with flower_home(superlink, insecure, root_certificates) as (env, tmp):
        app_dir = tmp / "app"
        write_app(app_dir)
        values = {"recipe": text, "out": out.strip(), "set": ";".join(overrides)}
        config = tmp / "run-config.toml"  # a file: the recipe's text spans lines
        config.write_text(tomli_w.dumps(values))
        command = [
            tool("flwr"), "run", str(app_dir), "fedkit", "--stream", "--run-config", str(config),
        ]  # fmt: skip
        raise typer.Exit(subprocess.call(command, env=env))


@app.command("keygen")
def keygen(
    key: Annotated[
        Path,
        typer.Argument(help="Where to write the node's private key (its public key: KEY.pub)."),
    ],
) -> None:
    """Make a node's key pair for SuperLink node authentication (P-384, OpenSSH format)."""
    tool("flower-supernode")  # the flower extra (and its cryptography) is installed
    from fedkit.flower.node_keys import make_key_pair

    try:
        public = make_key_pair(key.expanduser())
    except (FileExistsError, FileNotFoundError) as error:
        raise typer.BadParameter(str(error), param_hint="KEY") from None
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
            raise typer.BadParameter(f"{key} is not a file", param_hint="KEYS")
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
