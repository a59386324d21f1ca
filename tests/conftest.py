"""Shared fixtures and helpers: tiny recipes on the embedded digits data (``fedkit.testing``,
the helpers plugin authors use too), spies on what crosses, fast enough for CI.

Every helper more than one test file uses lives here (test files import it with ``from
conftest import ...``); a test file never imports another test file
(tests/test_test_layout.py). Sections: session set-up, fixtures, preparing runs in
process, spying on them, recipes, running rounds and comparing states, processes (the
fedkit CLI, a Flower deployment, Ray look-alikes), a Flower node without a SuperLink, a
SuperLink and its nodes in one process."""

from __future__ import annotations

import colorsys
import importlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from fedkit import hookimpl
from fedkit.testing import Loaded, tiny_recipe  # noqa: F401 - the tests' tiny recipe

# Session set-up ------------------------------------------------------------------------

torch.set_num_threads(int(os.environ.get("FEDKIT_TEST_THREADS", "1")))
# Runs in tests skip the end-of-run report (a second or two each, matplotlib);
# tests/test_reports.py asks for it with --report.
os.environ["FEDKIT_REPORT"] = "0"
# The plugins listing's cache stays out of the user's home during tests.
os.environ.setdefault("FEDKIT_CACHE_DIR", tempfile.mkdtemp(prefix="fedkit-test-cache-"))
# Ray starts its worker processes at nice 15 (the raylet's worker_niceness). Beside the
# suite's other processes at nice 0 on 2 cores, they then get a few percent of a core, and a
# Ray test that takes 8 s alone takes minutes. At 0 they get their fair share. A Ray that
# fedkit starts for a run asks for 0 itself (decision 0028); this covers the Rays the tests
# start directly (the shared cluster, a foreign head), in process or in a subprocess. The
# numbers a run gives do not depend on it.
os.environ.setdefault("RAY_worker_niceness", "0")

