"""What a submitted run may make a deployment's server read and write.

Anyone who can submit a run to a SuperLink chooses its run config: the recipe, the run
directory (``out``) and ``--set`` overrides. The ServerApp turns them into a run only
inside the folder its operator chose (``FEDKIT_SERVER_ROOT``, in the SuperLink's
environment, which Flower's ServerApp process inherits): ``out`` is a relative name
under it, a path in a plugin's options or the backbone's ``kwargs`` must stay inside it,
and the recipe arrives as YAML text (or the name of a recipe shipped with fedkit), never
as a path the server would open. ``data.root`` is confined to ``FEDKIT_SERVER_DATA``
when the operator sets it. Nothing here imports Flower, so the CLI and tests use it too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

import yaml

from fedkit.config.schema import Recipe, load_recipe, overridden
from fedkit.config.shipped import shipped
from fedkit.errors import FedkitError, RecipeError
from fedkit.rundir import checkpoint
from fedkit.rundir.logs import RECIPE

ROOT_ENV = "FEDKIT_SERVER_ROOT"
"""The folder a deployment's server writes runs under (set by the SuperLink's operator)."""

DATA_ENV = "FEDKIT_SERVER_DATA"
"""If set, the folder the server's ``data.root`` must lie in (relative: resolved there)."""

SOURCE = "run config 'recipe'"
"""How errors in a submitted recipe name where it came from."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_URI = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://(.*)", re.DOTALL)
_DRIVE = re.compile(r"[A-Za-z]:[\\/]")


@dataclass(frozen=True)
class Submission:
    """A run config turned into what the ServerApp runs: the run directory and, for a new
    run, the recipe (``None`` when ``out`` holds a checkpoint to resume)."""

    out: Path
    recipe: Recipe | None
    overrides: list[str]
    clients: int
    """The recipe's ``data.num_clients``: the nodes the run waits for."""


def server_root(environ: Mapping[str, str] = os.environ) -> Path:
    """The operator's folder for runs (``FEDKIT_SERVER_ROOT``), which must exist."""
    value = environ.get(ROOT_ENV, "").strip()
    if not value:
        raise FedkitError(
            f"{ROOT_ENV} is not set in the SuperLink's environment: its operator sets it to "
            "the folder this server writes runs under (see docs/deploy.md, "
            '"Who can start a run")'
        )
    root = Path(value).expanduser()
    if not root.is_absolute() or not root.is_dir():
        raise FedkitError(f"{ROOT_ENV}={value}: expected an existing directory (absolute path)")
    return root.resolve()


def data_root(environ: Mapping[str, str] = os.environ) -> Path | None:
    """The operator's folder for the server's data (``FEDKIT_SERVER_DATA``), or ``None``."""
    value = environ.get(DATA_ENV, "").strip()
    if not value:
        return None
    folder = Path(value).expanduser()
    if not folder.is_absolute() or not folder.is_dir():
        raise FedkitError(f"{DATA_ENV}={value}: expected an existing directory (absolute path)")
    return folder.resolve()


def relative_name(text: str) -> bool:
    """Whether ``text`` is a relative path without ``..`` (what ``out`` may be)."""
    text = text.strip()
    return bool(text) and not (
        PurePath(text).is_absolute()
        or text.startswith(("~", "\\"))
        or _DRIVE.match(text)
        or ".." in re.split(r"[\\/]", text)
    )


def run_directory(value: object, root: Path) -> Path:
    """``out`` from a run config: a relative name, without ``..``, that resolves (symlinks
    followed) to a folder strictly inside ``root``."""
    expected = (
        f"a relative folder name without '..' (the run directory, under {ROOT_ENV} on the server)"
    )
    if not isinstance(value, str) or not relative_name(value):
        raise RecipeError("out", expected, value, file="run config")
    text = value.strip()
    out = (root / text).resolve()
    if out == root or not out.is_relative_to(root):
        raise RecipeError("out", expected, text, file="run config", hint=f" (it resolves to {out})")
    return out


def recipe_mapping(value: object) -> dict[str, Any]:
    """The recipe a run config carries: YAML text of a mapping, or the name of a recipe
    shipped with fedkit. A path is never opened: the submitter's machine reads its file
    and sends the text (``fedkit deploy run`` does)."""
    expected = (
        "the recipe's YAML text or the name of a shipped recipe (a path is not opened on "
        "the server: `fedkit deploy run FILE` sends the file's content)"
    )
    if not isinstance(value, str) or not value.strip():
        raise RecipeError("recipe", expected, value, file="run config")
    try:
        raw = yaml.safe_load(value)
    except yaml.YAMLError as exc:
        problem = str(exc).splitlines()[0]
        hint = f" (not valid YAML: {problem})"
        raise RecipeError("recipe", expected, file="run config", hint=hint) from None
    if isinstance(raw, dict):
        return raw
    name = value.strip()
    recipes = shipped()
    if _NAME.fullmatch(name) and name.removesuffix(".yaml") in recipes:
        found = yaml.safe_load(recipes[name.removesuffix(".yaml")].read_text())
        if isinstance(found, dict):
            return found
    shown = name if len(name) <= 200 else name[:200] + "…"
    raise RecipeError("recipe", expected, shown, file="run config")


