"""DP-SGD's cost per client against plain local training, side by side in one process.

    OMP_NUM_THREADS=1 python benchmarks/dpsgd_cost.py [--images 512] [--image-size 28] \
        [--repeats 3]

Two runs of the same FedAvg recipe on the embedded digits with NIID-Bench's CNN (no
BatchNorm, so opacus can compute per-sample gradients): one client per round, one local
epoch over ``--images`` images, batch 32, SGD; one plain, one with ``dpsgd`` (C = 1,
σ = 1). Each is prepared once; one round of each is a warm-up, then the runs take turns
for ``--repeats`` rounds and the best round time of each is reported with the ratio.
A round is one client's job (no evaluation), so the ratio is DP-SGD's cost per client.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from typing import Any

import torch

from fedkit.config.schema import validate
from fedkit.core.engine import Run, prepare, run_round
from fedkit.plugin.manager import Plugins
from fedkit.plugin.registry import discover
from fedkit.testing import tiny_recipe

SETTINGS: dict[str, list[Any]] = {
    "plain": ["fedavg"],
    "dpsgd": ["fedavg", {"dpsgd": {"max_grad_norm": 1.0, "noise_multiplier": 1.0}}],
}


def recipe(plugins: list[Any], images: int, size: int) -> dict[str, Any]:
    return tiny_recipe(
        backbone={"name": "niid_bench_cnn", "kwargs": {"image_size": size}},
        data={
            "image_size": size,
            "num_clients": 1,
            "partition": {"name": "iid"},
            "max_train": images,
            "local_test_size": 2,
        },
        federation={
            "rounds": 1000,
            "clients_per_round": 1,
            "local_epochs": 1,
            "batch_size": 32,
            "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.0},
        },
        plugins=plugins,
        evaluation={"protocol": "none", "every": 0},
    )


def prepared(raw: dict[str, Any]) -> Run:
    r = validate(raw)
    return prepare(r, Plugins(r, discover()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--image-size", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s), OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"
    )
    runs = {name: prepared(recipe(p, args.images, args.image_size)) for name, p in SETTINGS.items()}
    best = dict.fromkeys(runs, float("inf"))
    for round in range(1, args.repeats + 2):
        for name, run in runs.items():
            start = time.perf_counter()
            run_round(run, round)
            if round > 1:  # round 1 is the warm-up
                best[name] = min(best[name], time.perf_counter() - start)
    steps = -(-args.images // 32)
    print(f"one client, {args.images} images at {args.image_size}x{args.image_size}, {steps} steps")
    for name, seconds in best.items():
        per_step = seconds / steps * 1000
        print(f"{name:6s} {seconds * 1000:8.1f} ms per client round ({per_step:.2f} ms/step)")
    print(f"ratio dpsgd / plain: {best['dpsgd'] / best['plain']:.2f}")


if __name__ == "__main__":
    main()
