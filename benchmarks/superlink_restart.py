"""A SuperLink restart in the middle of a deployed run, on 127.0.0.1: the nodes must
reconnect by themselves and the run must resume to the numbers of an uninterrupted
sequential run.

    python benchmarks/superlink_restart.py [--rounds 6] [--kill-after 2] [--keep]

It starts ``fedkit deploy superlink --insecure`` (in memory, no ``--database``) and three
``fedkit deploy node --insecure`` processes, each with its own ``--dir``, and submits the
tests' tiny digits recipe (3 clients, FedAvg + FedBN, so each client keeps its
normalisation layers on its node; a checkpoint every round) with
``fedkit deploy run ... --out restart``. Once the run directory holds the sealed
checkpoint of round ``--kill-after`` it sends SIGKILL to the SuperLink's process group,
waits for ``fedkit deploy run`` to exit (expected: 1, with a last line saying it lost the
SuperLink and how to resume), starts the SuperLink again on the same port at once and
times each node's reconnection (the second ``node N joined`` line in its log). Flower
starts ``flower-superexec`` in a session of its own and the ServerApp under it, so they
are outside that group: each stops once its parent is gone, and the script times how
long they outlive the SuperLink (FAIL after 60 s).

Once every node is back it runs the same ``fedkit deploy run`` again, which must resume
from the newest checkpoint (the nodes take back what their clients kept) and finish with
exit 0; then the recipe under ``fedkit run`` (the sequential executor). The two run
directories must agree: metrics rows, per-client rows, the ledger and the final model
pool. Prints PASS or FAIL with the timings; exit 1 on FAIL. Every process it starts is
ended (by process group) before it returns; ``--keep`` keeps its temporary folder (the
logs), which is also kept on FAIL.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch loads (fedkit.testing imports it)

import argparse
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import yaml

from fedkit.rundir import checkpoint, logs
from fedkit.testing import tiny_recipe

BIN = Path(sys.executable).parent
CLIENTS = 3


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the SuperLink, and its restart)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """A process in a session (and process group) of its own, its output in ``log``."""
    return subprocess.Popen(
        command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to each running process group, then wait (SIGKILL after 20 s)."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        os.killpg(proc.pid, signal.SIGTERM)
    for proc in running:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def processes() -> dict[int, tuple[int, int, str]]:
    """Every live process: pid → (parent pid, process group, command line)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields[0] != "Z":
            found[int(entry.name)] = (int(fields[1]), int(fields[2]), line.strip())
    return found


def descendants(pid: int) -> dict[int, tuple[int, int, str]]:
    """The live processes below ``pid``, with their parent, group and command line."""
    table, below, todo = processes(), {}, [pid]
    while todo:
        parent = todo.pop()
        for child, info in table.items():
            if info[0] == parent and child not in below:
                below[child] = info
                todo.append(child)
    return below


def group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    return [pid for pid, (_, group, _) in processes().items() if group == pgid]


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return pid in processes()  # not a zombie


def watch_ends(pids: dict[int, object], since: float, ended: dict[int, float]) -> None:
    """Note in ``ended`` the seconds after ``since`` at which each of ``pids`` ended
    (watching for 60 s at most)."""
    while len(ended) < len(pids) and time.monotonic() - since < 60:
        for pid in pids:
            if pid not in ended and not alive(pid):
                ended[pid] = time.monotonic() - since
        time.sleep(0.05)


def wait_port(port: int, seconds: float = 120) -> None:
    """Return once something accepts connections on 127.0.0.1:``port``."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listens on 127.0.0.1:{port}") from None
            time.sleep(0.1)


def joins(log: Path, port: int) -> int:
    """How many times the node whose log is ``log`` joined the SuperLink."""
    text = log.read_text() if log.exists() else ""
    return len(re.findall(rf"^node \d+ joined 127\.0\.0\.1:{port}\b", text, re.M))


def last_line(text: str) -> str:
    """The last line of ``text`` that is not blank."""
    return next((line for line in reversed(text.splitlines()) if line.strip()), "")


def sealed_rounds(out: Path) -> list[int]:
    """The rounds of the run directory's sealed checkpoints."""
    return sorted(
        int(match.group(1))
        for folder in checkpoint.folders(out)
        if (match := checkpoint.FOLDER.match(folder.name))
    )