def _strings(value: Any, key: str) -> Iterator[tuple[str, str]]:
    """Every string in a nested option value, with its dotted key."""
    if isinstance(value, str):
        yield key, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _strings(v, f"{key}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _strings(v, f"{key}.{i}")


def local_path(text: str) -> str | None:
    """The file-system path a string would name if code used it as one, or ``None`` for a
    string that names no local file (a network URI such as ``http://host:5000``)."""
    uri = _URI.fullmatch(text)
    if uri is None:
        return text
    scheme, rest = uri.group(1).lower(), uri.group(2)
    if scheme == "file":
        return "/" + rest.split("/", 1)[1] if "/" in rest else "/"
    if scheme.startswith("sqlite"):  # sqlite:///relative.db, sqlite:////absolute.db
        return rest[1:] if rest.startswith("/") else rest
    return None


def escapes(text: str, here: Path, root: Path) -> bool:
    """Whether ``text``, used as a path from ``here``, would name something outside
    ``root`` (absolute, ``~``, ``..`` or a symlink leading out)."""
    path = local_path(text)
    if path is None or not path.strip():
        return False
    if _DRIVE.match(path) or path.startswith("\\"):
        return True
    try:
        target = (here / Path(path).expanduser()).resolve()
    except RuntimeError:  # ~user whose home cannot be found
        return True
    return not target.is_relative_to(root)


def confine(recipe: Recipe, out: Path, root: Path, data: Path | None) -> Recipe:
    """The recipe with every path the server would open kept inside the operator's
    folders, or a ``RecipeError`` naming the first key that leaves them.

    Plugin options and ``backbone.kwargs`` are free-form: any string in them that would
    name a file outside ``root`` when read from the run directory (where the ServerApp
    works) is refused. ``data.root`` is rebased under ``data`` when the operator set it;
    otherwise it is the submitter's choice (read only: ``data.download`` is refused)."""
    expected = (
        f"a path inside the server's folder ({ROOT_ENV}), relative to the run directory; "
        "a run's submitter cannot make the server read or write elsewhere"
    )
    blocks = [
        (f"plugins.{i}.options", spec.options, f" (plugin {spec.name!r})")
        for i, spec in enumerate(recipe.plugins)
    ]
    blocks.append(("backbone.kwargs", recipe.backbone.kwargs, ""))
    for prefix, options, hint in blocks:
        for key, text in _strings(options, prefix):
            if escapes(text, out, root):
                raise RecipeError(key, expected, text, file=SOURCE, hint=hint)
    cfg = recipe.data
    if data is None:
        if cfg.download:
            raise RecipeError(
                "data.download",
                f"false on a deployment's server unless its operator sets {DATA_ENV} (a "
                "download writes into data.root, which the run's submitter chose)",
                True,
                file=SOURCE,
            )
        if cfg.root is None or Path(cfg.root).expanduser().is_absolute():
            return recipe
        rebased = str((root / cfg.root).resolve())
    else:
        if cfg.root is None:
            return recipe
        rebased_path = (data / Path(cfg.root).expanduser()).resolve()
        if not rebased_path.is_relative_to(data):
            raise RecipeError(
                "data.root",
                f"a folder inside {DATA_ENV} ({data}) on the server, relative to it",
                cfg.root,
                file=SOURCE,
            )
        rebased = str(rebased_path)
    return recipe.model_copy(update={"data": cfg.model_copy(update={"root": rebased})})


def new_recipe(raw: dict[str, Any], overrides: list[str]) -> Recipe:
    """A submitted recipe with its overrides, validated as ``fedkit run`` does."""
    return overridden(raw, overrides, SOURCE)


def submission(config: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> Submission:
    """What a run config asks the server to run, checked against the operator's folders.
    An ``out`` that holds a checkpoint is resumed with its own recipe (checked the same
    way); the config's recipe is then not read."""
    root, data = server_root(environ), data_root(environ)
    out = run_directory(config.get("out"), root)
    overrides = [s.strip() for s in str(config.get("set", "")).split(";") if s.strip()]
    if checkpoint.latest_round(out) is not None:
        kept = load_recipe(out / RECIPE)
        confine(kept, out, root, data)
        return Submission(out, None, overrides, kept.data.num_clients)
    raw = recipe_mapping(config.get("recipe"))
    recipe = new_recipe(raw, overrides)
    engine = recipe.engine.model_copy(update={"executor": "flower"})  # what the ServerApp runs
    recipe = confine(recipe.model_copy(update={"engine": engine}), out, root, data)
    return Submission(out, recipe, overrides, recipe.data.num_clients)
