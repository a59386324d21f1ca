"""docs/recipes.md documents every recipe key, and every shipped recipe validates."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedkit.cli.app import app
from fedkit.config.schema import Recipe
from fedkit.config.shipped import shipped

ROOT = Path(__file__).resolve().parent.parent


def schema_keys(model=Recipe, prefix=""):
    for name, field in model.model_fields.items():
        yield prefix, name
        sub = field.annotation
        if isinstance(sub, type) and hasattr(sub, "model_fields") and name != "plugins":
            yield from schema_keys(sub, f"{prefix}{name}.")


@pytest.mark.parametrize("section,key", list(schema_keys()))
def test_every_recipe_key_is_documented(section, key):
    page = (ROOT / "docs" / "recipes.md").read_text()
    assert f"`{key}`" in page, f"docs/recipes.md does not document {section}{key}"


@pytest.mark.parametrize("name", sorted(shipped()))
def test_every_shipped_recipe_validates_and_has_a_description(name, tmp_path):
    path = shipped()[name]
    assert "description:" in path.read_text()
    args = ["validate", str(path)]
    if "root:" in path.read_text():
        args += ["--set", f"data.root={tmp_path}"]
    text = path.read_text()
    if "name: test_" not in text or "encoder: runs/" in text:
        # GPU-scale recipes: their dry round would pre-train a ResNet for the paper's epochs
        # (the -small recipe with the same plugins runs it); a warm start needs its run.
        args.append("--no-dry-run")
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
