"""A week-long availability trace of 136,000 synthetic users, replayed (issue 52).

    OMP_NUM_THREADS=1 python benchmarks/trace_replay.py [--users 1360 13600 136000] \
        [--rounds 5] [--work DIR]

FedScale's real traces (``client_behave_trace``, ``client_device_capacity``) are pickles,
which fedkit never loads, and they are not available offline. This script writes a trace
of the same shape in fedkit's documented formats (docs/systems.md, "Files"): a week
(period 604,800 s) of availability windows per user, diurnal (sessions start mostly in
the evening and at night, in each user's own time zone), many short sessions (lognormal
lengths, median 10 minutes) and heavy tails (sessions per day lognormal across users, a
few users online for hours), plus a devices file with a row per user (FedScale's units
converted as docs/systems.md says: a lognormal ``computation`` in ms per sample, times
3 per training sample, and a lognormal bandwidth).

Then, for each population size (by default 1,360, 13,600 and 136,000 users: the first N
users of the one trace, so the smaller traces are prefixes of the large one), each in a
fresh child process so peak memory is its own:

* ``load``: reading the trace as a run does (``availability.build``): seconds and the
  peak resident memory it added;
* ``replay``: the quickstart recipe (``recipes/quickstart.yaml``: digits, test_convnext,
  10 clients a round, 2 local epochs) with as many registered clients as users
  (partition ``sampled``, 50 images each), ``availability: trace``, the devices file and
  over-selection 1.3, for ``--rounds`` rounds without evaluation. It times every call of
  ``Clock.sample`` (the round's sampling among reachable clients) and counts the sampled
  clients whose window closed before their job ended (``unavailable: left at ...``).

The tables go to stdout (markdown), as benchmarks/README.md quotes them.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WEEK = 7 * 86400.0
DAY = 86400.0


def mb(kib: float) -> float:
    """``ru_maxrss`` (KiB on Linux) in MB."""
    return kib * 1024 / 1e6


def rss_kib() -> int:
    """The current resident set of this process, in KiB (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


# The trace -------------------------------------------------------------------------------


def local_hours(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` session start times of day (hours, local), with density proportional to
    1 + 0.9 cos(2π (h - 22) / 24): most at night, fewest late in the morning (phones
    idle, charging and on Wi-Fi, as FedScale's behaviour traces show)."""
    grid = np.linspace(0.0, 24.0, 24 * 60 + 1)
    density = 1 + 0.9 * np.cos(2 * np.pi * (grid - 22.0) / 24.0)
    cdf = np.concatenate([[0.0], np.cumsum((density[1:] + density[:-1]) / 2)])
    return np.interp(rng.random(n) * cdf[-1], cdf, grid)


def make_trace(users: int, seed: int) -> np.ndarray:
    """Rows ``(client, start, end)`` in whole seconds of one week, sorted by client and
    start: per user a Poisson count of sessions (at least one) with a lognormal daily rate
    (median 1.5, σ 1), each starting on a uniform day at a diurnal local hour, shifted by
    the user's time zone (normal, σ 3 h), lasting a lognormal time (median 600 s, σ 1.3,
    30 s to 6 h). A session past the week's end goes on at its start (the trace repeats
    weekly): two rows."""
    rng = np.random.default_rng(seed)
    rate = np.clip(1.5 * np.exp(rng.standard_normal(users)), 0.05, 40.0)
    counts = np.maximum(1, rng.poisson(7 * rate))
    client = np.repeat(np.arange(users), counts)
    n = len(client)
    zone = rng.normal(0.0, 3.0, users)[client]
    day = rng.integers(0, 7, n)
    start = np.floor(day * DAY + ((local_hours(rng, n) - zone) * 3600.0) % DAY)
    length = np.clip(np.round(600.0 * np.exp(1.3 * rng.standard_normal(n))), 30.0, 6 * 3600.0)
    end = start + length
    wraps = end > WEEK
    client = np.concatenate([client, client[wraps]])
    start = np.concatenate([start, np.zeros(int(wraps.sum()))])
    end = np.concatenate([np.minimum(end, WEEK), end[wraps] - WEEK])
    order = np.lexsort((start, client))
    return np.stack([client[order], start[order], end[order]], axis=1).astype(np.int64)


def make_devices(users: int, seed: int) -> np.ndarray:
    """Rows ``(speed, down_mbps, up_mbps, latency)`` per user: FedScale's ``computation``
    (ms per sample, lognormal, median 100, σ 0.7) as ``speed = 1000 / (3 computation)``,
    its ``communication`` (kbit/s, lognormal, median 5,000, σ 1) as both bandwidths,
    latency lognormal (median 0.3 s, σ 0.5)."""
    rng = np.random.default_rng(seed + 1)
    computation = 100.0 * np.exp(0.7 * rng.standard_normal(users))
    mbit = 5.0 * np.exp(rng.standard_normal(users))
    latency = 0.3 * np.exp(0.5 * rng.standard_normal(users))
    return np.stack([1000.0 / (3 * computation), mbit, mbit, latency], axis=1)


def generate(sizes: list[int], seed: int, work: Path) -> dict[int, dict[str, Any]]:
    """Write ``trace-N.csv`` and ``devices-N.csv`` for every size N (prefixes of the
    largest); returns what was written per size."""
    largest = max(sizes)
    began = time.perf_counter()
    trace, devices = make_trace(largest, seed), make_devices(largest, seed)
    made = time.perf_counter() - began
    out: dict[int, dict[str, Any]] = {}
    for n in sorted(sizes):
        rows = trace[: np.searchsorted(trace[:, 0], n)]
        path, device_path = work / f"trace-{n}.csv", work / f"devices-{n}.csv"
        np.savetxt(path, rows, fmt="%d", delimiter=",", header="client,start,end", comments="")
        np.savetxt(
            device_path,
            devices[:n],
            fmt="%.4f",
            delimiter=",",
            header="speed,down_mbps,up_mbps,latency",
            comments="",
        )
        out[n] = {
            "trace": str(path),
            "devices": str(device_path),
            "windows": len(rows),
            "mb": path.stat().st_size / 1e6,
        }
    out[largest]["generate_s"] = made
    return out


def describe(path: Path) -> dict[str, float]:
    """The trace's shape: sessions per user (median, p99), session minutes (median, p99),
    the share of users online at each hour of the second day (least, most)."""
    rows = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.int64)
    per_user = np.bincount(rows[:, 0])
    minutes = (rows[:, 2] - rows[:, 1]) / 60
    users = len(per_user)
    online = []
    for hour in range(24):
        t = DAY + hour * 3600
        inside = (rows[:, 1] <= t) & (t < rows[:, 2])
        online.append(len(np.unique(rows[inside, 0])) / users)
    return {
        "sessions_median": float(np.median(per_user)),
        "sessions_p99": float(np.percentile(per_user, 99)),
        "minutes_median": float(np.median(minutes)),
        "minutes_p99": float(np.percentile(minutes, 99)),
        "online_min": min(online),
        "online_max": max(online),
    }


# The measurements (child processes) --------------------------------------------------------


def recipe(users: int, files: dict[str, Any], rounds: int) -> dict[str, Any]:
    """The quickstart with ``users`` registered clients on the trace and devices."""
    from fedkit.config.schema import load_raw

    raw = copy.deepcopy(load_raw(ROOT / "recipes" / "quickstart.yaml"))
    raw["data"].update(
        num_clients=users, partition={"name": "sampled", "size": 50}, local_test_size=5
    )
    raw["federation"]["rounds"] = rounds
    raw["evaluation"] = {"protocol": "none", "every": 0}
    raw["engine"] = {"executor": "sequential", "store": "memory"}
    raw["systems"] = {
        "devices": files["devices"],
        "availability": {"model": "trace", "period": WEEK, "trace": files["trace"]},
        "over_selection": 1.3,
    }
    return raw


def load(users: int, files: dict[str, Any]) -> dict[str, Any]:
    """Read the trace as a run does (``availability.build``): seconds, the peak memory it
    added and the bytes the model holds (MB); then the devices file (``read_devices``):
    seconds."""
    from fedkit.config.schema import validate
    from fedkit.core import availability, clock

    cfg = validate(recipe(users, files, 1)).systems
    before = rss_kib()
    began = time.perf_counter()
    model = availability.build(cfg.availability, 0)
    seconds = time.perf_counter() - began
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    held = sum(getattr(model, name).nbytes for name in ("starts", "ends", "offsets"))
    began = time.perf_counter()
    devices = clock.read_devices(files["devices"], cfg.link.latency)
    assert len(devices) == users
    return {
        "load_s": seconds,
        "load_mb": mb(peak - before),
        "held_mb": held / 1e6,
        "devices_s": time.perf_counter() - began,
    }


def replay(users: int, files: dict[str, Any], rounds: int) -> dict[str, Any]:
    """The quickstart on the trace: per round the sampling seconds, the clients sampled and
    those that left mid-job; the set-up and round wall times."""
    import torch

    from fedkit.config.schema import validate
    from fedkit.core import clock as clock_module
    from fedkit.core.engine import prepare
    from fedkit.core.engine import rounds as run_rounds

    torch.set_num_threads(1)
    sampling: list[float] = []
    original = clock_module.Clock.sample

    def timed(self: Any, *args: Any, **kwargs: Any) -> list[int]:
        began = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            sampling.append(time.perf_counter() - began)

    clock_module.Clock.sample = timed  # type: ignore[method-assign]
    began = time.perf_counter()
    run = prepare(validate(recipe(users, files, rounds)))
    setup = time.perf_counter() - began
    sampled = left = 0
    walls: list[float] = []
    virtual = 0.0
    try:
        began = time.perf_counter()
        for row in run_rounds(run):
            walls.append(time.perf_counter() - began)
            sampled += len(row["clients"])
            failures = row.get("failures", {}).values()
            left += sum("left at virtual time" in text for text in failures)
            virtual = row["virtual_time"]
            began = time.perf_counter()
    finally:
        run.close()
    return {
        "setup_s": setup,
        "sample_ms": [1000 * s for s in sampling],
        "round_s": statistics.median(walls),
        "sampled": sampled,
        "left": left,
        "virtual_s": virtual,
        "peak_mb": mb(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss),
    }


def child(part: str, users: int, files: dict[str, Any], rounds: int) -> dict[str, Any]:
    """One measurement in a fresh process (its peak memory its own): its JSON line."""
    argv = [sys.executable, __file__, "--child", part, "--users", str(users)]
    argv += ["--rounds", str(rounds), "--files", json.dumps(files)]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stderr)
        raise SystemExit(f"{part} at {users} users failed (exit {done.returncode})")
    return json.loads(done.stdout.strip().splitlines()[-1])


# The tables ------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, nargs="+", default=[1360, 13600, 136000])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--child", choices=["load", "replay"], help=argparse.SUPPRESS)
    parser.add_argument("--files", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        (users,) = args.users
        files = json.loads(args.files)
        result = load(users, files) if args.child == "load" else replay(users, files, args.rounds)
        print(json.dumps(result))
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="fedkit-trace-"))
    work.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    written = generate(args.users, args.seed, work)
    largest = max(args.users)
    shape = describe(Path(written[largest]["trace"]))
    sizes = ", ".join(
        f"{n:,} users {w['windows']:,} windows {w['mb']:.1f} MB" for n, w in written.items()
    )
    print(f"generated in {time.perf_counter() - began:.1f} s under {work}: {sizes}", flush=True)
    print(
        f"\nshape ({largest:,} users): sessions per user median {shape['sessions_median']:.0f}, "
        f"p99 {shape['sessions_p99']:.0f}; session minutes median {shape['minutes_median']:.1f}, "
        f"p99 {shape['minutes_p99']:.0f}; online on day 2 between "
        f"{shape['online_min']:.1%} and {shape['online_max']:.1%} of users by hour\n",
        flush=True,
    )
    results = {}
    for n in sorted(args.users):
        results[n] = {
            **child("load", n, written[n], args.rounds),
            **child("replay", n, written[n], args.rounds),
        }
        print(f"  {n:,} users: {json.dumps(results[n])}", flush=True)
    print(
        "\n| users | windows | trace MB | load s | load peak MB | set-up s "
        "| sampling ms/round (median, max) | s/round | sampled | left mid-job | virtual s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for n, r in results.items():
        w = written[n]
        ms = r["sample_ms"]
        print(
            f"| {n:,} | {w['windows']:,} | {w['mb']:.1f} | {r['load_s']:.2f} | "
            f"{r['load_mb']:.0f} | {r['setup_s']:.1f} | {statistics.median(ms):.2f}, "
            f"{max(ms):.2f} | {r['round_s']:.2f} | {r['sampled']} | "
            f"{r['left']} ({r['left'] / max(1, r['sampled']):.1%}) | {r['virtual_s']:.0f} |"
        )
    print(f"\ntotal {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
    main()
