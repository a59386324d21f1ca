"""A 4-run sweep with ``--parallel 1`` and ``--parallel 2``, side by side.

    python benchmarks/sweep_parallel.py [--repeats 1]

The sweep is the quickstart at 2 rounds over seed = 0, 1 and learning rate = 0.002,
0.004 (``fedkit sweep quickstart --set seed=0,1 --set federation.optimizer.lr=0.002,0.004
--set federation.rounds=2``), each time into a fresh directory; the two settings take
turns (the order swapped every repeat). ``--parallel 1`` gives its one cell all cores,
``--parallel 2`` one core each. Prints the wall time of each sweep, the ratio, and whether
the two tables are the same up to the thread count's last digits.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GRID = [
    "--set", "seed=0,1",
    "--set", "federation.optimizer.lr=0.002,0.004",
    "--set", "federation.rounds=2",
]  # fmt: skip


def sweep(out: Path, parallel: int) -> float:
    began = time.monotonic()
    command = [sys.executable, "-m", "fedkit", "sweep", "quickstart", *GRID, "--out", str(out)]
    env = {**os.environ, "FEDKIT_REPORT": "0"}
    subprocess.run([*command, "--parallel", str(parallel), "-q"], check=True,
                   stdout=subprocess.DEVNULL, env=env)  # fmt: skip
    return time.monotonic() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fedkit-sweep-"))
    times: dict[int, list[float]] = {1: [], 2: []}
    for repeat in range(args.repeats):
        for parallel in (1, 2) if repeat % 2 == 0 else (2, 1):
            seconds = sweep(tmp / f"p{parallel}-{repeat}", parallel)
            times[parallel].append(seconds)
            print(f"--parallel {parallel}: {seconds:.1f} s", flush=True)
    one, two = min(times[1]), min(times[2])
    print(f"\n| --parallel 1 | --parallel 2 | speed-up |\n|---|---|---|\n"
          f"| {one:.1f} s | {two:.1f} s | {one / two:.2f}× |")  # fmt: skip
    tables = [json.loads((tmp / f"p{p}-0" / "table.json").read_text()) for p in (1, 2)]
    close = all(
        abs(a[k]["mean"] - b[k]["mean"]) < 1e-3
        for a, b in zip(*tables, strict=True)
        for k in a
        if isinstance(a[k], dict)
    )
    print(f"tables agree to 1e-3: {close}")


if __name__ == "__main__":
    main()
