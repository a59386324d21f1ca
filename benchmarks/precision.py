"""Speed of local SSL training at each precision and layout, side by side in one process.

    OMP_NUM_THREADS=1 python benchmarks/precision.py --root ../shared/data/cifar10 \
        --backbones test_resnet resnet18 resnet18:cifar_stem [--images 256] [--repeats 3]

For each backbone, three runs of the same FedU + DAPU recipe (one client, one local epoch
over ``--images`` CIFAR images at 32×32, batch 64, two views, EMA target): fp32,
fp32 + channels_last, bf16 + channels_last. Each is prepared once; one round of each is a
warm-up, then the runs take turns for ``--repeats`` rounds and the best round time of each
is reported with its speed-up over fp32. ``name:cifar_stem`` gives the backbone the CIFAR
stem (3×3 stride-1 first convolution, no max-pool), so a ResNet keeps 32×32 maps. The
machine's bf16 support is printed first: the speed-up depends on it entirely (AMX or
AVX-512 BF16 CPUs, Ampere or newer GPUs).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import time
from typing import Any

import torch
from overhead import SSL

from fedkit.config.schema import validate
from fedkit.core.engine import Run, prepare, run_round
from fedkit.testing import tiny_recipe
from fedkit.training.precision import native_bf16

SETTINGS = {
    "fp32": {"precision": "fp32", "channels_last": False},
    "fp32+channels_last": {"precision": "fp32", "channels_last": True},
    "bf16+channels_last": {"precision": "bf16", "channels_last": True},
}


def recipe(backbone: str, root: str, images: int, setting: dict[str, Any]) -> dict[str, Any]:
    name, _, stem = backbone.partition(":")
    raw = tiny_recipe(
        backbone={"name": name, "cifar_stem": stem == "cifar_stem"},
        data={
            "dataset": "imagefolder",
            "root": root,
            "image_size": 32,
            "num_clients": 1,
            "partition": {"name": "iid"},
            "max_train": images,
            "max_test": 100,
            "local_test_size": 2,
        },
        federation={
            "rounds": 1000,
            "clients_per_round": 1,
            "local_epochs": 1,
            "batch_size": 64,
            "drop_last": True,
            "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4},
        },
        plugins=copy.deepcopy(SSL["plugins"]),  # the overhead benchmark's FedU + DAPU
    )
    raw.update(copy.deepcopy(setting))
    raw["evaluation"] = {"protocol": "none", "every": 0}
    raw["engine"] = {"executor": "sequential", "store": "memory"}
    return raw


def measure(backbone: str, root: str, images: int, repeats: int) -> dict[str, float]:
    runs: dict[str, Run] = {
        name: prepare(validate(recipe(backbone, root, images, setting)))
        for name, setting in SETTINGS.items()
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(1, repeats + 2):  # round 1 of each is the warm-up
        for name, run in runs.items():
            began = time.perf_counter()
            run_round(run, r)
            if r > 1:
                times[name].append(time.perf_counter() - began)
    for run in runs.values():
        run.close()
    return {name: min(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="../shared/data/cifar10")
    parser.add_argument(
        "--backbones", nargs="+", default=["test_resnet", "resnet18", "resnet18:cifar_stem"]
    )
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    threads = int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))
    torch.set_num_threads(threads)
    cpu = torch.device("cpu")
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{threads} thread(s), torch {torch.__version__}, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, native bf16: {native_bf16(cpu)}"
    )
    print("| backbone | " + " | ".join(f"{n} s/round" for n in SETTINGS) + " | speed-up |")
    print("|---|" + "---|" * (len(SETTINGS) + 1))
    for backbone in args.backbones:
        best = measure(backbone, args.root, args.images, args.repeats)
        ups = ", ".join(f"{n} {best['fp32'] / best[n]:.2f}×" for n in SETTINGS if n != "fp32")
        cells = " | ".join(f"{best[n]:.2f}" for n in SETTINGS)
        print(f"| {backbone} | {cells} | {ups} |", flush=True)


if __name__ == "__main__":
    main()
