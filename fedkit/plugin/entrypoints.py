"""The ``fedkit`` entry-point group, read without importing any plugin (or torch).

``discover`` is what every name lookup starts from; ``fingerprint`` identifies an
installed plugin's code (its entry point, its package's version, its module file's size
and time), so that ``fedkit plugins`` can reuse a listing while nothing changed.
"""

from __future__ import annotations

import importlib.util
import os
from importlib.metadata import EntryPoint, entry_points

from fedkit.errors import FedkitError

GROUP = "fedkit"
DISTRIBUTION = "fedkit-fl"
"""The name fedkit installs under (``pip install fedkit-fl``, ``version(DISTRIBUTION)``):
``fedkit`` on the package index is another project's. The import name and the entry-point
group stay ``fedkit``."""


class RegistryWarning(UserWarning):
    """A registry hook of an installed package raised: what it registers is missing, the
    rest of fedkit works (``fedkit.plugin.registry.collect``)."""


def discover() -> dict[str, EntryPoint]:
    """Every installed plugin by name, from the ``fedkit`` entry-point group. Two
    packages registering the same name are refused, naming both: which one a recipe
    got would otherwise depend on the order Python found them in."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=GROUP):
        other = found.get(ep.name)
        if other is not None and other.value != ep.value:
            raise FedkitError(
                f"two installed packages register the fedkit plugin {ep.name!r}: "
                f"{package(other)} ({other.value}) and {package(ep)} ({ep.value}); "
                "uninstall one, or rename its entry point"
            )
        found[ep.name] = ep
    return found


def package(ep: EntryPoint) -> str:
    """The name of the distribution that registers ``ep``."""
    dist = getattr(ep, "dist", None)
    return getattr(dist, "name", None) or "a package"


def fingerprint(ep: EntryPoint) -> list:
    """What identifies an installed plugin's code without importing it: the entry point,
    its package and version, and its module file's size and modification time (an
    editable install changes those). A module Python cannot locate gives ``None`` there,
    which never matches a cached listing."""
    dist = getattr(ep, "dist", None)
    module = ep.value.split(":", 1)[0]
    try:
        spec = importlib.util.find_spec(module)
        origin = spec.origin if spec is not None else None
        stat = os.stat(origin) if origin else None
    except (ImportError, ValueError, OSError):
        stat = None
    file = [stat.st_size, stat.st_mtime_ns] if stat is not None else None
    return [ep.name, ep.value, package(ep), getattr(dist, "version", None), file]
