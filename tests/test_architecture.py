"""The layout keeps its promises: no import cycle in ``fedkit/`` (imports inside functions
counted, ``if TYPE_CHECKING:`` blocks not), every import goes down the layer order that
docs/architecture.md writes (or stays inside its package), every package is in that table,
and nothing inside ``fedkit/`` imports the top-level facade."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fedkit"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _type_checking(node: ast.If) -> bool:
    test = node.test
    name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", "")
    return name == "TYPE_CHECKING"


def imports_of(name: str) -> set[str]:
    """The fedkit modules ``name`` imports at run time, anywhere in its file."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name.split(".")[0] == "fedkit")
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*parts, *([child.module] if child.module else [])])
                if base.split(".")[0] == "fedkit":
                    for alias in child.names:
                        full = f"{base}.{alias.name}"
                        found.add(full if full in MODULES else base)
            visit(child)

    visit(ast.parse(path.read_text()))
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports_of(name) for name in MODULES}


def layer_table() -> dict[str, int]:
    """Package → layer, from the table in docs/architecture.md (``| 3 | `fedkit.data` |``)."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `(fedkit[\w.]*)` \|", page, flags=re.M)
    return {package: int(layer) for layer, package in rows}


def package_of(module: str, layers: dict[str, int]) -> str:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in layers:
            return ".".join(parts[:n])
    raise AssertionError(f"{module} belongs to no package of the layer table")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_import_graph_has_no_cycle():
    assert cycles(GRAPH) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_import_goes_down_the_layer_order_of_the_architecture_page():
    layers = layer_table()
    assert layers["fedkit"] == max(layers.values())  # the facade sits on top
    wrong = []
    for module, targets in sorted(GRAPH.items()):
        here = package_of(module, layers)
        for target in sorted(targets):
            there = package_of(target, layers)
            if there != here and layers[there] >= layers[here]:
                wrong.append(f"{module} (layer {layers[here]}) imports {target} ({layers[there]})")
    assert wrong == []


def test_every_package_and_top_level_module_has_a_row_in_the_layer_table():
    layers = layer_table()
    top = {m for m in MODULES if m.count(".") == 1} | {"fedkit"}
    assert {package_of(m, layers) for m in top} <= set(layers)
    for module in top:
        assert module in layers or module == "fedkit.__main__", f"{module} has no row"


def test_nothing_inside_fedkit_imports_the_facade():
    importers = sorted(m for m, targets in GRAPH.items() if "fedkit" in targets)
    assert importers in ([], ["fedkit.__main__"])


def test_no_two_modules_share_a_name():
    stems = [p.stem for p in PACKAGE.rglob("*.py") if p.stem not in ("__init__", "__main__")]
    assert len(stems) == len(set(stems)), sorted(s for s in stems if stems.count(s) > 1)
