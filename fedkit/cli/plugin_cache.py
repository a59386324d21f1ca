"""The ``fedkit plugins`` listing, kept between calls so that it answers without
importing a plugin (or torch) while no installed plugin changed.

The listing needs each plugin's hooks, so its first call imports every plugin. The rows
are then saved in the user's cache directory (``$FEDKIT_CACHE_DIR``, else
``$XDG_CACHE_HOME/fedkit``, by default ``~/.cache/fedkit``) under a key made of every
entry point's fingerprint (its package's version, its module file's size and time) and
fedkit's version: installing, removing or editing a plugin changes the key and the next
call lists afresh. ``--check`` never
uses the cache.
"""

from __future__ import annotations

import json
import os
from importlib.metadata import EntryPoint, version
from pathlib import Path

from fedkit.plugin.entrypoints import DISTRIBUTION, fingerprint
from fedkit.rundir.atomic import write_json


def cache_file() -> Path:
    own = os.environ.get("FEDKIT_CACHE_DIR")
    if own:
        return Path(own) / "plugins.json"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fedkit" / "plugins.json"


def key(entry_points: dict[str, EntryPoint]) -> list:
    return [version(DISTRIBUTION), *(fingerprint(ep) for _, ep in sorted(entry_points.items()))]


def load(entry_points: dict[str, EntryPoint]) -> list[list[str]] | None:
    """The cached rows for exactly these plugins, or ``None``."""
    try:
        saved = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("key") != json.loads(json.dumps(key(entry_points))):
        return None
    rows = saved.get("rows")
    return rows if isinstance(rows, list) else None


def save(entry_points: dict[str, EntryPoint], rows: list[list[str]]) -> None:
    """Keep the rows for the next call (a cache that cannot be written is skipped)."""
    try:
        write_json(cache_file(), {"key": key(entry_points), "rows": rows})
    except OSError:
        pass
