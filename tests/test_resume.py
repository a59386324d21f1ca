"""Resuming: the helpers the kill tests share (a ``fedkit`` subprocess, the checkpointed
round) and the CLI's answers to a directory that cannot be resumed. The kill -9 tests
themselves: tests/test_scaffold.py (sequential executor, memory store, client tensors)
and tests/test_executors.py (Ray with the disk store, five seeded kills)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from typer.testing import CliRunner

from fedkit.cli.app import app


def fedkit(*args, wait=True):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fedkit", *args]
    if wait:
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def checkpoint_round(out):
    pointer = out / "checkpoints" / "latest.json"
    try:
        return json.loads(pointer.read_text())["round"]
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def test_resume_needs_a_run_directory(tmp_path):
    result = CliRunner().invoke(app, ["run", "--resume", str(tmp_path)])
    assert result.exit_code == 2
    assert "recipe.yaml" in result.output and "Traceback" not in result.output
