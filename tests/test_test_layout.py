"""How the suite is laid out. Helpers travel through tests/conftest.py (or fedkit.testing),
never by one test file importing another: each file runs alone, and the fast tier
(``make check``: ``pytest -m "not slow"``) can leave any file out. A test that starts
processes (``fedkit`` subprocesses, a Flower deployment, Ray look-alikes) is marked
``slow``, in its file, so that a reader sees it and the fast tier skips it."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# Calls that start a process of their own; a test calling one directly must be slow.
STARTS_PROCESSES = {
    "subprocess.Popen",
    "subprocess.run",
    "subprocess.check_call",
    "subprocess.check_output",
    "kill_after_checkpoint",
    "raylet_driver",
    "run_fedkit",
    "start_process",
}


def suite_files() -> list[Path]:
    """Every test file of the suite."""
    return sorted(TESTS.glob("test_*.py"))


def imported_test_modules(tree: ast.Module) -> list[str]:
    """The ``test_*`` modules a file imports, at any depth (inside functions too)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
            names += [alias.name for alias in node.names if node.module is None]
    return [name for name in names if name.split(".")[0].startswith("test_")]


def test_no_test_file_imports_another():
    found = {}
    for path in suite_files():
        imported = imported_test_modules(ast.parse(path.read_text(), str(path)))
        if imported:
            found[path.name] = imported
    assert found == {}, f"share these through tests/conftest.py instead: {found}"


def is_slow_mark(node: ast.expr) -> bool:
    """Whether ``node`` is ``pytest.mark.slow`` (or a list holding it)."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(is_slow_mark(item) for item in node.elts)
    return ast.unparse(node) == "pytest.mark.slow"


def unmarked_process_tests(tree: ast.Module) -> list[str]:
    """The test functions that call one of ``STARTS_PROCESSES`` yet are not marked slow,
    neither by their decorators nor by the module's ``pytestmark``."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
        ):
            if is_slow_mark(node.value):
                return []
    found = []
    for node in tree.body:
        if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
            continue
        calls = {ast.unparse(call.func) for call in ast.walk(node) if isinstance(call, ast.Call)}
        if calls & STARTS_PROCESSES and not any(is_slow_mark(d) for d in node.decorator_list):
            found.append(node.name)
    return found


def test_tests_that_start_processes_are_marked_slow():
    found = {}
    for path in suite_files():
        unmarked = unmarked_process_tests(ast.parse(path.read_text(), str(path)))
        if unmarked:
            found[path.name] = unmarked
    assert found == {}, f"mark these @pytest.mark.slow (they start processes): {found}"
