"""Issue 52's two measurements of the virtual clock, in one script run.

    OMP_NUM_THREADS=1 python benchmarks/systems.py [--parts clock published] \
        [--clock-rounds 2] [--repeats 3] [--sync-rounds 12] [--async-steps 20] \
        [--work DIR]

``clock``: the cost of the clock. The quickstart (``recipes/quickstart.yaml``: 10 clients,
all of them every round, ``--clock-rounds`` rounds, evaluation off so that the rounds'
own work is the denominator) without ``systems:`` and with the clock on and nothing
dropped (``systems: {speed: {median: 100, sigma: 1.0}}``: lognormal devices, always
reachable, no deadline). Each side runs once as a warm-up, then the two take turns
``--repeats`` times (order swapped every repeat), each from a fresh, untimed ``prepare``;
the best time of each is reported with their ratio. Wall time on a shared machine varies
by more than the 3 % goal, so the script also times the clock's own work directly (every
call of ``Clock.sample``, ``Clock.reachable`` and ``Clock.settle``, which computes each
job's duration) and reports it as a share of the run.

``published``: synchronous FedAvg against FedBuff in virtual time to a target accuracy,
the comparison of Nguyen et al. (*Federated Learning with Buffered Asynchronous
Aggregation*, AISTATS 2022) and of FedScale PR #197 (FEMNIST: synchronous FedAvg 27,618
virtual seconds, FedBuff 18,913, a ratio of 0.68). It runs ``recipes/quickstart-deadline``
(``--sync-rounds`` rounds) and ``recipes/quickstart-async`` (``--async-steps`` steps) with
``fedkit run`` and prints ``fedkit compare --x virtual_time`` at the targets 0.90 and 0.94.
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedkit.cli.compare import compare_runs, markdown
from fedkit.config.schema import load_raw, validate
from fedkit.core import clock as clock_module
from fedkit.core.engine import prepare, rounds

ROOT = Path(__file__).resolve().parent.parent
CLOCK_ON = {"speed": {"median": 100, "sigma": 1.0}}
"""A clock that drops nothing: devices drawn per client, always reachable, no deadline."""
TIMED = ("sample", "reachable", "settle")
"""The ``Clock`` methods a synchronous round calls (``settle`` calls ``job_seconds``)."""


class ClockTimer:
    """Adds up the seconds spent in the clock's methods while it is installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.originals = {name: getattr(clock_module.Clock, name) for name in TIMED}

    def install(self) -> None:
        for name, original in self.originals.items():
            setattr(clock_module.Clock, name, self.wrapped(original))

    def remove(self) -> None:
        for name, original in self.originals.items():
            setattr(clock_module.Clock, name, original)

    def wrapped(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - began

        return timed


def quickstart(rounds_: int, systems: dict[str, Any] | None) -> dict[str, Any]:
    """The quickstart recipe for ``rounds_`` rounds, no evaluation, in memory."""
    raw = copy.deepcopy(load_raw(ROOT / "recipes" / "quickstart.yaml"))
    raw["federation"]["rounds"] = rounds_
    raw["evaluation"] = {"protocol": "none", "every": 0}
    raw["engine"] = {"executor": "sequential", "store": "memory"}
    if systems is not None:
        raw["systems"] = systems
    return raw


def timed_run(raw: dict[str, Any], timer: ClockTimer) -> tuple[float, float, int]:
    """One run's rounds (``prepare`` untimed): wall seconds, clock seconds, failures."""
    run = prepare(validate(raw))
    timer.seconds, failures = 0.0, 0
    began = time.perf_counter()
    for row in rounds(run):
        failures += len(row.get("failures", {}))
    wall = time.perf_counter() - began
    run.close()
    return wall, timer.seconds, failures


def clock_cost(rounds_: int, repeats: int) -> None:
    sides = {
        "without systems": quickstart(rounds_, None),
        "clock on": quickstart(rounds_, CLOCK_ON),
    }
    timer = ClockTimer()
    timer.install()
    walls: dict[str, list[float]] = {name: [] for name in sides}
    inside: list[float] = []
    try:
        for repeat in range(repeats + 1):  # pass 0 is a warm-up of each side
            order = list(sides.items()) if repeat % 2 else list(sides.items())[::-1]
            for name, raw in order:
                wall, seconds, failures = timed_run(raw, timer)
                assert failures == 0, f"{name}: {failures} failures; the clock must drop nothing"
                print(f"  pass {repeat} {name}: {wall:.2f} s (clock {seconds:.4f} s)", flush=True)
                if repeat:
                    walls[name].append(wall)
                    if name == "clock on":
                        inside.append(seconds / wall)
    finally:
        timer.remove()
    best = {name: min(values) for name, values in walls.items()}
    ratio = best["clock on"] / best["without systems"]
    print(f"\n### The cost of the clock (quickstart, {rounds_} rounds, best of {repeats})\n")
    print("| without `systems:` | clock on, nothing dropped | ratio | clock's own work |")
    print("|---|---|---|---|")
    share = max(inside)
    print(
        f"| {best['without systems']:.2f} s | {best['clock on']:.2f} s | {ratio:.3f} "
        f"| {share:.3%} of the run (largest of {repeats}) |",
        flush=True,
    )


def published(sync_rounds: int, async_steps: int, work: Path) -> None:
    fedkit = [str(Path(sys.executable).parent / "fedkit")]  # this environment's
    plan = {
        "sync": ("quickstart-deadline", sync_rounds),
        "fedbuff": ("quickstart-async", async_steps),
    }
    for name, (recipe, count) in plan.items():
        out = work / name
        command = [*fedkit, "run", recipe, "--out", str(out), "--no-report"]
        command += ["--set", f"federation.rounds={count}"]
        began = time.perf_counter()
        subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        print(f"  {name}: {time.perf_counter() - began:.0f} s wall", flush=True)
    tables, _, page = compare_runs(
        [work / "sync", work / "fedbuff"], work / "compare", x="virtual_time", targets=[0.9, 0.94]
    )
    print(f"\n### Synchronous FedAvg (deadline) against FedBuff, virtual time ({page})\n")
    for table in tables:
        print(markdown(table) + "\n", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["clock", "published"])
    parser.add_argument("--clock-rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sync-rounds", type=int, default=12)
    parser.add_argument("--async-steps", type=int, default=20)
    parser.add_argument("--work", type=Path, default=None, help="Run directories (default: temp)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    began = time.perf_counter()
    if "clock" in args.parts:
        clock_cost(args.clock_rounds, args.repeats)
    if "published" in args.parts:
        work = args.work or Path(tempfile.mkdtemp(prefix="fedkit-systems-"))
        published(args.sync_rounds, args.async_steps, work)
    print(f"total {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