# The files that take minutes, longest first (`make test` prints the slowest tests). The
# Makefile hands whole files to its workers in collection order (--no-loadscope-reorder),
# so starting these first keeps one long file from running alone at the end.
SLOWEST_FIRST = (
    "test_deployment.py",
    "test_chaos_soak.py",
    "test_foreign_ray.py",
    "test_flower.py",
    "test_ray_faults.py",
    "test_packaging.py",
    "test_sweep.py",
    "test_executors.py",
    "test_node_restarts.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# Fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_cluster():
    """A small local Ray cluster for one test module (2 CPUs, no dashboard), shut down after."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def write_recipe(tmp_path: Path):
    """Write a recipe (a mapping, YAML text or raw bytes) to a file and return its path."""

    def write(raw: Any, name: str = "recipe.yaml") -> Path:
        path = tmp_path / name
        if isinstance(raw, bytes):
            path.write_bytes(raw)
        else:
            path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
        return path

    return write


def install_plugins(root: Path, sources: dict[str, str], dist: str = "{name}") -> Path:
    """Each ``{name: source}`` as its own installed distribution under ``root`` (a module
    and its ``.dist-info`` with a ``fedkit`` entry point to the source's one class), as
    ``pip install`` leaves them; ``dist`` formats the distribution's name."""
    root.mkdir(parents=True, exist_ok=True)
    for name, source in sources.items():
        source = textwrap.dedent(source)
        (root / f"{name}_plugin.py").write_text(source)
        info = root / f"{name}_plugin-0.1.dist-info"
        info.mkdir()
        meta = f"Metadata-Version: 2.1\nName: {dist.format(name=name)}\nVersion: 0.1\n"
        (info / "METADATA").write_text(meta)
        (cls,) = re.findall(r"^class (\w+)", source, flags=re.M)
        (info / "entry_points.txt").write_text(f"[fedkit]\n{name} = {name}_plugin:{cls}\n")
    return root


# Preparing runs in process -------------------------------------------------------------

LoadedEntryPoint = Loaded


def tensor_bytes(tensors) -> int:
    """Bytes the tensors take (what the ledger books for them)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def activate(raw: dict[str, Any], **extra: Any):
    """Validate a raw recipe and activate its plugins, with extra in-test plugins."""
    from fedkit.config.schema import validate
    from fedkit.plugin.manager import Plugins
    from fedkit.plugin.registry import discover

    recipe = validate(raw)
    available = {**discover(), **{k: LoadedEntryPoint(v) for k, v in extra.items()}}
    return recipe, Plugins(recipe, available)


def prepared(raw: dict[str, Any], **extra: Any):
    """A prepared ``Run`` (no run directory) for a raw recipe and in-test plugins."""
    from fedkit.core.engine import prepare

    recipe, plugins = activate(raw, **extra)
    return prepare(recipe, plugins)


def kept_model(run, cid: int) -> dict[str, Any] | None:
    """The model keys client ``cid`` keeps between rounds (its private keys and those
    plugins declare in ``kept_keys``) as of its last round; ``None`` before its first.
    For the full state a client trained to, use ``Spy.trained``."""
    memory = run.executor.memory(cid)
    return None if memory is None else memory.model


def client_context(
    raw: dict[str, Any],
    *,
    id: int = 7,
    train: Any = None,
    participations: int = 0,
    state: dict[str, Any] | None = None,
    tensors: dict[str, Any] | None = None,
    received: dict[str, Any] | None = None,
    round: int = 1,
):
    """A real ``ClientContext`` for calling client-side hooks directly in unit tests.

    ``train`` defaults to an empty image set (mean 0, std 1); the context has no cluster
    models to fetch and no plugins (``ctx.fit`` runs only the objective); ``ctx.lr`` is
    the round's rate as the engine would send it."""
    from fedkit.config.schema import validate
    from fedkit.data.datasets import ImageSet
    from fedkit.plugin.context import ClientContext, ModelKeys
    from fedkit.training.optim import round_lr

    if train is None:
        images = torch.zeros(0, 3, 1, 1, dtype=torch.uint8)
        train = ImageSet(images, torch.zeros(0, dtype=torch.long), [], (0.0,) * 3, (1.0,) * 3)
    return ClientContext(
        id,
        train,
        train,
        state=dict(state or {}),
        tensors=dict(tensors or {}),
        participations=participations,
        recipe=(recipe := validate(raw)),
        round=round,
        lr=round_lr(recipe.federation, round),
        device=torch.device("cpu"),
        rng=torch.Generator().manual_seed(0),
        keys=ModelKeys(frozenset(), frozenset(), frozenset()),
        received=received,
    )


def logged(ctx) -> dict[str, Any]:
    """What client-side hooks reported through ``ctx.log`` (the client's metrics)."""
    return ctx.logged


# Spying on what crosses ----------------------------------------------------------------


class Spy:
    """Records, per (round, client), the state local training starts from, what the
    server sent and the full state local training ended at; per round, the uploads the
    server aggregated. Trains nothing.

    ``local_train`` runs on the client side (it reads ``ctx.received``) and returns
    ``None`` so that the method's own training still runs; ``after_local_train`` also
    runs on the client side and reports no metric; ``aggregate`` runs on the server side
    and claims nothing."""

    def __init__(self) -> None:
        self.loaded: dict[tuple[int, int], dict[str, Any]] = {}
        self.received: dict[tuple[int, int], dict[str, Any]] = {}
        self.trained: dict[tuple[int, int], dict[str, Any]] = {}
        self.uploads: dict[int, list] = {}

    @hookimpl
    def local_train(self, ctx, model):
        key = (ctx.round, ctx.id)
        self.loaded[key] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.received[key] = dict(ctx.received)

    @hookimpl
    def after_local_train(self, ctx, model, before):
        key = (ctx.round, ctx.id)
        self.trained[key] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    @hookimpl
    def aggregate(self, server, cluster, uploads):
        self.uploads[server.round] = uploads


def attach_spy(run) -> Spy:
    """Register a ``Spy`` next to a prepared run's plugins, on both sides: the server's
    plugin manager (``aggregate``) and the worker's (``local_train``)."""
    spy = Spy()
    run.plugins.add(spy, "spy")
    run.executor.worker.plugins.add(spy, "spy")
    return spy


def spied(raw: dict[str, Any], **extra: Any):
    """A prepared run with a ``Spy`` registered next to its plugins."""
    run = prepared(raw, **extra)
    return run, attach_spy(run)


# Recipes the tests of several files share --------------------------------------------

SSL_HEADS = {"projector_hidden": 16, "projection_dim": 8, "predictor_hidden": 16}


def ssl_recipe(*plugins, rounds: int = 2, **sections):
    """A tiny SSL recipe: 3 clients on 120 digits images at 16×16, small heads."""
    specs = []
    for p in plugins:
        name, options = (p, {}) if isinstance(p, str) else p
        if name in ("fedbyol", "fedu", "fedsimsiam", "fedsimclr"):
            options = {**SSL_HEADS, **options}
        specs.append({name: options})
    raw = tiny_recipe(
        data={"max_train": 120, "partition": {"name": "classes_per_client", "k": 4}},
        federation={"rounds": rounds, "batch_size": 16, "optimizer": {"name": "sgd", "lr": 0.05}},
        plugins=specs,
        evaluation={"protocol": "none", "every": 0},
    )
    for name, value in sections.items():
        raw[name] = {**raw[name], **value}
    return raw


SGD = {"optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.0}}


def supervised_recipe(*plugins):
    """A tiny fedavg recipe with plain SGD, ``plugins`` added after fedavg."""
    return tiny_recipe(plugins=["fedavg", *plugins], federation=SGD)


def fedca_recipe():
    """A tiny FedCA recipe (it needs a server split for its base encoder)."""
    opts = {"projector_hidden": 16, "projection_dim": 8, "base": {"epochs": 1, "batch_size": 16}}
    raw = ssl_recipe(("fedca", opts))
    raw["data"]["server_fraction"] = 0.2
    return raw


def clustered_recipe(plugin: dict[str, Any]):
    """A tiny recipe for a clustered method: 4 clients and a server split."""
    return tiny_recipe(plugins=[plugin], data={"num_clients": 4, "server_fraction": 0.2})


# Every built-in plugin in the combinations the contract tests (and Flower's) run.
COMBOS = {
    "fedavg": supervised_recipe(),
    "fedprox": supervised_recipe({"fedprox": {"mu": 0.1}}),
    "scaffold": supervised_recipe("scaffold"),
    "fednova": supervised_recipe("fednova"),
    "fedbn": supervised_recipe("fedbn"),
    "ditto": supervised_recipe({"ditto": {"lam": 0.1}}),
    "fedrep": tiny_recipe(plugins=[{"fedrep": {"head_epochs": 1}}], federation=SGD),
    "fedbabu": tiny_recipe(plugins=[{"fedbabu": {"finetune_epochs": 1}}], federation=SGD),
    "finetune": supervised_recipe({"finetune": {"epochs": 1}}),
    "dp": supervised_recipe({"dp": {"clip": 1.0, "noise_multiplier": 0.5}}),
    "dpsgd": tiny_recipe(  # opacus has no per-sample gradients through test_resnet's BatchNorm
        plugins=["fedavg", {"dpsgd": {"max_grad_norm": 1.0, "noise_multiplier": 0.5}}],
        backbone={"name": "niid_bench_cnn", "kwargs": {"image_size": 16}},
        federation=SGD,
    ),
    "fedopt": supervised_recipe({"fedopt": {"optimizer": "adam"}}),
    "backdoor": supervised_recipe({"backdoor": {"fraction": 0.34, "seed": 1}}),
    "tensorboard": supervised_recipe({"tensorboard": {"logdir": "TMP"}}),
    "mlflow": supervised_recipe({"mlflow": {"tracking_uri": "TMP"}}),
    "fedbyol+dapu": ssl_recipe("fedbyol", ("dapu", {"mu": 0.05})),
    "fedu+dapu": ssl_recipe(("fedu", {"upload": "target"}), ("dapu", {"mu": 0.05})),
    "fedsimsiam": ssl_recipe("fedsimsiam"),
    "fedsimclr": ssl_recipe("fedsimclr"),
    "fedbyol+fedema": ssl_recipe("fedbyol", "fedema"),
    "fedbyol+single_client": ssl_recipe("fedbyol", "single_client"),
    "fedca": fedca_recipe(),
    "ifca": clustered_recipe({"ifca": {"num_clusters": 2, "random_rounds": 1}}),
    "cpcfl": clustered_recipe(
        {
            "cpcfl": {
                "num_clusters": 2,
                "switch_round": 1,
                "pretrain": {"epochs": 1, "batch_size": 32},
            }
        }
    ),
}


def with_logdir(raw: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """The recipe with an observer's ``TMP`` output directory placed under ``tmp_path``."""

    def place(spec: Any) -> Any:
        if not isinstance(spec, dict):
            return spec
        placed = {}
        for name, options in spec.items():
            if options.get("logdir") == "TMP":
                options = {**options, "logdir": str(tmp_path / "tb")}
            if options.get("tracking_uri") == "TMP":
                options = {**options, "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
            placed[name] = options
        return placed

    return {**raw, "plugins": [place(spec) for spec in raw["plugins"]]}


def make_blobs(root: Path, per_class: tuple[int, int] = (80, 30), size: int = 8) -> Path:
    """An ImageFolder of 10 easy classes: class c has hue c/10 and stripes of phase c."""
    rng = np.random.default_rng(0)
    rows = np.arange(size)[:, None]
    for split, n in zip(("train", "test"), per_class, strict=True):
        for c in range(10):
            folder = root / split / f"c{c}"
            folder.mkdir(parents=True, exist_ok=True)
            rgb = np.array(colorsys.hsv_to_rgb(c / 10, 0.9, 0.9)) * 255
            stripes = (0.6 + 0.4 * ((rows + c) % 2))[..., None]
            for i in range(n):
                img = np.tile(rgb, (size, size, 1)) * stripes + rng.normal(0, 20, (size, size, 3))
                Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(folder / f"{i}.png")
    return root


def blobs_recipe(root: Path, plugin: dict[str, Any], **changes: Any):
    """A 9-client, 3-group recipe on the ``make_blobs`` data; ``changes`` as dotted keys."""
    from fedkit.config.schema import validate

    raw: dict[str, Any] = {
        "seed": 0,
        "backbone": {"name": "test_resnet"},
        "data": {
            "dataset": "imagefolder",
            "root": str(root),
            "image_size": 8,
            "num_clients": 9,
            "server_fraction": 0.3,
            "partition": {
                "name": "cluster_groups",
                "num_groups": 3,
                "classes_per_group": 4,
                "per_class": [10, 10, 4, 4],
                "overlap": 1,
            },
            "local_test_size": 20,
        },
        "federation": {
            "rounds": 13,
            "clients_per_round": 9,
            "local_epochs": 3,
            "batch_size": 32,
            "optimizer": {"name": "adam", "lr": 0.01},
        },
        "plugins": [plugin],
        "evaluation": {"protocol": "supervised", "every": 1},
        "device": "cpu",
    }
    for key, value in changes.items():
        node = raw
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    return validate(raw)


def write_images(folder: Path, counts: dict[str, int], seed: int = 0) -> None:
    """A site's ImageFolder: ``counts[name]`` random 20×20 PNGs under ``folder/name``."""
    rng = np.random.default_rng(seed)
    for name, count in counts.items():
        (folder / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            pixels = rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / name / f"{i:03d}.png")


SSL_TUTORIAL_TINY = [
    "data.dataset=digits",
    "data.image_size=16",
    "data.max_train=120",
    "data.max_test=60",
    "data.num_clients=3",
    "federation.clients_per_round=3",
    "federation.rounds=1",
    "federation.local_epochs=1",
    "federation.batch_size=16",
    "backbone.name=test_resnet",
    "backbone.cifar_stem=false",
    "evaluation.linear_epochs=10",
    "evaluation.every=0",
    "device=cpu",
]
SSL_TUTORIAL_TINY_EVAL = [
    "evaluation.linear_epochs=10",
    "evaluation.semi_epochs=1",
    "evaluation.max_eval=60",
]


def shrunk_ssl(args: list[str]) -> list[str]:
    """An SSL tutorial's ``fedkit`` command with tiny ``--set`` overrides appended: digits
    instead of CIFAR-10 (never downloaded here), one round, small batches, short probes."""
    from tutorials import with_settings

    settings = {"run": SSL_TUTORIAL_TINY, "validate": SSL_TUTORIAL_TINY}
    settings["eval"] = SSL_TUTORIAL_TINY_EVAL
    return with_settings(args, settings.get(args[0], []))


# Running rounds in process and comparing states -----------------------------------------


def run_rounds(run, n):
    """The metrics rows of rounds 1..n of a prepared run."""
    from fedkit.core.engine import run_round

    return [run_round(run, r) for r in range(1, n + 1)]


def run_all(raw, executor: str):
    """Every round of ``raw`` on ``executor`` (2 workers): the rows and the final pool."""
    from fedkit.config.schema import validate
    from fedkit.core.engine import prepare, run_round

    raw = {**raw, "engine": {**raw.get("engine", {}), "executor": executor, "workers": 2}}
    run = prepare(validate(raw))
    try:
        rows = [run_round(run, r) for r in range(1, run.recipe.federation.rounds + 1)]
        return rows, [dict(s) for s in run.server.pool]
    finally:
        run.close()


def same_keys(a: dict, b: dict, keys) -> bool:
    """Whether two states hold equal tensors under ``keys``."""
    return all(torch.equal(a[k], b[k]) for k in keys)


def keys_under(state: dict, prefix: str) -> list[str]:
    """The keys of ``state`` that start with ``prefix`` (one part of a model)."""
    return [k for k in state if k.startswith(prefix)]


def same_pools(a, b) -> bool:
    """Whether two pools (lists of states) hold the same keys and equal tensors."""
    return all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        for x, y in zip(a, b, strict=True)
    )


# Processes: the fedkit CLI, a Flower deployment, Ray look-alikes ------------------------


def run_fedkit(*args, wait=True):
    """``python -m fedkit ARGS`` at one torch thread: its completed result, or (``wait``
    false) the running process, its output discarded."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fedkit", *args]
    if wait:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def checkpoint_round(out):
    """The round of the latest checkpoint in run directory ``out`` (0 before the first)."""
    pointer = out / "checkpoints" / "latest.json"
    try:
        return json.loads(pointer.read_text())["round"]
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def kill_after_checkpoint(path, out, round: int) -> int:
    """Start ``fedkit run`` on ``path``, SIGKILL it once its checkpoint reached ``round``;
    the checkpointed round it stopped at."""
    proc = run_fedkit("run", str(path), "--out", str(out), wait=False)
    deadline = time.monotonic() + 240
    while checkpoint_round(out) < round:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return checkpoint_round(out)


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_script(name: str) -> Any:
    """The module of ``benchmarks/NAME.py`` (a script folder, not a package), imported
    without leaving benchmarks/ on ``sys.path``."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_process(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """``command`` in a session (and process group) of its own, its output in ``log``."""
    return subprocess.Popen(
        command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def stop_processes(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to every process group at once, then wait for each (SIGKILL after 20 s)."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        os.killpg(proc.pid, signal.SIGTERM)
    for proc in running:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def certificates(folder: Path) -> dict[str, Path]:
    """A throwaway CA and a server certificate it signs for 127.0.0.1 (PEM files)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def certificate(name, key, issuer, issuer_key, ca):
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer or subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return builder.sign(issuer_key or key, hashes.SHA256())

    ca_key, server_key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    ca = certificate("fedkit test CA", ca_key, None, None, True)
    server = certificate("127.0.0.1", server_key, ca.subject, ca_key, False)
    paths = {"ca": folder / "ca.crt", "cert": folder / "server.pem", "key": folder / "server.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(
        server_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths


def assert_all_end(driver: subprocess.Popen, processes: list) -> None:
    """The driver ended, and every one of ``processes`` within 15 s of it."""
    from fedkit.core.ray_reaper import _psutil

    driver.wait(timeout=10)
    _, alive = _psutil().wait_procs(processes, timeout=15)
    assert alive == [], alive


def raylet_driver(raylet: Path, *args: str) -> tuple[subprocess.Popen, list]:
    """A driver that starts the reaper and ``raylet`` (with ``args``), waits until the
    reaper has noted it, tells it to start its worker, and dies by SIGKILL; the driver,
    and the reaper, raylet and worker as psutil processes."""
    from fedkit.core.ray_reaper import _psutil

    script = textwrap.dedent(f"""
        import os, signal, subprocess, sys, time
        from fedkit.core import ray_reaper
        reaper = ray_reaper.watch()
        raylet = subprocess.Popen([sys.executable, {str(raylet)!r}, *{list(args)!r}],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        time.sleep(1.5)  # the reaper has noted the raylet
        print("go", file=raylet.stdin, flush=True)
        worker = raylet.stdout.readline().strip()
        print(reaper.pid, raylet.pid, worker, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    psutil = _psutil()
    return driver, [psutil.Process(int(p)) for p in driver.stdout.readline().split()]


# A Flower node's side without a SuperLink (the flower extra) -----------------------------


class Fleet:
    """Flower's Fleet connection as ``fedkit.flower.runner.serve`` uses it, without a
    SuperLink: ``inbox`` holds (run id, message) pairs to hand out, each as Flower sends
    one (a shell and its object tree; the objects on request), and what the node sends
    back is kept, and ``replies`` inflates it. Run ``gone`` is no longer running."""

    def __init__(self, inbox, gone=None):
        self.inbox, self.gone, self.objects, self.confirmed = inbox, gone, {}, []
        self.trees: list = []
        self.pushed: dict[str, bytes] = {}

    def connect(self, superlink, insecure, certificates, keys):
        import contextlib

        from flwr.supercore.inflatable.inflatable_object import (
            get_all_nested_objects,
            get_object_tree,
            iterate_object_tree,
        )
        from flwr.supercore.run import RunNotRunningException

        def receive():
            if not self.inbox:
                return None
            message = self.inbox.pop(0)
            message.metadata.__dict__["_message_id"] = message.object_id
            tree = get_object_tree(message)
            self.objects |= {k: v.deflate() for k, v in get_all_nested_objects(message).items()}
            return message, tree

        def get_run(run_id):
            if run_id == self.gone:
                raise RunNotRunningException
            return type("Run", (), {"series_id": f"series-{run_id}"})()

        def send(reply, tree, seconds):
            self.trees.append(tree)
            return {t.object_id for t in iterate_object_tree(tree)}, "session"

        def push_object(run_id, session, key, content):
            self.pushed[key] = content

        @contextlib.contextmanager
        def connection():
            yield (
                42, receive, send, get_run, None,
                lambda run_id, key: self.objects[key],
                push_object,
                lambda run_id, key: self.confirmed.append(key),
            )  # fmt: skip

        return connection()

    def replies(self):
        """The messages the node sent, rebuilt from the objects it pushed."""
        from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

        return [
            inflate_object_from_contents(t.object_id, dict(self.pushed), keep_object_contents=True)
            for t in self.trees
        ]


def incoming(run_id: int, kind: str, value: int):
    """A message of type ``kind`` for run ``run_id`` that the SuperLink hands node 42."""
    from flwr.app import ConfigRecord, Message, Metadata, RecordDict

    meta = Metadata(
        run_id=run_id, message_id="", src_node_id=1, dst_node_id=42, reply_to_message_id="",
        group_id="1", created_at=time.time(), ttl=3600, message_type=kind,
    )  # fmt: skip
    return Message(RecordDict({"in": ConfigRecord({"value": value})}), metadata=meta)


def setup_message(run, token: str):
    """The ``setup`` query the server sends a node at a run's start."""
    from fedkit.flower.flower_executor import setup_content

    return setup_content(run.executor.setup, run.executor, None, token)


# A SuperLink and its nodes in one process (the flower extra) ------------------------------


UNAVAILABLE = "Error: Node Unavailable - the destination node failed to report a heartbeat"
"""The SuperLink's reason when it answers for a node that stopped sending heartbeats."""


class NodeGrid:
    """Flower's grid without Flower's runtime: a SuperLink and its nodes in one process.
    A node answers a message when it is pulled, as a Flower node answers it
    (``fedkit.flower.runner.answer``: SecAgg+'s stages first, then its ``NodeHost``, with
    the node's own ``Context.state``). Each message is copied on push, as Flower
    serialises it (SecAgg+'s workflow hands every node one content object, which Flower's
    client mod edits). Node ids count from 100 in the order nodes start (``start``), so
    node ``100 + p`` holds client ``p`` until a node restarts.

    Without ``root`` all nodes share one ``NodeHost``, as in Flower's simulation; with it
    each node has its own resident one on ``root/<folder>/memories`` (``node<partition>``
    unless ``start`` names another), as ``fedkit deploy node`` has. Failures: a ``dead``
    node gets the SuperLink's "node unavailable" reply (from node id 1, as Flower sends
    it); a node in ``leave`` dies at SecAgg+'s masked-vector stage, after it shared its
    keys; ``raising`` holds (node, round) pairs where the node answers that round's
    messages with an error. ``trained`` lists (node, client) for every train job sent."""

    def __init__(self, partitions: int, root: Path | None = None) -> None:
        from fedkit.flower.node import NodeHost

        self.root, self.queue, self.next = root, {}, 100
        self.shared = NodeHost() if root is None else None
        self.hosts: dict[int, tuple[Any, Any, int]] = {}  # node → NodeHost, state, partition
        self.dead: set[int] = set()
        self.leave: set[int] = set()
        self.raising: set[tuple[int, int]] = set()
        self.trained: list[tuple[int, int]] = []
        for partition in range(partitions):
            self.start(partition)

    def start(self, partition: int, node: int | None = None, folder: str = "") -> int:
        """A node process for ``partition`` (a new one, as after a restart): a new node id
        unless ``node`` keeps one, an empty state, memories on ``root/<folder>``."""
        from flwr.app import RecordDict

        from fedkit.flower.node import NodeHost

        if node is None:
            node, self.next = self.next, self.next + 1
        host = self.shared
        if self.root is not None:
            host = NodeHost(self.root / (folder or f"node{partition}") / "memories", resident=True)
        self.hosts[node] = (host, RecordDict(), partition)
        self.dead.discard(node)
        return node

    def node_of(self, partition: int) -> int:
        """The newest node holding ``partition``."""
        return max(n for n, (_, _, p) in self.hosts.items() if p == partition)

    def get_node_ids(self) -> list[int]:
        return sorted(self.hosts)

    def push_messages(self, messages: list) -> list[str]:
        import copy
        import uuid

        from fedkit.flower.records import get_meta
        from fedkit.flower.secagg import CONFIGS

        for m in messages:
            m.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            self.queue[m.metadata.message_id] = copy.deepcopy(m)
            if m.metadata.message_type == "train" and CONFIGS not in m.content:
                self.trained.append((m.metadata.dst_node_id, get_meta(m.content)["client"]))
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, ids: list[str]) -> list:
        return [self.reply(self.queue.pop(mid)) for mid in ids if mid in self.queue]

    def reply(self, m: Any) -> Any:
        """The answer to ``m``: its node's, or the SuperLink's for a dead node."""
        from flwr.app import Error, Message, Metadata
        from flwr.common.constant import ErrorCode

        from fedkit.flower import internals
        from fedkit.flower.records import get_meta
        from fedkit.flower.runner import answer
        from fedkit.flower.secagg import CONFIGS

        node, content = m.metadata.dst_node_id, m.content
        stage = content[CONFIGS]["stage"] if CONFIGS in content else None
        if node in self.leave and stage == "collect_masked_vectors":
            self.dead.add(node)
        if node in self.dead:
            meta = Metadata(
                run_id=m.metadata.run_id, message_id="", src_node_id=1, dst_node_id=1,
                reply_to_message_id=m.metadata.message_id, group_id="",
                created_at=time.time(), ttl=0, message_type=m.metadata.message_type,
            )  # fmt: skip
            return Message(metadata=meta, error=Error(ErrorCode.NODE_UNAVAILABLE, UNAVAILABLE))
        at_round = get_meta(content).get("round") if stage is None and self.raising else None
        if (node, at_round) in self.raising:
            return internals.error_reply(m, "ValueError: the client raised on purpose")
        host, state, partition = self.hosts[node]
        return answer(host, m, state, partition)


class GridLink:
    """The ``flower`` executor's link to a ``NodeGrid`` as to a deployment's SuperLink
    (``remote``: the nodes keep their clients' memories)."""

    remote = True

    def __init__(self, grid: NodeGrid) -> None:
        self.grid = grid

    def close(self) -> None: ...


def on_grid(grid: NodeGrid) -> Any:
    """The ``flower`` executor on ``grid``'s nodes (handed to the engine as a value)."""
    from functools import partial

    from fedkit.flower.flower_executor import FlowerExecutor

    return partial(FlowerExecutor, link=GridLink(grid))


def server_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Messages made here are the ServerApp's (Flower's task identity)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", 7), ("_node_id", 1), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)


def flower_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs with ``engine.executor: flower`` (``fedkit run`` too) reach a ``NodeGrid``
    instead of starting Flower's simulation runtime (Ray), and the messages made here are
    the ServerApp's (Flower's task identity): the same nodes and messages, without Ray's
    start-up."""
    import logging

    server_identity(monkeypatch)
    monkeypatch.setattr(logging.getLogger("flwr"), "level", logging.ERROR)  # as the simulation

    class Link:
        remote = False

        def __init__(self, nodes: int, engine: Any) -> None:
            self.grid = NodeGrid(nodes)

        def close(self) -> None: ...

    monkeypatch.setattr("fedkit.flower.flower_executor.SimulationLink", Link)
