"""Someone else's Ray on the machine: a head started with ``ray start --head`` (as on a
shared lab server), found both ways Ray finds a cluster (``RAY_ADDRESS``, and the
``ray_current_cluster`` file ``ray start`` leaves). The ``ray`` and ``flower`` executors
start a Ray of their own beside it and give the sequential numbers; a recipe joins it only
when ``engine.address`` says so. The foreign head outlives the runs, the runs leave
nothing behind, and the test ends only the processes it started."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_all_end, free_port, raylet_driver

from fedkit.config.schema import EngineConfig
from fedkit.core.ray_executor import init_options
from fedkit.core.ray_reaper import _psutil, kill
from fedkit.rundir import logs

pytestmark = pytest.mark.slow  # a Ray head of its own, started with `ray start`

pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'fedkit-fl[ray]')")

RAY = Path(sys.executable).parent / "ray"
TAG = "FEDKIT_FOREIGN_RAY_TEST"
"""An environment variable every process of the test carries (Ray's processes inherit
it): ``foreign`` for the head and its workers, ``run`` for fedkit's runs and theirs."""

TINY = [  # the quickstart at the tests' tiny size: 3 clients, 1 round, 16×16 digits
    "backbone.name=test_resnet",
    "data.image_size=16",
    "data.num_clients=3",
    "data.max_train=300",
    "data.local_test_size=20",
    "federation.rounds=1",
    "federation.clients_per_round=3",
    "federation.local_epochs=1",
    "engine.workers=1",
    "device=cpu",
]


@dataclass
class Head:
    """The foreign head: its address, Ray's temp folder and the environment it runs in."""

    address: str
    temp: Path
    env: dict[str, str]
    core: list[Any]


def tagged(value: str) -> list[Any]:
    """The processes on the machine whose environment has ``TAG=value``."""
    psutil, found = _psutil(), []
    for process in psutil.process_iter():
        try:
            if process.environ().get(TAG) == value:
                found.append(process)
        except psutil.Error:
            continue
    return found


def end(processes: list[Any]) -> None:
    """SIGTERM, then SIGKILL after five seconds."""
    psutil = _psutil()
    for process in processes:
        try:
            process.terminate()
        except psutil.Error:
            continue
    _, left = psutil.wait_procs(processes, timeout=5)
    kill(left)


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    """A head on 127.0.0.1 with 1 CPU and no dashboard, in a Ray temp folder of its own
    (``RAY_TMPDIR``, short: Ray's socket paths have a length limit), so that neither its
    ``ray_current_cluster`` file nor its sessions meet other tests' Ray. Ended by its
    processes (``ray stop`` would end every Ray of this user on the machine)."""
    temp = Path(tempfile.mkdtemp(prefix="fr", dir="/tmp"))
    env = {**os.environ, "RAY_TMPDIR": str(temp), "OMP_NUM_THREADS": "1", TAG: "foreign"}
    env.pop("RAY_ADDRESS", None)
    env["RAY_AUTH_MODE"] = "disabled"  # not on whether ~/.ray holds a token (Ray 2.5x+)
    port = free_port()
    command = [str(RAY), "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}"]
    command += ["--num-cpus=1", "--include-dashboard=false", "--disable-usage-stats"]
    try:
        started = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
        assert started.returncode == 0, started.stdout + started.stderr
        # the address as Ray wrote it down (Ray may put the machine's IP for 127.0.0.1)
        address = (temp / "ray" / "ray_current_cluster").read_text().strip()
        assert address.endswith(f":{port}"), address
        core = [p for p in tagged("foreign") if any(n in p.name() for n in ("gcs", "raylet"))]
        assert len(core) >= 2, core
        yield Head(address, temp, env, core)
    finally:
        end(tagged("foreign") + tagged("run"))
        shutil.rmtree(temp, ignore_errors=True)


def sessions(head: Head) -> set[str]:
    """The Ray sessions started in the head's temp folder (each ``ray.init`` that starts
    a Ray adds one; joining a cluster adds none)."""
    return {p.name for p in (head.temp / "ray").glob("session_2*")}


