"""docs/tutorials/fedca.md runs as written, shrunk to tiny settings, with the convention
of ``test_tutorials_ssl``: its ``fedkit`` lines run through the CLI, shrunk by
``shrunk_ssl`` (tests/conftest.py); then its ```python blocks run in the same directory,
and what they print is checked against the run's partition."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import shrunk_ssl
from tutorials import run_tutorial, snippet_output

from fedkit.rundir.checkpoint import saved_part

pytestmark = pytest.mark.slow  # executes a tutorial end to end

PAGE = Path(__file__).resolve().parent.parent / "docs" / "tutorials" / "fedca.md"


def test_fedca_tutorial_runs_and_its_ledger_shows_the_uploaded_features(tmp_path, monkeypatch):
    done = run_tutorial(PAGE, shrunk_ssl, tmp_path, monkeypatch)
    assert [args[0] for args, _ in done] == ["plugins", "validate", "run", "eval"]
    outputs = {args[0]: result.output for args, result in done}
    assert "yes" in next(ln for ln in outputs["plugins"].splitlines() if "fedca" in ln)
    assert "'fedca' uploads data-derived" in outputs["run"]
    run = tmp_path / "runs" / "fedca-small"
    # the base encoder's features are kept by the core in the run's checkpoint
    assert set(saved_part(run, "", "fedca_base", "server")) == {"features"}

    printed = snippet_output(PAGE)
    dim = yaml.safe_load((run / "recipe.yaml").read_text())["plugins"][0]["options"]
    sent = {int(c): int(up) for c, up, _ in (ln.split() for ln in printed)}
    partition = json.loads((run / "partition.json").read_text())
    assert sent == {c["client"]: c["n_train"] * dim["projection_dim"] * 4 for c in partition}
