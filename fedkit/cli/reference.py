"""Generate ``docs/hooks.md`` from the hookspec docstrings: ``python -m fedkit.cli.reference``."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

from fedkit.plugin import hookspecs
from fedkit.plugin.manager import hook_kind, hook_names, hook_side

HEADER = """# Hook reference

Generated from `fedkit/hookspecs.py` by `python -m fedkit.cli.reference`; do not edit by hand
(a test checks this file matches the docstrings).

"""


def signature(name: str) -> str:
    return f"def {name}{inspect.signature(getattr(hookspecs, name))}".replace("'", "")


def summary() -> str:
    """A table of every hook: side and kind, in call order."""
    rows = ["| hook | side | kind |", "|---|---|---|"]
    rows += [f"| [`{n}`](#{n}) | {hook_side(n)} | {hook_kind(n)} |" for n in hook_names()]
    return "\n".join(rows) + "\n"


def render() -> str:
    """The whole reference page as markdown."""
    parts = [HEADER, inspect.getdoc(hookspecs) or "", "\n\n", summary(), "\n"]
    for name in hook_names():
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        head = f"\n## `{name}`\n\n*Side:* {hook_side(name)} · *Kind:* {hook_kind(name)}\n\n"
        parts.append(f"{head}```python\n{signature(name)}\n```\n")
        parts.append(f"\n{doc}\n")
    return "".join(parts)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].startswith("-"):
        sys.exit("usage: python -m fedkit.cli.reference [docs/hooks.md]  (no path: print the page)")
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    if target is None:
        sys.stdout.write(render())
    else:
        target.write_text(render())


if __name__ == "__main__":
    main()