def same_runs(a: Path, b: Path) -> dict[str, bool]:
    """Which of the two run directories' records agree."""
    pools = [checkpoint.read(o).pool for o in (a, b)]  # type: ignore[union-attr]
    pool = pools[0].keys() == pools[1].keys() and all(
        pools[0][k].keys() == pools[1][k].keys()
        and all(torch.equal(pools[0][k][t], pools[1][k][t]) for t in pools[0][k])
        for k in pools[0]
    )
    return {
        "metrics": logs.read_metrics(a) == logs.read_metrics(b),
        "clients": logs.read_clients(a) == logs.read_clients(b),
        "ledger": logs.read_ledger(a) == logs.read_ledger(b),
        "pool": pool,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--kill-after", type=int, default=2, help="the checkpoint to wait for")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fedkit-superlink-restart-"))
    runs_dir = tmp / "server"
    runs_dir.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLWR_TELEMETRY_ENABLED": "0"}
    env.update(FLWR_HOME=str(tmp / "flwr"), FEDKIT_REPORT="0")
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    raw = tiny_recipe(
        federation={"rounds": args.rounds, "clients_per_round": CLIENTS},
        plugins=["fedavg", "fedbn"],
        engine={"checkpoint_every": 1},
    )
    recipe = tmp / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    port = free_port()
    address = f"127.0.0.1:{port}"
    superlink = [
        str(BIN / "fedkit"), "deploy", "superlink", "--insecure", "--runs", str(runs_dir),
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    submit = [
        str(BIN / "fedkit"), "deploy", "run", str(recipe), "--superlink", address,
        "--out", "restart", "--insecure",
    ]  # fmt: skip
    out = runs_dir / "restart"
    node_logs = [tmp / f"node{k}.log" for k in range(CLIENTS)]
    procs: list[subprocess.Popen] = []  # [SuperLink, node 0..2, later ones]
    failures: list[str] = []
    figures: dict[str, object] = {}
    orphans: dict[int, tuple[int, int, str]] = {}  # the SuperLink's children, in other groups
    try:
        procs.append(start(superlink, tmp / "superlink.log", env))
        for k in range(CLIENTS):
            node = [
                str(BIN / "fedkit"), "deploy", "node", "--superlink", address,
                "--partition", str(k), "--dir", str(tmp / f"node{k}"), "--insecure",
            ]  # fmt: skip
            procs.append(start(node, node_logs[k], env))
        wait_port(port)
        began = time.monotonic()
        first = subprocess.Popen(
            submit, env=env, stdout=(tmp / "run1.out").open("w"),
            stderr=(tmp / "run1.err").open("w"), start_new_session=True,
        )  # fmt: skip
        procs.append(first)
        while args.kill_after not in sealed_rounds(out):
            if first.poll() is not None:
                raise RuntimeError(
                    f"fedkit deploy run exited {first.returncode} before checkpoint "
                    f"{args.kill_after}:\n{(tmp / 'run1.out').read_text()[-3000:]}"
                    f"{(tmp / 'run1.err').read_text()[-2000:]}"
                )
            if time.monotonic() - began > 600:
                raise RuntimeError(f"no checkpoint of round {args.kill_after} after 600 s")
            time.sleep(0.05)
        print(f"checkpoint of round {args.kill_after} after {time.monotonic() - began:.1f} s")

        # kill -9 the SuperLink's process group. Flower starts flower-superexec in a
        # session of its own, and the ServerApp under it; each watches its parent's pid
        # and stops when that is gone: a thread times how long they outlive the SuperLink
        # while the script goes on as an operator would (restart at once, resubmit).
        killed_group = procs[0].pid
        below = descendants(killed_group)
        orphans.update(below)
        apps = [pid for pid, (_, _, line) in below.items() if "flwr-serverapp" in line]
        os.killpg(procs[0].pid, signal.SIGKILL)
        killed = time.monotonic()
        procs[0].wait()
        ended: dict[int, float] = {}
        watcher = threading.Thread(target=watch_ends, args=(below, killed, ended), daemon=True)
        watcher.start()
        try:
            first.wait(timeout=180)
        except subprocess.TimeoutExpired:
            failures.append("fedkit deploy run did not exit within 180 s of the kill")
            os.killpg(first.pid, signal.SIGTERM)
            first.wait(timeout=30)
        figures["fedkit deploy run exited after the kill (s)"] = round(time.monotonic() - killed, 1)
        said = last_line((tmp / "run1.err").read_text())
        print(f"fedkit deploy run: exit {first.returncode}, {said}")
        if first.returncode != 1 or "lost the SuperLink" not in said or "resume" not in said:
            failures.append(f"fedkit deploy run exited {first.returncode}: {said!r}")
        if not apps:
            failures.append("no ServerApp process (flwr-serverapp) under the SuperLink")

        # the same SuperLink, on the same port; each node must join it again by itself
        restarted = time.monotonic()
        procs[0] = start(superlink, tmp / "superlink-restarted.log", env)
        wait_port(port)
        back: dict[int, float] = {}
        while len(back) < CLIENTS and time.monotonic() - restarted < 360:
            for k in range(CLIENTS):
                if k not in back and joins(node_logs[k], port) >= 2:
                    back[k] = time.monotonic()
                if procs[1 + k].poll() is not None:
                    failures.append(f"node {k} exited {procs[1 + k].returncode}")
                    back.setdefault(k, float("nan"))
            time.sleep(0.05)
        for k in range(CLIENTS):
            if k not in back:
                failures.append(f"node {k} did not join the restarted SuperLink within 360 s")
        figures["SuperLink started again after the kill (s)"] = round(restarted - killed, 1)
        figures["nodes 0, 1, 2 back after the kill (s)"] = [
            round(back[k] - killed, 1) for k in sorted(back)
        ]
        figures["nodes 0, 1, 2 back after the restart (s)"] = [
            round(back[k] - restarted, 1) for k in sorted(back)
        ]
        for k in range(CLIENTS):
            text = node_logs[k].read_text()
            if "no longer knows this node" not in text or "Traceback" in text:
                failures.append(f"node {k}'s log does not show a clean rejoin: {text[-800:]}")

        # the same command again: it resumes from the newest checkpoint and finishes
        newest = max(sealed_rounds(out))
        began = time.monotonic()
        figures["resume submitted after the kill (s)"] = round(began - killed, 1)
        second = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=600)
        figures["resume wall time (s)"] = round(time.monotonic() - began, 1)
        figures["resumed from checkpoint of round"] = newest
        (tmp / "run2.out").write_text(second.stdout + second.stderr)
        said = [line for line in second.stdout.splitlines() if line.startswith("run directory")]
        print(f"fedkit deploy run again: exit {second.returncode}; " + "; ".join(said))
        if second.returncode != 0:
            failures.append(f"the resume exited {second.returncode}: {second.stderr[-2000:]}")
        if "resuming its newest checkpoint" not in second.stdout:
            failures.append("the second fedkit deploy run did not resume")

        watcher.join(timeout=max(0.0, 60 - (time.monotonic() - killed)))
        for pid, (_, group, line) in below.items():
            words = [w.rsplit("/", 1)[-1] for w in line.split()]
            name = next((w for w in words if w.startswith(("flower-", "flwr-"))), line[:40])
            grouped = "in" if group == killed_group else "not in"
            when = f"ended {ended[pid]:.1f} s after the kill" if pid in ended else "still runs"
            print(f"  {name} ({pid}), {grouped} the SuperLink's process group: {when}")
            figures[f"{name} ended after the kill (s)"] = round(ended.get(pid, float("nan")), 1)
        if len(ended) < len(below):
            failures.append(f"processes outlived the SuperLink by 60 s: {set(below) - set(ended)}")

        # the sequential executor, uninterrupted
        sequential = tmp / "sequential"
        began = time.monotonic()
        done = subprocess.run(
            [str(BIN / "fedkit"), "run", str(recipe), "--out", str(sequential), "-q"],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        figures["sequential run (s)"] = round(time.monotonic() - began, 1)
        if done.returncode != 0:
            failures.append(f"fedkit run exited {done.returncode}: {done.stderr[-2000:]}")
        elif second.returncode == 0:
            same = same_runs(out, sequential)
            figures["same as sequential"] = same
            rounds = [row["round"] for row in logs.read_metrics(out)]
            figures["resumed run's rounds"] = rounds
            if not all(same.values()) or rounds != list(range(1, args.rounds + 1)):
                failures.append(f"the resumed run differs from the sequential one: {same}")
    except Exception as error:  # noqa: BLE001 - reported as FAIL, processes still ended
        failures.append(f"{type(error).__name__}: {error}")
    finally:
        stop(procs[1:])  # the nodes and runs first, so none is left asking a gone SuperLink
        stop(procs[:1])
        time.sleep(0.5)
        left = [pid for proc in procs for pid in group_members(proc.pid)]
        left += [pid for pid in orphans if alive(pid) and pid not in left]
        if left:
            failures.append(f"processes left behind: {left}")
            for pid in left:
                os.kill(pid, signal.SIGKILL)
    for name, value in figures.items():
        print(f"{name}: {value}")
    if args.keep or failures:
        print(f"files: {tmp}")
    if not args.keep and not failures:
        shutil.rmtree(tmp, ignore_errors=True)
    if failures:
        print("FAIL")
        for line in failures:
            print(f"- {line}")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
