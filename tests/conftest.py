"""Shared fixtures: tiny recipes on the embedded digits data (``fedkit.testing``, the
helpers plugin authors use too), spies on what crosses, fast enough for CI."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from fedkit import hookimpl
from fedkit.testing import Loaded, tiny_recipe  # noqa: F401 - the tests' tiny recipe

torch.set_num_threads(int(os.environ.get("FEDKIT_TEST_THREADS", "1")))
# Runs in tests skip the end-of-run report (a second or two each, matplotlib);
# tests/test_reports.py asks for it with --report.
os.environ["FEDKIT_REPORT"] = "0"
# The plugins listing's cache stays out of the user's home during tests.
os.environ.setdefault("FEDKIT_CACHE_DIR", tempfile.mkdtemp(prefix="fedkit-test-cache-"))

# The files that take minutes, longest first (`make test` prints the slowest tests). The
# Makefile hands whole files to its workers in collection order (--no-loadscope-reorder),
# so starting these first keeps one long file from running alone at the end.
SLOWEST_FIRST = (
    "test_foreign_ray.py",
    "test_deployment.py",
    "test_flower.py",
    "test_ray_faults.py",
    "test_packaging.py",
    "test_chaos_soak.py",
    "test_executors.py",
    "test_sweep.py",
    "test_node_restarts.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


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
    models to fetch and no plugins (``ctx.fit`` runs only the objective)."""
    from fedkit.config.schema import validate
    from fedkit.data.datasets import ImageSet
    from fedkit.plugin.context import ClientContext, ModelKeys

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
        recipe=validate(raw),
        round=round,
        device=torch.device("cpu"),
        rng=torch.Generator().manual_seed(0),
        keys=ModelKeys(frozenset(), frozenset(), frozenset()),
        received=received,
    )


def logged(ctx) -> dict[str, Any]:
    """What client-side hooks reported through ``ctx.log`` (the client's metrics)."""
    return ctx.logged


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
