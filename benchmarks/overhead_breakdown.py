"""Where the `tiny` overhead case spends its time outside training, per client and per
round, next to the same steps of the bare loop in ``overhead.py``.

    OMP_NUM_THREADS=1 python benchmarks/overhead_breakdown.py [--rounds 5]

fedkit's phases are timed by wrapping the functions the worker and the engine call
(``ClientContext.fetch``, ``Worker.load``, ``Worker.train``, the state copy after
training, ``non_finite``, ``receive``, ``update_cluster``); the bare loop's by timing its
own lines on the same model and client shards. Medians and minima over clients (minima
are what a quiet machine would show); the aggregation also reports the page faults it
takes inside a run, and its time on the same uploads once warm.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from overhead import average, bare_client, recipe, sampled, shards, shared

import fedkit.core.engine
import fedkit.core.worker
from fedkit.config.schema import validate
from fedkit.core.engine import prepare
from fedkit.plugin.context import ClientContext

TIMES: dict[str, list[float]] = defaultdict(list)


def timed(label: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        out = function(*args, **kwargs)
        TIMES[label].append(time.perf_counter() - began)
        return out

    return wrapper


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


UPDATE = fedkit.core.engine.update_cluster


def fedkit_side(raw: dict[str, Any], rounds: int) -> Any:
    """Run ``rounds`` rounds with the phases wrapped; return the run and one round's uploads."""
    kept: dict[str, Any] = {}

    def update_cluster(run: Any, cluster: int, uploads: list[Any]) -> Any:
        kept["uploads"], before = uploads, faults()
        out = UPDATE(run, cluster, uploads)
        TIMES["fedkit: page faults in update_cluster"].append(faults() - before)
        return out

    patches = [
        (
            ClientContext,
            "fetch",
            timed("fedkit: fetch (copy of the global state)", ClientContext.fetch),
        ),
        (
            fedkit.core.worker.Worker,
            "load",
            timed("fedkit: load into the model", fedkit.core.worker.Worker.load),
        ),
        (
            fedkit.core.worker.Worker,
            "train",
            timed("fedkit: train", fedkit.core.worker.Worker.train),
        ),
        (
            fedkit.core.worker,
            "snapshot",
            timed("fedkit: copy of the state after training", fedkit.core.worker.snapshot),
        ),
        (
            fedkit.core.worker,
            "non_finite",
            timed("fedkit: non-finite check of the upload", fedkit.core.worker.non_finite),
        ),
        (
            fedkit.core.engine,
            "receive",
            timed("fedkit: receive (ledger, roster)", fedkit.core.engine.receive),
        ),
        (
            fedkit.core.engine,
            "update_cluster",
            timed("fedkit: update_cluster (per round)", update_cluster),
        ),
        (
            fedkit.core.worker.Worker,
            "run_safely",
            timed("fedkit: whole client job", fedkit.core.worker.Worker.run_safely),
        ),
    ]
    for owner, name, patch in patches:
        setattr(owner, name, patch)
    run = prepare(validate(raw))
    for row in fedkit.core.engine.rounds(run):
        if row["round"] == rounds:
            break
    return run, kept["uploads"]


def bare_side(run: Any, rounds: int) -> None:
    """The bare loop's client jobs (``overhead.bare_client``) on the fedkit run's own
    model and shards, each phase timed."""
    model = run.executor.worker.model
    common, data = shared(run, model), shards(run)
    state = {k: v.clone() for k, v in run.server.pool[0].items()}
    generator = torch.Generator().manual_seed(0)
    last = [0.0]

    def mark(phase: str) -> None:
        now = time.perf_counter()
        TIMES[f"bare: {phase}"].append(now - last[0])
        last[0] = now

    for r in range(1, rounds + 1):
        for c in sampled(generator, len(data), common.cfg.clients_per_round):
            last[0] = time.perf_counter()
            bare_client(model, state, data[c], common, r, generator, mark)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    run, uploads = fedkit_side(recipe("tiny", ""), args.rounds)
    bare_side(run, args.rounds)
    states, weights = [u.tensors for u in uploads], [u.weight for u in uploads]
    for label, go in (
        ("warm: fedkit update_cluster, same uploads", lambda: UPDATE(run, 0, uploads)),
        ("warm: bare average, same uploads", lambda: average(states, weights)),
    ):
        for _ in range(5):
            began = time.perf_counter()
            go()
            TIMES[label].append(time.perf_counter() - began)
    print("| phase | median ms | min ms | count |")
    print("|---|---|---|---|")
    for label, values in TIMES.items():
        scale = 1 if "faults" in label else 1e3
        median, low = statistics.median(values) * scale, min(values) * scale
        print(f"| {label} | {median:.2f} | {low:.2f} | {len(values)} |")
    run.close()


if __name__ == "__main__":
    main()
