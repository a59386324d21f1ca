"""The server holds only what a real server holds.

An observer plugin implements every server-side hook and, in each, walks every object
reachable from what the hook receives (its arguments and the plugin itself), following
references the way the garbage collector sees them. On the quickstart, no walk reaches a
client's training image, an image set other than the server's own split, or the
federated data set, and the server has no attribute that leads to them.
"""

from __future__ import annotations

import gc
import hashlib
import types
from typing import Any

import pytest
import torch

from fedkit import hookimpl
from fedkit.data.datasets import ImageSet
from fedkit.data.federated import ClientData, FederatedData
from fedkit.plugin.registry import hook_names, hook_side
from fedkit.plugin.server import Server
from fedkit.testing import run_recipe

SKIPPED = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.CodeType)


def reachable(*roots: Any) -> list[Any]:
    """Every object reachable from ``roots`` through ``gc.get_referents``, without going
    into modules, classes or functions' code and globals (shared by every run in the
    process, not handed over by a hook)."""
    seen: dict[int, Any] = {}
    todo = list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, SKIPPED):
            continue
        seen[id(obj)] = obj
        todo.extend(gc.get_referents(obj))
        if isinstance(obj, torch.Tensor) and obj.grad is not None:
            todo.append(obj.grad)
    return list(seen.values())


def image_hashes(images: torch.Tensor) -> set[bytes]:
    return {hashlib.sha1(image.contiguous().numpy().tobytes()).digest() for image in images}


class Walker:
    """Implements every server-side hook but the two firstresult ones it would shadow
    (``init_models``, ``sample_clients``); each call walks what it receives."""

    walks: list[tuple[str, list[Any]]] = []  # the test reads them (a test-only global)

    def _walk(self, hook: str, *received: Any) -> None:
        Walker.walks.append((hook, reachable(self, *received)))

    @hookimpl
    def configure(self, server):
        self._walk("configure", server)

    @hookimpl
    def private_keys(self, server, model):
        self._walk("private_keys", server, model)

    @hookimpl
    def kept_keys(self, server, model):
        self._walk("kept_keys", server, model)

    @hookimpl
    def auxiliary_keys(self, server):
        self._walk("auxiliary_keys", server)

    @hookimpl
    def downlink(self, server, client):
        self._walk("downlink", server, client)

    @hookimpl
    def aggregate(self, server, cluster, uploads):
        self._walk("aggregate", server, cluster, uploads)

    @hookimpl
    def server_update(self, server, cluster, previous, aggregated):
        self._walk("server_update", server, cluster, previous, aggregated)

    @hookimpl
    def round_end(self, server):
        self._walk("round_end", server)

    @hookimpl
    def evaluate(self, server, round):
        self._walk("evaluate", server, round)

    @hookimpl
    def round_logged(self, server, metrics):
        self._walk("round_logged", server, metrics)


SERVER_HOOKS = [h for h in hook_names(side="server") if h not in ("init_models", "sample_clients")]


@pytest.fixture(scope="module")
def walked():
    from fedkit.core.runs import _raw

    raw = _raw("quickstart")
    raw["federation"] = {**raw["federation"], "rounds": 1, "local_epochs": 1}
    raw["plugins"] = [*raw["plugins"], "walker"]
    Walker.walks = []
    result = run_recipe(raw, plugins={"walker": Walker})
    return Walker, result


@pytest.mark.slow
def test_the_observer_saw_every_server_hook(walked):
    walker, _ = walked
    assert {hook for hook, _ in walker.walks} == set(SERVER_HOOKS)


@pytest.mark.slow
def test_no_server_hook_reaches_a_client_training_image(walked):
    walker, result = walked
    data = result.run.data
    clients = image_hashes(
        data.train.images[torch.as_tensor(sorted(int(i) for c in data.clients for i in c))]
    )
    assert len(clients) > 1000  # the quickstart's client images (digits has duplicates)
    for hook, objects in walker.walks:
        for obj in objects:
            assert not isinstance(obj, FederatedData | ClientData), hook
            if isinstance(obj, ImageSet):
                assert len(obj) == 0, f"{hook} reaches an image set of {len(obj)} images"
            if isinstance(obj, torch.Tensor) and obj.dtype == torch.uint8 and obj.dim() == 4:
                found = image_hashes(obj) & clients
                assert not found, f"{hook} reaches {len(found)} client training images"


@pytest.mark.slow
def test_the_walk_would_find_them_if_the_server_held_them(walked):
    _, result = walked
    data = result.run.data
    leaky = reachable(data.client(0))
    assert any(isinstance(o, torch.Tensor) and o.dtype == torch.uint8 for o in leaky)


@pytest.mark.slow
def test_the_server_offers_no_client_data(walked):
    _, result = walked
    server = result.run.server
    with pytest.raises(AttributeError, match="data"):  # a v2 plugin's error: test_v2_plugins
        server.data  # noqa: B018
    assert len(server.own_data) == 0  # the quickstart gives the server no split
    assert server.num_classes == 10
    assert sum(c.num_samples for c in server.roster) == sum(map(len, result.run.data.clients))
    assert isinstance(server, Server)


def test_hook_sides_split_the_hooks():
    sides = {hook_side(h) for h in hook_names()}
    assert sides == {"registry", "server", "client", "simulation"}
