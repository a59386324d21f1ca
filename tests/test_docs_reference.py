"""The generated reference pages match the code, and the docs site builds in strict mode
(every page in the navigation, every link and anchor resolving)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fedkit.cli import reference

ROOT = Path(__file__).resolve().parent.parent
MKDOCS = Path(sys.executable).parent / "mkdocs"


@pytest.mark.parametrize("name", sorted(reference.PAGES))
def test_reference_page_is_generated_from_the_code(name):
    page = (ROOT / "docs" / name).read_text()
    assert page == reference.PAGES[name](), f"docs/{name} is stale: run make reference"


def test_cli_reference_lists_every_command_and_option():
    page = (ROOT / "docs" / "cli.md").read_text()
    for command in ("run", "validate", "eval", "plugins", "report", "compare", "new-plugin"):
        assert f"## `fedkit {command}`" in page
    assert "`--no-report`" in page and "`--json`" in page and "`--check`" in page


def test_recipe_reference_lists_keys_partitioners_and_plugin_options():
    page = (ROOT / "docs" / "recipe-reference.md").read_text()
    assert "| `federation.optimizer.lr` | `float` | `0.05` | > 0 |" in page
    assert "| `dirichlet` |" in page and "### `dapu`" in page
    assert "| `mu` | `float` | `0.4` | ≥ 0.0 |" in page  # dapu's option, from its Options


@pytest.mark.slow
@pytest.mark.skipif(not MKDOCS.exists(), reason="mkdocs is not installed (the docs extra)")
def test_docs_site_builds_in_strict_mode(tmp_path):
    result = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "site" / "cli" / "index.html").exists()
