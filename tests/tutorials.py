"""How the tests execute tutorials: every line of a ```bash block that starts with
``fedkit`` is a command the reader is meant to run (``\\`` continuations joined,
environment variables expanded). Each tutorial test appends its own
tiny ``--set`` overrides so the commands finish in seconds on the digits data."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

from fedkit.cli.app import app

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


def runs_shrunk(settings: list[str]) -> Callable[[list[str]], list[str]]:
    """A ``shrink`` for ``run_tutorial``: each ``fedkit run`` gets ``settings`` and no
    report; other commands run as written."""

    def shrink(args: list[str]) -> list[str]:
        return [*with_settings(args, settings), "--no-report"] if args[0] == "run" else args

    return shrink


def metrics_rows(run: Path) -> list[dict]:
    """A run directory's metrics rows."""
    return [json.loads(line) for line in (run / "metrics.jsonl").open()]


def run_tutorial(
    page: Path,
    shrink: Callable[[list[str]], list[str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> list[tuple[list[str], Result]]:
    """Run a page's commands in order inside ``tmp_path``, each shrunk by ``shrink``; every one
    must exit 0. Returns (args, result) pairs."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    cmds = commands(page)
    assert any(c[0] == "run" for c in cmds), f"{page.name} has no `fedkit run` command"
    done = []
    for args in cmds:
        result = CliRunner().invoke(app, shrink(args), terminal_width=200)
        assert result.exit_code == 0, f"fedkit {' '.join(args)}\n{result.output}"
        done.append((args, result))
    return done


def snippet_output(page: Path) -> list[str]:
    """Run each ```python block of ``page`` in the current directory, as a reader would
    (in order, each in a fresh namespace), and return the lines they printed."""
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
    assert blocks, f"{page.name}: no ```python block"
    printed = io.StringIO()
    for block in blocks:
        with contextlib.redirect_stdout(printed):
            exec(compile(block, str(page), "exec"), {})  # noqa: S102 - the page's own code
    return printed.getvalue().splitlines()
