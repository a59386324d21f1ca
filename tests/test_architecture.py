"""The layout keeps its promises: no import cycle in ``fedkit/`` (imports inside functions
and inside ``if TYPE_CHECKING:`` blocks counted: a type-only circle is still a circle),
every import goes down the layer order that docs/architecture.md writes (or stays inside
its package), every package is in that table, nothing inside ``fedkit/`` imports the
top-level facade, and no module reads another package's private (underscore) names."""

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


TREES = {name: ast.parse(path.read_text()) for name, path in MODULES.items()}


def imported(name: str) -> list[tuple[str, str | None, str]]:
    """``(module, name, bound as)`` for every fedkit import in ``name``'s file, anywhere
    (inside functions and ``if TYPE_CHECKING:`` too); ``name`` is None for ``import m``."""
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "fedkit":
                    found.append((a.name, None, a.asname or a.name))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            if base.split(".")[0] == "fedkit":
                found += [(base, a.name, a.asname or a.name) for a in node.names]
    return found


def imports_of(name: str) -> set[str]:
    """The fedkit modules ``name`` imports (a name imported from a module counts as that
    module, a submodule imported from a package as the submodule)."""
    found = set()
    for base, member, _ in imported(name):
        full = f"{base}.{member}"
        found.add(full if member is not None and full in MODULES else base)
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


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_privates(module: str) -> set[str]:
    """The underscore names a module defines: functions, classes, assigned names and
    attributes, ``__slots__`` entries."""
    found = set()
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            found.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)  # a __slots__ entry, a setattr name
    return {n for n in found if private(n)}


def foreign_private_reads(layers: dict[str, int]) -> list[str]:
    """Reads of a private name across packages: ``from fedkit.x import _name``,
    ``module._name`` on an imported fedkit module, and ``obj._name`` where only another
    fedkit package defines ``_name``."""
    owners: dict[str, set[str]] = {}
    for module in MODULES:
        for name in defined_privates(module):
            owners.setdefault(name, set()).add(package_of(module, layers))
    wrong = []
    for module in sorted(MODULES):
        here = package_of(module, layers)
        modules = {}  # names bound to another package's modules
        for base, member, bound in imported(module):
            full = base if member is None else f"{base}.{member}"
            target = full if full in MODULES else base
            if package_of(target, layers) == here:
                continue
            if member is not None and private(member):
                wrong.append(f"{module} imports {member} from {base}")
            if full in MODULES:
                modules[bound] = full
        for node in ast.walk(TREES[module]):
            if not isinstance(node, ast.Attribute) or not private(node.attr):
                continue
            value = node.value.id if isinstance(node.value, ast.Name) else None
            if value in modules:
                wrong.append(f"{module} reads {modules[value]}.{node.attr}")
            elif value not in ("self", "cls") and here not in owners.get(node.attr, {here}):
                wrong.append(f"{module} reads .{node.attr} (defined in {owners[node.attr]})")
    return wrong


def test_no_module_reads_another_packages_private_names():
    assert foreign_private_reads(layer_table()) == []


def test_the_private_name_check_finds_each_kind(monkeypatch):
    sources = {
        "fedkit.core.engine": "from fedkit.plugin.keys import _hidden\n",
        "fedkit.core.runs": "from fedkit.plugin import keys\nkeys._hidden\n",
        "fedkit.core.worker": "def f(s):\n    return s._held, s._own\n_own = 0\n",
        "fedkit.plugin.keys": "_hidden = 1\nclass A:\n    def __init__(self):\n"
        "        self._held = self._own = 2\n",
    }
    monkeypatch.setattr("test_architecture.MODULES", {m: MODULES[m] for m in sources})
    monkeypatch.setattr("test_architecture.TREES", {m: ast.parse(s) for m, s in sources.items()})
    assert foreign_private_reads(layer_table()) == [
        "fedkit.core.engine imports _hidden from fedkit.plugin.keys",
        "fedkit.core.runs reads fedkit.plugin.keys._hidden",
        "fedkit.core.worker reads ._held (defined in {'fedkit.plugin'})",
    ]
