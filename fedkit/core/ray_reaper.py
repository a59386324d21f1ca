"""The processes of a local Ray cluster end with the run that started them, even a run
killed by SIGKILL.

``ray.init()`` without an address starts a cluster whose processes are the driver's
children. A normal exit shuts it down, but after a SIGKILL of the driver Ray's own
monitoring leaves some behind (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``, still
alive minutes later). ``watch()`` starts a small reaper process, in a session of its own
so that a Ctrl-C or a scheduler's signal to the run's process group does not reach it. It
notes the Ray processes among the driver's descendants every half second and waits on a
pipe the driver holds; when the pipe closes (the executor's ``close``, or the kernel
closing it as the driver dies, however it dies) it ends every noted process still
running, every Ray process whose command line names the cluster's session (such a
worker whose raylet died first no longer descends from the driver), and every
descendant of these, whatever its command line (a worker a raylet spawned in the last
half second may still be inside exec, with an empty one). It stops them all with
SIGSTOP first, looking again until no new descendant appears, so that none can start
another meanwhile; then SIGTERM, and SIGKILL after three seconds. It only ever signals
processes of the driver's own Ray cluster, and psutil's checks keep a reused pid safe.

Another Ray on the machine (a cluster someone started with ``ray start``) is never
touched: the run watched starts a Ray instance of its own (the reaper runs only then),
the sessions come only from the driver's descendants, and a process that was running
before the driver started is never one of the driver's, whatever its command line says.
"""

from __future__ import annotations

import importlib.util
import os
import re
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

POLL_S = 0.5
GRACE_S = 3.0
SESSION = re.compile(r"session_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+_\d+")
"""A Ray session's name (its start time and the driver's pid), as in ``/tmp/ray/session_…``."""


def watch() -> subprocess.Popen | None:
    """Start the reaper of the Ray processes this process is about to start. Close its
    stdin (``stop``) once Ray is shut down; ``None`` where there is no /proc-style process
    table to read (not POSIX)."""
    if os.name != "posix":
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "fedkit.core.ray_reaper", str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def stop(reaper: subprocess.Popen | None, timeout: float = 10.0) -> None:
    """Tell the reaper the driver is done with Ray, and wait until it has ended what
    remained."""
    if reaper is None:
        return
    try:
        if reaper.stdin is not None:
            reaper.stdin.close()
        reaper.wait(timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        pass


def _psutil() -> Any:
    """psutil: installed, or the copy Ray ships in ``ray/thirdparty_files``."""
    try:
        import psutil
    except ImportError:
        spec = importlib.util.find_spec("ray")
        if spec is None or not spec.submodule_search_locations:
            raise
        sys.path.insert(0, str(Path(list(spec.submodule_search_locations)[0]) / "thirdparty_files"))
        import psutil
    return psutil


def is_ray(command: list[str]) -> bool:
    """Whether a command line is one of Ray's processes (a worker renamed ``ray::…``, or
    a program or script inside the ray package)."""
    line = " ".join(command)
    return line.startswith("ray::") or f"{os.sep}ray{os.sep}" in line


def main(argv: list[str]) -> None:
    psutil = _psutil()
    try:
        driver = psutil.Process(int(argv[0]))
    except psutil.NoSuchProcess:
        return
    checked, noted = {os.getpid()}, {}  # checked: this reaper, and every process noted
    sessions: set[str] = set()
    while True:
        _note_ray(psutil, _descendants(psutil, driver), checked, noted, sessions)
        ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break
    _note_ray(psutil, _of_sessions(psutil, sessions, driver.create_time()), checked, noted)
    _end(psutil, _freeze(psutil, list(noted.values())))


def _freeze(psutil: Any, processes: list[Any]) -> list[Any]:
    """SIGSTOP ``processes`` and all their descendants, found again until no new one
    appears: a stopped process cannot start another, and every child it has is found
    whatever its command line shows (a worker caught mid-exec reads an empty one)."""
    stopped: dict[int, Any] = {}
    todo = processes
    while todo:
        for process in todo:
            try:
                process.suspend()
                stopped[process.pid] = process
            except psutil.Error:
                continue
        found = [child for process in todo for child in _descendants(psutil, process)]
        todo = [child for child in found if child.pid not in stopped]
    return list(stopped.values())


def _end(psutil: Any, processes: list[Any]) -> None:
    """SIGTERM then SIGCONT each of ``processes`` (stopped), and SIGKILL those still
    running ``GRACE_S`` later."""
    alive = []
    for process in processes:
        try:
            process.terminate()
            process.resume()
            alive.append(process)
        except psutil.Error:
            continue
    _, left = psutil.wait_procs(alive, timeout=GRACE_S)
    kill(left)


def _note_ray(
    psutil: Any,
    processes: list[Any],
    checked: set[int],
    noted: dict,
    sessions: set[str] | None = None,
) -> None:
    """Add the Ray processes among ``processes`` not noted before to ``noted``, and the
    sessions their command lines name to ``sessions``. Any other process is looked at
    again next time: a child caught between fork and exec still shows its parent's
    command line (Ray starts its raylet and GCS server that way)."""
    for process in processes:
        if process.pid in checked:
            continue
        try:
            line = process.cmdline()
            if is_ray(line):
                noted[process.pid] = process
                checked.add(process.pid)
                if sessions is not None:
                    sessions.update(SESSION.findall(" ".join(line)))
        except psutil.Error:
            continue


def _of_sessions(psutil: Any, sessions: set[str], since: float) -> list[Any]:
    """Every process on the machine started at or after ``since`` (the driver's start)
    whose command line names one of ``sessions``: an older one belongs to someone else."""
    found = []
    for process in psutil.process_iter() if sessions else ():
        try:
            line = " ".join(process.cmdline())
            if process.create_time() < since:
                continue
        except psutil.Error:
            continue
        if any(session in line for session in sessions):
            found.append(process)
    return found


def _descendants(psutil: Any, process: Any) -> list[Any]:
    try:
        return process.children(recursive=True)
    except psutil.Error:
        return []


def kill(processes: list[Any]) -> None:
    """SIGKILL each of ``processes`` (psutil ones) that is still there."""
    psutil = _psutil()
    for process in processes:
        try:
            process.kill()
        except psutil.Error:
            continue


if __name__ == "__main__":
    main(sys.argv[1:])
