"""The last reliability edges under Ray: what a SIGKILL of the driver leaves behind, and a
short version of the chaos soak (benchmarks/chaos_soak.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import assert_all_end, benchmark_script, raylet_driver

from fedkit.config.schema import validate
from fedkit.core import runs
from fedkit.core.ray_reaper import _psutil, is_ray, kill


def test_ray_processes_are_recognised_by_their_command_line():
    assert is_ray(["ray::DashboardAgent"]) and is_ray(["ray::ClientActor.run"])
    assert is_ray(["/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet", "-x"])
    assert not is_ray(["sleep", "60"]) and not is_ray(["/usr/bin/python3", "-m", "array"])


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="the reaper reads a POSIX process table")
def test_a_sigkilled_driver_takes_its_ray_processes_with_it_and_nothing_else(tmp_path):
    """A driver that starts the reaper, then one process that looks like Ray's (a program
    under a ``ray`` folder) and one that does not; after SIGKILL of the driver, the first
    ends within seconds and the second lives on."""
    fake = tmp_path / "ray" / "raylet"
    fake.parent.mkdir()
    fake.write_text("import time\ntime.sleep(120)\n")
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        from fedkit.core import ray_reaper
        reaper = ray_reaper.watch()
        looks = subprocess.Popen([sys.executable, {str(fake)!r}])
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print(reaper.pid, looks.pid, other.pid, flush=True)
        time.sleep(120)
    """)
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    psutil = _psutil()
    reaper, looks, other = (psutil.Process(int(p)) for p in driver.stdout.readline().split())
    try:
        time.sleep(1.5)  # the reaper notes the driver's Ray processes twice a second
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        _, alive = psutil.wait_procs([looks, reaper], timeout=15)
        assert alive == [], alive
        assert other.is_running()
    finally:
        kill([looks, other, reaper])


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="the reaper reads a POSIX process table")
@pytest.mark.parametrize("looks", ["ray", "plain"])
def test_a_worker_started_just_before_the_driver_dies_is_ended_too(tmp_path, looks):
    """A raylet look-alike the reaper has seen starts a worker; the driver dies by SIGKILL
    a moment later, before the reaper's next look: the worker ends with the rest (the CI
    run that found this left a freshly restarted actor behind), whether its command line
    looks like Ray's or not (a worker still inside exec reads an empty one; CI's reaper
    missed such a worker about once in five runs under load)."""
    folder = tmp_path / "ray"
    folder.mkdir()
    (folder / "worker").write_text("import time\ntime.sleep(120)\n")
    worker = {"ray": [str(folder / "worker")], "plain": ["-c", "import time; time.sleep(120)"]}
    (folder / "raylet").write_text(
        textwrap.dedent(f"""
            import subprocess, sys, time
            sys.stdin.readline()
            worker = subprocess.Popen([sys.executable, *{worker[looks]!r}])
            print(worker.pid, flush=True)
            time.sleep(120)
        """)
    )
    driver, processes = raylet_driver(folder / "raylet")
    try:
        assert len(processes) == 3, "the driver did not start its look-alikes"
        assert_all_end(driver, processes)
    finally:
        kill(processes)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="the reaper reads a POSIX process table")
def test_a_child_that_becomes_a_ray_process_after_the_reaper_first_saw_it_is_ended(tmp_path):
    """A child the reaper first sees with a plain command line (as a process between fork
    and exec shows its parent's), which then execs a Ray look-alike: after SIGKILL of the
    driver it ends too (a short soak in CI once left one Ray process behind)."""
    fake = tmp_path / "ray" / "gcs_server"
    fake.parent.mkdir()
    fake.write_text("import time\ntime.sleep(120)\n")
    late = "import os, sys, time; time.sleep(1.5); "
    late += "os.execv(sys.executable, ['python', os.environ['LATE']])"
    script = textwrap.dedent(f"""
        import os, signal, subprocess, sys, time
        from fedkit.core import ray_reaper
        reaper = ray_reaper.watch()
        env = {{**os.environ, "LATE": {str(fake)!r}}}  # the path stays out of its command line
        child = subprocess.Popen([sys.executable, "-c", {late!r}], env=env)
        print(reaper.pid, child.pid, flush=True)
        time.sleep(3.0)  # the reaper looked while the child was plain, and after its exec
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    psutil = _psutil()
    processes = [psutil.Process(int(p)) for p in driver.stdout.readline().split()]
    try:
        assert_all_end(driver, processes)
    finally:
        kill(processes)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="the reaper reads a POSIX process table")
def test_a_worker_of_the_session_that_no_longer_descends_from_the_driver_is_ended(tmp_path):
    """A raylet look-alike naming a session starts a worker look-alike of that session
    through a parent that exits at once (so the worker no longer descends from the
    driver, as a worker whose raylet died first), just before the driver dies by SIGKILL:
    the worker ends too (a CI soak left such a ``default_worker.py`` behind)."""
    session = "--session=/tmp/fake/session_2026-12-03_18-44-04_312757_4242"
    folder = tmp_path / "ray"
    folder.mkdir()
    (folder / "default_worker.py").write_text("import time\ntime.sleep(120)\n")
    orphan = textwrap.dedent(f"""
        import subprocess, sys
        worker = subprocess.Popen([sys.executable, {str(folder / "default_worker.py")!r},
                                   {session!r}], start_new_session=True,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(worker.pid, flush=True)
    """)
    (folder / "raylet").write_text(
        textwrap.dedent(f"""
            import subprocess, sys, time
            sys.stdin.readline()
            out = subprocess.run([sys.executable, "-c", {orphan!r}], capture_output=True)
            print(out.stdout.decode().strip(), flush=True)
            time.sleep(120)
        """)
    )
    driver, processes = raylet_driver(folder / "raylet", session)
    try:
        assert len(processes) == 3, "the driver did not start its look-alikes"
        assert processes[2].ppid() != processes[1].pid  # the worker is not the raylet's child
        assert_all_end(driver, processes)
    finally:
        kill(processes)


@pytest.mark.slow
def test_chaos_soak_short_ends_identical_with_nothing_left(tmp_path):
    """Five rounds under Ray with a local cluster of the run's own, stopped three times
    (SIGKILL of a worker, of the driver, a SIGTERM), resumed after each; the 50-round soak
    with more stops is benchmarks/chaos_soak.py."""
    pytest.importorskip("ray", reason="the ray extra is not installed")
    chaos_soak = benchmark_script("chaos_soak")
    raw = chaos_soak.recipe(5)
    full, soaked = tmp_path / "full", tmp_path / "soaked"
    runs.execute(runs.start(validate(raw), full), full)
    raw["engine"] = {"executor": "ray", "workers": 1, "store": "disk"}
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(raw))
    result = chaos_soak.soak(path, soaked, seed=0, events=3, rounds=5)
    assert result["stops"]["driver-kill"] == 1 and result["stops"]["sigterm"] == 1
    assert 143 in result["driver_exits"]
    assert result["leftover_processes"] == 0, result["leftovers"]
    assert chaos_soak.same_end(soaked, full) == dict.fromkeys(
        ("metrics", "clients", "ledger", "pool"), True
    )