def fedkit_run(head: Head, out: Path, *args: str, own: bool = True) -> list[dict]:
    """``fedkit run quickstart`` (tiny) where the foreign head is the cluster Ray would
    find (``RAY_ADDRESS`` and its ``ray_current_cluster``); the metrics rows. It must exit
    0, start a Ray of its own or not (``own``), and leave none of its processes behind."""
    before = sessions(head)
    env = {**head.env, "RAY_ADDRESS": head.address, TAG: "run"}
    command = [sys.executable, "-m", "fedkit", "run", "quickstart", "--out", str(out), "-q"]
    for setting in [*TINY, *args]:
        command += ["--set", setting]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    _, left = _psutil().wait_procs(tagged("run"), timeout=60)  # a loaded machine is slow
    assert left == [], [(p.pid, p.name()) for p in left]
    assert len(sessions(head) - before) == (1 if own else 0), args
    return logs.read_metrics(out)


def alive(head: Head) -> None:
    """The foreign head's GCS server and raylet still run, and it answers ``ray status``."""
    assert all(p.is_running() for p in head.core), head.core
    status = [str(RAY), "status", f"--address={head.address}"]
    answer = subprocess.run(status, env=head.env, capture_output=True, text=True, timeout=120)
    assert answer.returncode == 0, answer.stdout + answer.stderr


def test_without_an_address_a_run_starts_a_ray_of_its_own(monkeypatch):
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    own = init_options(EngineConfig(num_cpus=1.5, num_gpus=0.5), workers=2)
    nice = {"_system_config": {"worker_niceness": 0}}  # decision 0028
    assert own == {
        "address": "local",
        "include_dashboard": False,
        "num_cpus": 3,
        "num_gpus": 1,
        **nice,
    }
    monkeypatch.setenv("RAY_worker_niceness", "15")  # the user's word decides
    assert "_system_config" not in init_options(EngineConfig(), workers=1)
    joined = init_options(EngineConfig(address="auto", num_cpus=2), workers=4)
    assert joined == {"address": "auto"}  # the cluster's owner chose its size


@pytest.mark.skipif(sys.platform != "linux", reason="reads the process table's environments")
def test_ray_and_flower_runs_beside_a_foreign_cluster_match_sequential(head, tmp_path):
    pytest.importorskip("flwr", reason="the flower extra is not installed")
    plain = fedkit_run(head, tmp_path / "sequential", own=False)
    assert [row["clients"] for row in plain] == [[0, 1, 2]]
    for executor in ("ray", "flower"):
        rows = fedkit_run(head, tmp_path / executor, f"engine.executor={executor}")
        assert rows == plain, executor
        alive(head)


@pytest.mark.skipif(sys.platform == "win32", reason="the reaper reads a POSIX process table")
def test_the_reaper_spares_a_process_older_than_the_driver_whatever_it_names(tmp_path):
    """A Ray look-alike started before the driver, naming the very session the driver's
    raylet look-alike names: after SIGKILL of the driver, the raylet ends and the older
    process, someone else's, lives on."""
    session = "--session=/tmp/fake/session_2026-12-03_18-44-04_312757_4343"
    folder = tmp_path / "ray"
    folder.mkdir()
    (folder / "default_worker.py").write_text("import time\ntime.sleep(120)\n")
    raylet = "import os, sys, time\nsys.stdin.readline()\nprint(os.getpid(), flush=True)\n"
    (folder / "raylet").write_text(raylet + "time.sleep(120)\n")  # its "worker": itself
    older = subprocess.Popen([sys.executable, str(folder / "default_worker.py"), session])
    time.sleep(0.1)  # the driver starts strictly later
    driver, processes = raylet_driver(folder / "raylet", session)
    try:
        assert len(processes) == 3, "the driver did not start its look-alikes"
        assert_all_end(driver, processes[:2])  # the reaper and the raylet
        assert older.poll() is None
    finally:
        kill([*processes, _psutil().Process(older.pid)])
        older.wait(timeout=10)
