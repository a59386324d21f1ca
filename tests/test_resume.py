"""Resuming: the CLI's answers to a directory that cannot be resumed. The helpers the kill
tests share (``run_fedkit``, ``checkpoint_round``, ``kill_after_checkpoint``) are in
tests/conftest.py; the kill -9 tests themselves: tests/test_scaffold.py (sequential
executor, memory store, client tensors) and tests/test_ray_faults.py (Ray with the disk
store, five seeded kills)."""

from __future__ import annotations

from typer.testing import CliRunner

from fedkit.cli.app import app


def test_resume_needs_a_run_directory(tmp_path):
    result = CliRunner().invoke(app, ["run", "--resume", str(tmp_path)])
    assert result.exit_code == 2
    assert "recipe.yaml" in result.output and "Traceback" not in result.output
