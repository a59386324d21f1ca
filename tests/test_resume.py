"""Resuming: the helpers the kill tests share (a ``fedkit`` subprocess, the checkpointed
round) and the CLI's answers to a directory that cannot be resumed. The kill -9 tests
themselves: tests/test_scaffold.py (sequential executor, memory store, client tensors)
and tests/test_executors.py (Ray with the disk store, five seeded kills)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

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


def kill_after_checkpoint(path, out, round: int) -> int:
    """Start ``fedkit run`` on ``path``, SIGKILL it once its checkpoint reached ``round``;
    the checkpointed round it stopped at."""
    proc = fedkit("run", str(path), "--out", str(out), wait=False)
    deadline = time.monotonic() + 240
    while checkpoint_round(out) < round:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return checkpoint_round(out)


def test_resume_needs_a_run_directory(tmp_path):
    result = CliRunner().invoke(app, ["run", "--resume", str(tmp_path)])
    assert result.exit_code == 2
    assert "recipe.yaml" in result.output and "Traceback" not in result.output
