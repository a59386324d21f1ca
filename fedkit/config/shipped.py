"""Finding recipes: a path, or the name of a recipe shipped with fedkit (the package
``fedkit_recipes``, the repository's ``recipes/``, so an installed wheel has them too)."""

from __future__ import annotations

import os
import re
from importlib.resources import files
from pathlib import Path

import yaml

from fedkit.errors import RecipeError, did_you_mean


def recipe_dirs() -> list[Path]:
    """Where shipped recipes live: ``$FEDKIT_RECIPES`` (colon-separated), then fedkit's."""
    extra = [Path(p) for p in os.environ.get("FEDKIT_RECIPES", "").split(os.pathsep) if p]
    return [*extra, Path(str(files("fedkit_recipes")))]


def shipped() -> dict[str, Path]:
    """Shipped recipes by name (file stem); earlier directories win."""
    found: dict[str, Path] = {}
    for folder in reversed(recipe_dirs()):
        for path in sorted(folder.glob("*.yaml")):
            found[path.stem] = path
    return dict(sorted(found.items()))


def describe(path: Path) -> str:
    """A recipe's one-line description (its ``description`` key)."""
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except UnicodeDecodeError:
        return "(not a text file)"
    except yaml.YAMLError:
        return "(not valid YAML)"
    return (
        str(raw.get("description", "")).strip().splitlines()[0]
        if isinstance(raw, dict) and raw.get("description")
        else ""
    )


def scale(description: str) -> str:
    """``GPU`` for a recipe meant for a GPU (its description says so: the papers'
    settings), ``CPU`` for one that runs on a laptop's cores."""
    return "GPU" if re.search(r"\bGPU\b", description) else "CPU"


def resolve(name: str) -> Path:
    """A recipe path from a path or a shipped recipe's name."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    recipes = shipped()
    stem = path.name.removesuffix(".yaml")
    if stem in recipes and path.parent == Path("."):
        return recipes[stem]
    raise RecipeError(
        "(file)",
        "a recipe file or the name of a shipped recipe (`fedkit recipes`)",
        name,
        hint=did_you_mean(stem, recipes),
    )
