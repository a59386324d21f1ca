"""Scale: peak memory and checkpoint bytes against the number of clients, time per round
with 1,000 and 10,000 clients, and Ray's speed-up on two cores.

Each measured run is a fresh child process (``one``) that prints one JSON line: its peak
RSS (``ru_maxrss``), the bytes its last checkpoint wrote (the checkpoint folder plus the
client files of that round) and seconds per round. The parent runs the configurations
side by side and prints a table.

    OMP_NUM_THREADS=1 python benchmarks/scale.py memory --clients 10 1000
    OMP_NUM_THREADS=1 python benchmarks/scale.py everyone
    OMP_NUM_THREADS=1 python benchmarks/scale.py many --root ../shared/data/cifar10
    python benchmarks/scale.py ray

``memory``: FedAvg and FedU on digits (test_resnet, 16×16), 10 clients per round, 5
rounds, disk and memory stores, 10 vs 1,000 clients. ``everyone``: FedU with every
client in every round, 50 vs 200 clients, memory against disk store. ``many``: FedAvg
with 1,000 and 10,000 clients, 100 per round, 5 rounds, on the CIFAR-10 subset (20,000
training images; digits has only 1,437, fewer than 10,000 clients). ``ray``: 4 clients
per round of CPU-bound training, sequential with 1 and 2 threads against Ray with 2
workers × 1 thread.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fedkit.config.schema import validate
from fedkit.core import runs
from fedkit.core.engine import SilentReporter


def recipe(args: argparse.Namespace) -> dict[str, Any]:
    plugins = {
        "fedavg": ["fedavg"],
        "fedu": [{"fedu": {"projector_hidden": 64, "projection_dim": 32, "predictor_hidden": 64}}],
    }[args.plugin]
    data: dict[str, Any] = {"dataset": "digits", "image_size": 16, "local_test_size": 5}
    if args.root:
        data = {"dataset": "imagefolder", "root": args.root, "image_size": 16, "local_test_size": 5}
    return {
        "seed": 0,
        "backbone": {"name": "test_resnet"},
        "data": {**data, "num_clients": args.clients, "partition": partition(args)},
        "federation": {
            "rounds": args.rounds,
            "clients_per_round": args.per_round,
            "local_epochs": args.epochs,
            "batch_size": 16,
            "optimizer": {"name": "sgd", "lr": 0.05},
        },
        "plugins": plugins,
        "evaluation": evaluation(args),
        "engine": {"store": args.store, "executor": args.executor, "workers": args.workers},
        "device": "cpu",
    }


def partition(args: argparse.Namespace) -> dict[str, Any]:
    if args.partition == "sampled":
        return {"name": "sampled", "size": 3}
    return {"name": args.partition}


def evaluation(args: argparse.Namespace) -> dict[str, Any]:
    if args.evaluate == 0:
        return {"protocol": "none", "every": 0}
    return {"protocol": "supervised", "every": 1, "clients": args.evaluate}


class RoundClock(SilentReporter):
    """Wall time of each round (the first one also pays for starting workers)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.started = 0.0

    def round_started(self, round: int, clients: list[int]) -> None:
        self.started = time.perf_counter()

    def round_done(self, round: int, metrics: dict[str, Any]) -> None:
        self.times.append(time.perf_counter() - self.started)


def one(args: argparse.Namespace) -> None:
    """A single measured run (child process): prints its figures as JSON."""
    import torch

    torch.set_num_threads(args.threads)
    out = Path(tempfile.mkdtemp(prefix="fedkit-scale-")) / "run"
    run = runs.start(validate(recipe(args)), out)
    clock = RoundClock()
    began = time.perf_counter()
    runs.execute(run, out, reporter=clock)
    seconds = time.perf_counter() - began
    folder = (
        out / "checkpoints" / json.loads((out / "checkpoints/latest.json").read_text())["folder"]
    )
    last = f".r{args.rounds:06d}.safetensors"
    written = sum(p.stat().st_size for p in folder.iterdir())
    written += sum(p.stat().st_size for p in (out / "clients").glob(f"*{last}"))
    print(
        json.dumps(
            {
                "plugin": args.plugin,
                "clients": args.clients,
                "executor": args.executor,
                "threads": args.threads,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "checkpoint_bytes": written,
                "seconds_per_round": seconds / args.rounds,
                "steady_seconds_per_round": statistics.median(clock.times[1:] or clock.times),
                "row_bytes": max(len(line) for line in (out / "metrics.jsonl").open("rb")),
            }
        )
    )


