"""SecAgg+'s cost against plain FedAvg on Flower's simulation runtime, side by side.

    OMP_NUM_THREADS=1 python benchmarks/secagg_cost.py [--clients 10 50] [--rounds 3] \
        [--workers 2] [--num-shares 1.0]
    OMP_NUM_THREADS=1 python benchmarks/secagg_cost.py --quickstart [--rounds R] [--workers 2]

For each client count N, one Flower simulation of N nodes (``SimulationLink``) runs the
same FedAvg recipe twice, every client in every round: plain (the server receives each
upload) and with ``engine.secure_aggregation: true`` (Flower's SecAgg+ with its default
parameters; the server receives the mean). The recipe is fedkit's tiny test recipe (timm's
test ResNet at 16×16 on the embedded digits, 300 images split IID), evaluation off, so a
round is the clients' training plus, with SecAgg+, the protocol's four stages. Round 1
is a warm-up; the table gives the mean over the later rounds of a round's seconds, the
bytes the ledger booked (the plain run's model down and up), and SecAgg+'s own messages
and bytes (``secagg`` in the metrics row: every protocol message and reply; the ledger
books the same bytes per client in its ``secagg`` category, decision 0029).

``--quickstart`` is the issue's accuracy check instead: the shipped quickstart recipe
(``recipes/quickstart.yaml``: 10 clients, Dirichlet(0.5), all of them every round, 20
rounds, timm's test ConvNeXt at 32×32, evaluation every round), unchanged but for
``engine.executor: flower``, run plain and then with SecAgg+ on one Flower simulation;
it prints both runs' global test accuracy round by round, the final difference in points
and the mean seconds of a round.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from functools import partial
from typing import Any

import torch

from fedkit.config.schema import load_raw, validate
from fedkit.config.shipped import resolve
from fedkit.core.engine import prepare, run_round
from fedkit.flower.flower_executor import FlowerExecutor
from fedkit.flower.simulation import SimulationLink
from fedkit.testing import tiny_recipe


def recipe(clients: int, rounds: int, workers: int, secure: Any) -> dict[str, Any]:
    return tiny_recipe(
        data={"num_clients": clients, "partition": {"name": "iid"}, "local_test_size": 2},
        federation={"rounds": rounds, "clients_per_round": clients, "min_clients": 2},
        evaluation={"protocol": "none", "every": 0},
        engine={"executor": "flower", "workers": workers, "secure_aggregation": secure},
    )


def measure(link: SimulationLink, raw: dict[str, Any]) -> dict[str, float]:
    """Mean seconds, ledger bytes and SecAgg+ cost per round, after the warm-up round."""
    recipe = validate(raw)
    run = prepare(recipe, executor=partial(FlowerExecutor, link=link))
    rows, seconds = [], []
    try:
        for r in range(1, recipe.federation.rounds + 1):
            rows.append(run_round(run, r))
            seconds.append(run.times["seconds"])
    finally:
        run.close()
    later = rows[1:] or rows
    cost = [row.get("secagg", {}) for row in later]
    return {
        "seconds": statistics.mean(seconds[1:] or seconds),
        "model_bytes": statistics.mean(row["bytes"]["total"] for row in later),
        "messages": statistics.mean(c.get("messages", 0) for c in cost),
        "secagg_bytes": statistics.mean(c.get("bytes_down", 0) + c.get("bytes_up", 0) for c in cost)
        if cost
        else 0,
    }


def quickstart(rounds: int | None, workers: int) -> None:
    """The quickstart plain and under SecAgg+, side by side (see the module docstring)."""
    raw = load_raw(resolve("quickstart"))
    raw["engine"] = {**raw.get("engine", {}), "executor": "flower", "workers": workers}
    if rounds is not None:
        raw["federation"]["rounds"] = rounds
    recipe = validate(raw)
    link = SimulationLink(recipe.data.num_clients, recipe.engine)
    runs: dict[str, tuple[list[dict[str, Any]], list[float]]] = {}
    try:
        for name, secure in (("plain", False), ("SecAgg+", True)):
            raw["engine"]["secure_aggregation"] = secure
            run = prepare(validate(raw), executor=partial(FlowerExecutor, link=link))
            rows, seconds = [], []
            try:
                for r in range(1, recipe.federation.rounds + 1):
                    rows.append(run_round(run, r))
                    seconds.append(run.times["seconds"])
                    print(f"{name} round {r}: test accuracy {rows[-1]['test_accuracy']:.4f}, "
                          f"{seconds[-1]:.2f} s", flush=True)  # fmt: skip
            finally:
                run.close()
            runs[name] = rows, seconds
    finally:
        link.close()
    (plain, plain_s), (secure, secure_s) = runs["plain"], runs["SecAgg+"]
    print("| round | plain test accuracy | SecAgg+ test accuracy | difference (points) |")
    print("|---|---|---|---|")
    for a, b in zip(plain, secure, strict=True):
        gap = 100 * (b["test_accuracy"] - a["test_accuracy"])
        accuracy = f"{a['test_accuracy']:.4f} | {b['test_accuracy']:.4f}"
        print(f"| {a['round']} | {accuracy} | {gap:+.2f} |")
    gap = 100 * (secure[-1]["test_accuracy"] - plain[-1]["test_accuracy"])
    print(
        f"final ({recipe.federation.rounds} rounds): plain {plain[-1]['test_accuracy']:.4f}, "
        f"SecAgg+ {secure[-1]['test_accuracy']:.4f}, difference {gap:+.2f} points "
        f"({'within' if abs(gap) <= 0.5 else 'NOT within'} 0.5); seconds / round after round 1: "
        f"plain {statistics.mean(plain_s[1:] or plain_s):.2f}, "
        f"SecAgg+ {statistics.mean(secure_s[1:] or secure_s):.2f}; SecAgg+ per round: "
        f"{secure[-1]['secagg']['messages']} messages, "
        f"{(secure[-1]['secagg']['bytes_down'] + secure[-1]['secagg']['bytes_up']) / 1e6:.1f} MB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50])
    parser.add_argument("--rounds", type=int, default=None,
                        help="3; with --quickstart, the recipe's own 20")  # fmt: skip
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--num-shares", type=float, default=None,
                        help="SecAgg+'s num_shares: a fraction of the clients up to 1.0 "
                        "(Flower's default: every client), else that many shares, one kept "
                        "and one per neighbour")  # fmt: skip
    parser.add_argument("--quickstart", action="store_true",
                        help="the quickstart plain and under SecAgg+: final accuracy")  # fmt: skip
    args = parser.parse_args()
    if args.quickstart:
        quickstart(args.rounds, args.workers)
        return
    args.rounds = args.rounds or 3
    shares = args.num_shares
    settings: Any = True
    if shares is not None:
        settings = {"num_shares": int(shares) if shares > 1 and shares.is_integer() else shares}
    print(
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, {args.workers} Ray actor(s), "
        f"{args.rounds} rounds (the first a warm-up), secure_aggregation: {settings}"
    )
    print(
        "| clients | plain s / round | SecAgg+ s / round | ratio | ledger MB / round "
        "| SecAgg+ messages / round | SecAgg+ MB / round |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in args.clients:
        engine = validate(recipe(n, args.rounds, args.workers, False)).engine
        link = SimulationLink(n, engine)
        try:
            plain = measure(link, recipe(n, args.rounds, args.workers, False))
            secure = measure(link, recipe(n, args.rounds, args.workers, settings))
        finally:
            link.close()
        print(
            f"| {n} | {plain['seconds']:.2f} | {secure['seconds']:.2f} "
            f"| {secure['seconds'] / plain['seconds']:.2f} | {plain['model_bytes'] / 1e6:.1f} "
            f"| {secure['messages']:.0f} | {secure['secagg_bytes'] / 1e6:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
