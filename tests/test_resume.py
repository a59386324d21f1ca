"""A run killed with SIGKILL after round 2 of 5 and resumed ends exactly like an
uninterrupted run: identical metrics rows, per-client rows, ledger rows and identical
final weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import torch
from conftest import tiny_recipe
from safetensors.torch import load_file
from typer.testing import CliRunner

from fedkit import rundir
from fedkit.cli import app
from fedkit.logs import read_clients, read_ledger, read_metrics
from fedkit.recipe import validate

RECIPE = tiny_recipe(
    federation={"rounds": 5, "clients_per_round": 2},
    data={"num_clients": 4},
    engine={"checkpoint_every": 1},
)


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


def final_pool(out):
    pointer = json.loads((out / "checkpoints" / "latest.json").read_text())
    return load_file(out / "checkpoints" / pointer["folder"] / "pool.safetensors")


def test_sigkill_after_round_two_then_resume_matches(write_recipe, tmp_path):
    path = write_recipe(RECIPE)
    full, killed = tmp_path / "full", tmp_path / "killed"
    rundir.execute(rundir.start(validate(RECIPE), full), full)  # in-process: same numbers

    proc = fedkit("run", str(path), "--out", str(killed), wait=False)
    deadline = time.monotonic() + 240
    while checkpoint_round(killed) < 2:
        assert proc.poll() is None, "run ended before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    stopped_at = checkpoint_round(killed)
    assert 2 <= stopped_at < 5
    assert max(r["round"] for r in read_metrics(killed)) >= stopped_at

    resumed = fedkit("run", "--resume", str(killed))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming {killed} after round {stopped_at}" in resumed.stdout.replace("\n", "")
    assert read_metrics(killed) == read_metrics(full)
    assert read_clients(killed) == read_clients(full)
    assert [r["round"] for r in read_clients(full)] == [1, 2, 3, 4, 5]
    a, b = final_pool(full), final_pool(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ledger = read_ledger(full)
    assert read_ledger(killed) == ledger
    assert len(ledger) == 5 * 2  # one row per round and sampled client, none twice


def test_resume_needs_a_run_directory(tmp_path):
    result = CliRunner().invoke(app, ["run", "--resume", str(tmp_path)])
    assert result.exit_code == 2
    assert "recipe.yaml" in result.output and "Traceback" not in result.output
