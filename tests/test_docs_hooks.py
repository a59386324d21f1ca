"""Every hook is documented: docstrings complete, docs/hooks.md generated from them."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from fedkit.cli import reference
from fedkit.plugin import hookspecs
from fedkit.plugin.registry import hook_kind, hook_names, hook_side

ROOT = Path(__file__).resolve().parent.parent


def test_hooks_md_is_generated_from_docstrings():
    page = (ROOT / "docs" / "hooks.md").read_text()
    assert page == reference.render(), "run: python -m fedkit.cli.reference docs/hooks.md"


@pytest.mark.parametrize("name", hook_names())
def test_each_hook_documented_with_signature(name):
    doc = inspect.getdoc(getattr(hookspecs, name)) or ""
    params = inspect.signature(getattr(hookspecs, name)).parameters
    assert len(doc.splitlines()) >= 3
    for param in params:
        assert f":param {param}:" in doc, f"{name} does not document {param}"
    assert ":returns:" in doc
    page = (ROOT / "docs" / "hooks.md").read_text()
    assert f"## `{name}`" in page and reference.signature(name) in page
    assert f"*Side:* {hook_side(name)} · *Kind:* {hook_kind(name)}" in page


def test_the_core_names_no_federated_method():
    names = (
        r"\b(fedavg|fedu|dapu|fedbyol|fedsimsiam|fedsimclr|fedca|ifca|cpcfl|cp-cfl"
        r"|fedprox|scaffold|fedbn|fedema|fedopt|fedadam|fedavgm|fednova|ditto|fedrep|fedbabu)\b"
    )
    # Authoring aids compose a new plugin with the baseline a user would pick: they name
    # it in recipes they write, never in logic.
    aids = {"testing.py", "newplugin.py"}
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "fedkit").rglob("*.py")
        if path.name not in aids and re.search(names, path.read_text(), re.IGNORECASE)
    ]
    assert offenders == []
