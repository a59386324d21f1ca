"""Generate ``docs/hooks.md`` from the hookspec docstrings: ``python -m fedkit.hookdocs``."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

from fedkit import PROJECT, hookspecs
from fedkit.plugins import hook_names

HEADER = """# Hook reference

Generated from `fedkit/hookspecs.py` by `python -m fedkit.hookdocs`; do not edit by hand
(a test checks this file matches the docstrings).

"""


def kind(name: str) -> str:
    if name in hookspecs.KEY_LEVEL_HOOKS:
        return "key-level (claims)"
    opts = getattr(getattr(hookspecs, name), f"{PROJECT}_spec")
    return "firstresult" if opts.get("firstresult") else "all"


def signature(name: str) -> str:
    return f"def {name}{inspect.signature(getattr(hookspecs, name))}".replace("'", "")


def render() -> str:
    """The whole reference page as markdown."""
    parts = [HEADER, inspect.getdoc(hookspecs) or "", "\n"]
    for name in hook_names():
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        head = f"\n## `{name}`\n\n*Kind:* {kind(name)}\n\n"
        parts.append(f"{head}```python\n{signature(name)}\n```\n")
        parts.append(f"\n{doc}\n")
    return "".join(parts)


def main() -> None:
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    if target is None:
        sys.stdout.write(render())
    else:
        target.write_text(render())


if __name__ == "__main__":
    main()
