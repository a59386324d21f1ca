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
import torch.nn.functional as F
from overhead import average, recipe, sampled, shards

import fedkit.engine
import fedkit.worker
from fedkit.client import ClientContext
from fedkit.engine import prepare, run_round
from fedkit.models.backbones import logits
from fedkit.recipe import validate
from fedkit.training import make_optimizer

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


UPDATE = fedkit.engine.update_cluster


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
            fedkit.worker.Worker,
            "load",
            timed("fedkit: load into the model", fedkit.worker.Worker.load),
        ),
        (fedkit.worker.Worker, "train", timed("fedkit: train", fedkit.worker.Worker.train)),
        (
            fedkit.worker,
            "_detached",
            timed("fedkit: copy of the state after training", fedkit.worker._detached),
        ),
        (
            fedkit.worker,
            "non_finite",
            timed("fedkit: non-finite check of the upload", fedkit.worker.non_finite),
        ),
        (
            fedkit.engine,
            "receive",
            timed("fedkit: receive (ledger, roster)", fedkit.engine.receive),
        ),
        (
            fedkit.engine,
            "update_cluster",
            timed("fedkit: update_cluster (per round)", update_cluster),
        ),
        (
            fedkit.worker.Worker,
            "run_safely",
            timed("fedkit: whole client job", fedkit.worker.Worker.run_safely),
        ),
    ]
    for owner, name, patch in patches:
        setattr(owner, name, patch)
    run = prepare(validate(raw))
    for r in range(1, rounds + 1):
        run_round(run, r)
    return run, kept["uploads"]


def bare_side(run: Any, rounds: int) -> None:
    """The bare loop's per-client steps on the fedkit run's own model and shards."""
    cfg = run.recipe.federation
    model = run.executor.worker.model
    train = run.server.data.train
    mean = torch.tensor(train.mean).view(1, -1, 1, 1)
    std = torch.tensor(train.std).view(1, -1, 1, 1)
    data = shards(run)
    state = {k: v.clone() for k, v in run.server.pool[0].items()}
    generator = torch.Generator().manual_seed(0)
    for _ in range(rounds):
        for c in sampled(generator, len(data), cfg.clients_per_round):
            images, labels = data[c]
            t0 = time.perf_counter()
            model.load_state_dict(state)
            t1 = time.perf_counter()
            model.train()
            optimizer = make_optimizer(model.parameters(), cfg, 1)
            order = torch.randperm(len(labels), generator=generator)
            for start in range(0, len(labels), cfg.batch_size):
                idx = order[start : start + cfg.batch_size]
                x = (images[idx].float() / 255.0 - mean) / std
                loss = F.cross_entropy(logits(model, x), labels[idx])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            t2 = time.perf_counter()
            {k: v.detach().clone() for k, v in model.state_dict().items()}
            t3 = time.perf_counter()
            TIMES["bare: load_state_dict"].append(t1 - t0)
            TIMES["bare: train"].append(t2 - t1)
            TIMES["bare: copy of the state after training"].append(t3 - t2)


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
