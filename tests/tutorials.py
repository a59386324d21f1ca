"""How the tests execute tutorials: every line of a ```bash block that starts with
``fedkit`` is a command the reader is meant to run (``\\`` continuations joined,
environment variables such as ``$CIFAR10`` expanded). Each tutorial test appends its own
tiny ``--set`` overrides so the commands finish in seconds on the digits data."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

TUTORIALS = Path(__file__).resolve().parent.parent / "docs" / "tutorials"


def commands(page: Path) -> list[list[str]]:
    """The ``fedkit`` command lines of a page's ```bash blocks, as argument lists."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = os.path.expandvars(line.strip())
            if line.startswith("fedkit "):
                found.append(shlex.split(line)[1:])
    return found


def with_settings(args: list[str], settings: list[str]) -> list[str]:
    """``args`` followed by ``--set`` for each setting."""
    return [*args, *(x for item in settings for x in ("--set", item))]