def child(**changes: Any) -> dict[str, Any]:
    argv = [sys.executable, __file__, "one"]
    for key, value in changes.items():
        if value is not None:
            argv += [f"--{key.replace('_', '-')}", str(value)]
    env = {**os.environ, "OMP_NUM_THREADS": str(changes.get("threads", 1))}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def memory(args: argparse.Namespace) -> None:
    print("| plugin | store | clients | peak RSS MB | checkpoint bytes | s/round |")
    print("|---|---|---|---|---|---|")
    for plugin in ("fedavg", "fedu"):
        for store in ("disk", "memory"):
            rows = [child(plugin=plugin, clients=n, store=store) for n in args.clients]
            for r in rows:
                print(
                    f"| {plugin} | {store} | {r['clients']} | {r['peak_rss_mb']:.0f} | "
                    f"{r['checkpoint_bytes']:,} | {r['seconds_per_round']:.2f} |",
                    flush=True,
                )
            first, last = rows[0], rows[-1]
            print(
                f"| {plugin} | {store} | ratio {last['clients']}/{first['clients']} | "
                f"{last['peak_rss_mb'] / first['peak_rss_mb']:.2f} | "
                f"{last['checkpoint_bytes'] / first['checkpoint_bytes']:.2f} | |",
                flush=True,
            )


def everyone(args: argparse.Namespace) -> None:
    """FedU with every client in every round (the growth the issue measured), 50 vs 200
    clients, memory store against disk store."""
    print("| store | clients (all per round) | peak RSS MB | checkpoint bytes | s/round |")
    print("|---|---|---|---|---|")
    for store in ("memory", "disk"):
        rows = [
            child(plugin="fedu", clients=n, per_round=n, rounds=2, store=store) for n in (50, 200)
        ]
        for r in rows:
            print(
                f"| {store} | {r['clients']} | {r['peak_rss_mb']:.0f} | "
                f"{r['checkpoint_bytes']:,} | {r['seconds_per_round']:.2f} |",
                flush=True,
            )
        ratio = rows[1]["peak_rss_mb"] / rows[0]["peak_rss_mb"]
        print(f"| {store} | ratio 200/50 | {ratio:.2f} | | |")


def many(args: argparse.Namespace) -> None:
    print("| clients | per round | peak RSS MB | s/round |")
    print("|---|---|---|---|")
    for n in (1000, 10000):
        r = child(clients=n, per_round=100, root=args.root, store="disk", rounds=5)
        print(f"| {n} | 100 | {r['peak_rss_mb']:.0f} | {r['seconds_per_round']:.2f} |")


def million(args: argparse.Namespace) -> None:
    """1,000 against 1,000,000 registered clients: 100 per round, each with 3 digits
    images (``sampled``: drawn at random, clients share images), FedAvg on test_resnet,
    100 clients' personal models evaluated per round."""
    common = {"per_round": 100, "rounds": args.rounds, "partition": "sampled", "evaluate": 100}
    rows = [child(clients=n, **common) for n in (1000, 1_000_000)]
    print(
        "| registered clients | peak RSS MB | s/round (rounds 2+) | s/round incl. set-up "
        "| largest metrics row (B) |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['clients']:,} | {r['peak_rss_mb']:.0f} | {r['steady_seconds_per_round']:.2f} | "
            f"{r['seconds_per_round']:.2f} | {r['row_bytes']} |"
        )
    ratio = rows[1]["steady_seconds_per_round"] / rows[0]["steady_seconds_per_round"]
    print(f"per-round time, 1,000,000 / 1,000 clients: {ratio:.2f}")


def ray_speed(args: argparse.Namespace) -> None:
    common = {"clients": 4, "per_round": 4, "rounds": 5, "epochs": 4}
    seq1 = child(**common, threads=1)
    seq2 = child(**common, threads=2)
    ray2 = child(**common, threads=1, executor="ray", workers=2)
    print("| executor | threads | s/round (rounds 2+) | speed-up | s/round incl. start |")
    print("|---|---|---|---|---|")
    for name, r in (("sequential", seq1), ("sequential", seq2), ("ray, 2 workers", ray2)):
        speed = seq1["steady_seconds_per_round"] / r["steady_seconds_per_round"]
        print(
            f"| {name} | {r['threads']} | {r['steady_seconds_per_round']:.2f} | {speed:.2f}× | "
            f"{r['seconds_per_round']:.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["one", "memory", "everyone", "many", "million", "ray"])
    parser.add_argument("--partition", default="iid", choices=["iid", "sampled"])
    parser.add_argument("--evaluate", type=int, default=0, help="clients evaluated per round")
    parser.add_argument("--plugin", default="fedavg", choices=["fedavg", "fedu"])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 1000])
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--store", default="auto", choices=["auto", "memory", "disk"])
    parser.add_argument("--executor", default="sequential")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--root", default=None, help="an ImageFolder data set instead of digits")
    args = parser.parse_args()
    if args.what == "one":
        args.clients = args.clients[0]
        one(args)
    else:
        modes = {"memory": memory, "everyone": everyone, "many": many, "ray": ray_speed}
        modes["million"] = million
        modes[args.what](args)


if __name__ == "__main__":
    main()
