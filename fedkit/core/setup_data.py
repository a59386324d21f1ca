"""A ``ClientSetup`` as plain data, and the setup a node rebuilds from it.

A transport between machines (a Flower deployment) must not carry code: no pickle, no
module or class name the receiver imports. So the setup travels as the recipe (JSON), key
lists, the template's tensors, and the shapes of what the server computed once for the
model (``server.once``). The receiving side rebuilds the template with the plugins
installed on it: the recipe's plugins' ``init_models``, called on a ``Server`` that holds
no data and whose ``once`` hands back zeros of the shapes the server computed (they only
size modules: the real weights are the template's tensors, loaded strictly afterwards).
``configure`` is not called there: it checks the server's own data, which a node lacks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from fedkit.config.schema import Recipe
from fedkit.core.messages import ClientSetup
from fedkit.data.datasets import ImageSet
from fedkit.errors import FedkitError, RecipeError
from fedkit.plugin.manager import Plugins
from fedkit.plugin.server import Server, ServerRecord
from fedkit.seeding import isolated_rng

DEVICES = ("cpu", "cuda", "mps")
"""Device kinds a setup may name (with an optional ``:index``)."""


def once_shapes(server: Server) -> dict[str, dict[str, list[Any]]]:
    """Name → key → ``[dtype, shape]`` of every ``server.once`` result computed so far."""
    shapes: dict[str, dict[str, list[Any]]] = {}
    for name in server.state.get("once", []):
        prefix = f"{name}/"
        shapes[name] = {
            key[len(prefix) :]: [str(value.dtype).removeprefix("torch."), list(value.shape)]
            for key, value in server.tensors.items()
            if key.startswith(prefix)
        }
    return shapes


def describe(setup: ClientSetup) -> dict[str, Any]:
    """The JSON part of a setup (its tensors are ``setup.template.state_dict()``)."""
    return {
        "recipe": setup.recipe.model_dump(mode="json"),
        "private": sorted(setup.private),
        "kept": sorted(setup.kept) if setup.kept is not None else None,
        "auxiliary": list(setup.auxiliary),
        "device": setup.device,
        "once": setup.once,
    }


class _Skeleton(Server):
    """A server with no data, whose ``once`` returns zeros of the shapes the real server
    computed: enough for ``init_models`` to size the model, nothing to train on."""

    __slots__ = ("_shapes",)

    def __init__(
        self, recipe: Recipe, classes: list[str], shapes: Mapping[str, Mapping[str, Any]]
    ) -> None:
        empty = ImageSet(
            torch.zeros(0, 3, 1, 1, dtype=torch.uint8), torch.zeros(0, dtype=torch.long),
            list(classes), (0.0, 0.0, 0.0), (1.0, 1.0, 1.0),
        )  # fmt: skip
        super().__init__(ServerRecord(recipe, torch.device("cpu"), list(classes), empty, []))
        self._shapes = shapes

    def once(self, name: str, compute: Callable[[], dict[str, Tensor]]) -> dict[str, Tensor]:
        if name not in self._shapes:
            raise FedkitError(f"the setup does not say what the server computed as {name!r}")
        return {
            key: torch.zeros(shape, dtype=dtype_named(dtype))
            for key, (dtype, shape) in self._shapes[name].items()
        }


def rebuild(
    meta: Mapping[str, Any],
    recipe: Recipe,
    classes: list[str],
    template: Mapping[str, Tensor],
    available: dict[str, Any],
) -> ClientSetup:
    """The ``ClientSetup`` that ``describe`` described, its template built by the
    ``available`` plugins (the receiver's own) and loaded with ``template``."""
    device = str(meta["device"])
    if device.split(":")[0] not in DEVICES:
        raise FedkitError(f"the setup names device {device!r}, not one of {', '.join(DEVICES)}")
    plugins = Plugins(recipe, available)
    with isolated_rng():
        models = plugins.call("init_models", server=_Skeleton(recipe, classes, meta["once"]))
    if not models:
        raise RecipeError("plugins", "a plugin that builds the model (init_models)", plugins.names)
    model: nn.Module = models[0]
    if recipe.channels_last:
        model = model.to(memory_format=torch.channels_last)
    expected = model.state_dict()
    if set(expected) != set(template):
        extra = sorted(set(template) - set(expected))
        missing = sorted(set(expected) - set(template))
        raise FedkitError(
            "the server's model does not match the one this node's plugins build "
            f"(keys only the server has: {extra[:5]}; only this node: {missing[:5]}): "
            "install the same plugin versions on both"
        )
    for key, value in template.items():
        if value.shape != expected[key].shape or value.dtype != expected[key].dtype:
            raise FedkitError(
                f"the server's model key {key!r} is {value.dtype} {list(value.shape)}, this "
                f"node's plugins build {expected[key].dtype} {list(expected[key].shape)}"
            )
    model.load_state_dict(dict(template))
    kept = meta["kept"]
    return ClientSetup(
        recipe, model.cpu(), frozenset(meta["private"]), device, available,
        frozenset(kept) if kept is not None else None, tuple(meta["auxiliary"]), meta["once"],
    )  # fmt: skip


DTYPES = {
    str(t).removeprefix("torch."): t
    for t in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
        torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}  # fmt: skip
"""The tensor dtypes a message may name."""


def dtype_named(name: str) -> torch.dtype:
    """The dtype a message names (one of ``DTYPES``), or a ``FedkitError``."""
    if name not in DTYPES:
        raise FedkitError(f"a message names dtype {name!r}, not one of {', '.join(DTYPES)}")
    return DTYPES[name]
