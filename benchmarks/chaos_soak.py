"""Chaos soak: a long Ray run stopped again and again, resumed after each stop, must end
exactly where an uninterrupted run ends, with no process left behind.

    python benchmarks/chaos_soak.py [--rounds 50] [--events 15] [--seed 0] [--out DIR]

The run is SCAFFOLD (its clients keep control variates, so resume must restore client
memory) on the tests' tiny digits recipe, 5 clients of which 3 train each round, under
``engine.executor: ray`` with a local cluster of its own (no ``engine.address``) and the
disk store. A seeded plan draws ``--events`` stops, each at a random checkpointed round
plus a random fraction of a second, of three kinds:

- ``driver-kill``: SIGKILL of the run (``fedkit run`` itself), then ``--resume``;
- ``sigterm``: SIGTERM of the run, as a scheduler sends first, once the process has
  checkpointed a round of its own (a signal during start-up, before the handler is armed,
  ends Python by the signal); it must exit 143, then ``--resume``;
- ``worker-kill``: SIGKILL of one Ray worker process (a ``ray::ClientActor``); the run
  goes on by itself, the executor retrying the client on a fresh actor.

After every driver stop it waits up to 20 s for each Ray process the run had started to
end and counts the ones that do not (they are then killed, so the next count is fair).
At the end the run directory is compared with an uninterrupted sequential run of the same
recipe: metrics (less the ``retried`` and ``eval_retried`` traces a worker kill leaves),
per-client rows, the ledger and the final model pool. Prints one JSON line; exit 1 when
anything differs or a process was left. ``tests/test_chaos_soak.py`` runs a short version.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedkit.config.schema import validate
from fedkit.core import runs
from fedkit.core.ray_reaper import _psutil, is_ray, kill
from fedkit.rundir import checkpoint, logs
from fedkit.testing import tiny_recipe

KINDS = ("driver-kill", "sigterm", "worker-kill")
WAIT_S = 20.0
TRACES = ("retried", "eval_retried")  # what a worker kill adds to a row, nothing else


def recipe(rounds: int) -> dict[str, Any]:
    """The soak's recipe (see the module docstring)."""
    return tiny_recipe(
        data={"num_clients": 5, "max_train": 200},
        federation={
            "rounds": rounds,
            "clients_per_round": 3,
            "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.0},
        },
        plugins=["fedavg", "scaffold"],
    )


def checkpointed(out: Path) -> int:
    try:
        return json.loads((out / "checkpoints" / "latest.json").read_text())["round"]
    except (OSError, ValueError, KeyError):
        return 0


def start(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fedkit", "run", *args, "--quiet", "--no-report"]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def ray_processes(pid: int) -> list[Any]:
    """The Ray processes among ``pid``'s descendants."""
    psutil = _psutil()
    found = []
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    for child in children:
        try:
            if is_ray(child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


def left_behind(processes: list[Any], stop: str) -> list[str]:
    """Those of ``processes`` still running ``WAIT_S`` after their driver ended, as
    ``stop: command line`` (the survivors are then killed)."""
    psutil = _psutil()
    _, alive = psutil.wait_procs(processes, timeout=WAIT_S)
    found = []
    for process in alive:
        try:
            found.append(f"{stop}: {' '.join(process.cmdline())[:200]}")
        except psutil.Error:
            found.append(f"{stop}: pid {process.pid}")
    kill(alive)
    return found


def plan(seed: int, events: int, rounds: int) -> list[tuple[str, int, float]]:
    """``events`` stops: (kind, checkpointed round to wait for, extra seconds)."""
    rng = np.random.default_rng(seed)
    kinds = [KINDS[i % len(KINDS)] for i in rng.permutation(events)]
    targets = sorted(rng.integers(1, rounds, events).tolist())
    return list(zip(kinds, targets, rng.uniform(0, 0.6, events).tolist(), strict=True))


def soak(path: Path, out: Path, *, seed: int, events: int, rounds: int) -> dict[str, Any]:
    """Run ``path`` into ``out`` under the seeded plan of stops; what happened."""
    done = {kind: 0 for kind in KINDS}
    leftover, codes = list[str](), []
    proc, base = start([str(path), "--out", str(out)]), 0
    for kind, target, delay in plan(seed, events, rounds):
        if kind == "sigterm":  # once this process checkpointed a round: its handler is armed
            target = max(target, base + 1)
        deadline = time.monotonic() + 600
        while checkpointed(out) < target and proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"round {target} not checkpointed in 600 s")
            time.sleep(0.02)
        time.sleep(delay)
        if proc.poll() is not None:
            break
        ray = ray_processes(proc.pid)
        if kind == "worker-kill":
            workers = [p for p in ray if "ClientActor" in " ".join(p.cmdline())]
            if workers:
                workers[0].kill()
                done[kind] += 1
            continue
        proc.send_signal(signal.SIGTERM if kind == "sigterm" else signal.SIGKILL)
        code = proc.wait(timeout=300)
        codes.append(code)
        if kind == "sigterm" and code not in (143, 0):
            raise AssertionError(f"SIGTERM ended the run with exit {code}, not 143")
        done[kind] += 1
        leftover += left_behind(ray, kind)
        proc, base = start(["--resume", str(out)]), checkpointed(out)
    ray = ray_processes(proc.pid)
    code = proc.wait(timeout=1800)
    if code != 0:
        tail = proc.stderr.read().decode()[-2000:]
        raise AssertionError(f"the last resume exited {code}: {tail}")
    leftover += left_behind(ray, "end")
    return {
        "stops": done,
        "leftover_processes": len(leftover),
        "leftovers": leftover,
        "driver_exits": codes,
    }


def same_end(resumed: Path, full: Path) -> dict[str, bool]:
    """Which parts of the two run directories are identical."""

    def untraced(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in row.items() if k not in TRACES} for row in rows]

    a, b = (checkpoint.read(out).pool for out in (resumed, full))
    pools = a.keys() == b.keys() and all(
        x.keys() == y.keys() and all(bool((x[k] == y[k]).all()) for k in x)
        for c in a
        for x, y in [(a[c], b[c])]
    )
    return {
        "metrics": untraced(logs.read_metrics(resumed)) == untraced(logs.read_metrics(full)),
        "clients": logs.read_clients(resumed) == logs.read_clients(full),
        "ledger": logs.read_ledger(resumed) == logs.read_ledger(full),
        "pool": pools,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--events", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("runs/chaos-soak"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    raw = recipe(args.rounds)
    full, resumed = args.out / f"full-s{args.seed}", args.out / f"soaked-s{args.seed}"
    for folder in (full, resumed):
        if folder.exists():
            raise SystemExit(f"{folder} exists: choose another --out or remove it")
    began = time.monotonic()
    runs.execute(runs.start(validate(raw), full), full)
    raw["engine"] = {"executor": "ray", "workers": 1, "store": "disk"}
    path = args.out / f"recipe-s{args.seed}.yaml"
    path.write_text(json.dumps(raw))
    result = soak(path, resumed, seed=args.seed, events=args.events, rounds=args.rounds)
    result.update(
        rounds=args.rounds,
        seed=args.seed,
        identical=same_end(resumed, full),
        seconds=round(time.monotonic() - began, 1),
    )
    print(json.dumps(result))
    ok = all(result["identical"].values()) and result["leftover_processes"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
