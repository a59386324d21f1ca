"""docs/plugins.md is a guide a researcher can follow: every hook has a section, every
Python example on the page runs as a plugin in a real (tiny) federation, and the
built-in plugins import only what the page lists as public API."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import prepared, tiny_recipe

import fedkit
import fedkit.testing
from fedkit.core.engine import run_round
from fedkit.plugin.markers import PROJECT
from fedkit.plugin.registry import collect, hook_names, registers_only

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "plugins.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE, flags=re.S)


def example_plugins() -> dict[str, type]:
    """Every class with a hook implementation defined by the page's Python blocks."""
    found: dict[str, type] = {}
    for block in BLOCKS:
        namespace: dict = {}
        exec(compile(block, "docs/plugins.md", "exec"), namespace)  # noqa: S102
        for name, obj in namespace.items():
            if isinstance(obj, type) and any(
                hasattr(getattr(obj, h, None), f"{PROJECT}_impl") for h in hook_names()
            ):
                found[name] = obj
    return found


EXAMPLES = example_plugins()


def test_every_hook_has_a_section():
    for name in hook_names():
        assert f"### `{name}`" in PAGE, f"docs/plugins.md has no section for {name}"


def test_the_page_has_examples_for_most_hooks():
    assert len(EXAMPLES) >= 15
    covered = {h for cls in EXAMPLES.values() for h in hook_names() if hasattr(cls, h)}
    assert len(covered) >= len(hook_names()) - 1


def uses_what_it_registers(raw: dict, plugin: type) -> dict:
    """The recipe naming what a registry plugin registers (its data set, partitioner,
    executor or store)."""
    registered = collect({"example": plugin})
    raw = {**raw, "data": dict(raw["data"]), "engine": {}}
    for name in registered.datasets:
        raw["data"].update(dataset=name, max_train=None, image_size=8)
    for name in registered.partitioners:
        raw["data"]["partition"] = {"name": name}
    for name in registered.executors:
        raw["engine"]["executor"] = name
    for name in registered.stores:
        raw["engine"]["store"] = name
    return raw


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_example_runs_in_a_federation(name):
    plugin = EXAMPLES[name]
    alone = hasattr(plugin, "init_models")  # a method of its own
    listed = [] if registers_only(plugin) else ["example"]
    raw = tiny_recipe(
        plugins=listed if alone else [*listed, "fedavg"],
        federation={"rounds": 2, "optimizer": {"name": "sgd", "lr": 0.05}},
        data={"max_train": 150, "server_fraction": 0.1},
    )
    if registers_only(plugin):
        raw = uses_what_it_registers(raw, plugin)
    run = prepared(raw, example=plugin)
    rows = [run_round(run, r) for r in (1, 2)]
    assert rows[-1]["clients"] and 0.0 <= rows[-1]["test_accuracy"] <= 1.0
    run.close()


OLD_NAMES = 98
"""Distinct names the page's public API list had at 88ff46c (101 entries in 27 modules)."""
REGISTRY_PLUGINS = {"datasets.py", "partitioners.py", "executors.py", "stores.py"}
"""Plugins registering fedkit's own parts: they import the modules those parts live in."""


def listed() -> tuple[set[str], set[str]]:
    """The names the page's "Public API" section lists: ``fedkit``'s and ``fedkit.testing``'s."""
    section = PAGE.split("\n## Public API\n", 1)[1].split("\n## ", 1)[0]
    face, testing = set(), set()
    for bullet in re.findall(r"^- (.*(?:\n  .*)*)", section, flags=re.M):
        module, _, text = bullet.partition(": ")
        names = set(re.findall(r"`([A-Za-z_]\w*)`", text))
        (testing if module == "`fedkit.testing`" else face).update(names)
    return face, testing


def test_the_public_api_list_is_the_facade_and_every_name_imports():
    face, testing = listed()
    assert (
        face
        == set(fedkit.__all__) - {"__version__"}
        == set(fedkit.PUBLIC)
        | {
            "DROP",
            "PluginOptions",
            "hookimpl",
        }
    )
    assert all(getattr(fedkit, name) is not None for name in face)
    assert testing and all(hasattr(fedkit.testing, name) for name in testing)


def test_the_public_api_is_at_most_half_of_what_it_was():
    face, testing = listed()
    assert len(face | testing) <= OLD_NAMES // 2


def fedkit_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) for every import of fedkit in a file, nested ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fedkit":
            out += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names if a.name.split(".")[0] == "fedkit"]
    return out


METHOD_PLUGINS = [
    p for p in sorted((ROOT / "plugins").glob("*.py")) if p.name not in REGISTRY_PLUGINS
]


@pytest.mark.parametrize("path", METHOD_PLUGINS, ids=lambda p: p.name)
def test_method_plugins_import_only_the_public_face(path):
    face, testing = listed()
    allowed = {"fedkit": face, "fedkit.testing": testing}
    for module, name in fedkit_imports(path):
        assert name in allowed.get(module, ()), f"{path.name} imports {module} {name}"


@pytest.mark.parametrize("name", sorted(REGISTRY_PLUGINS))
def test_the_plugins_allowed_internal_imports_only_register(name):
    import importlib

    module = importlib.import_module(f"fedkit_plugins.{name.removesuffix('.py')}")
    assert registers_only(module)
