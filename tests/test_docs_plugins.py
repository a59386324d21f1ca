"""docs/plugins.md is a guide a researcher can follow: every hook has a section, every
Python example on the page runs as a plugin in a real (tiny) federation, and the
built-in plugins import only what the page lists as public API."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import prepared, tiny_recipe

from fedkit import PROJECT
from fedkit.core.engine import run_round
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


def public_api() -> str:
    return PAGE.split("## Public API", 1)[1]


def fedkit_imports(path: Path) -> list[tuple[str, str]]:
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fedkit":
            out += [(node.module, alias.name) for alias in node.names]
    return out


@pytest.mark.parametrize("path", sorted((ROOT / "plugins").glob("*.py")), ids=lambda p: p.name)
def test_built_in_plugins_import_only_the_documented_api(path):
    api = public_api()
    for module, name in fedkit_imports(path):
        assert f"`{module}`" in api, f"{path.name} imports {module}, not documented as public"
        assert f"`{name}`" in api, f"{path.name} imports {module}.{name}, not documented"
