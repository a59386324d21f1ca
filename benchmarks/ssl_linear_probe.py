"""Federated SSL on the CIFAR-10 subset: linear-probe accuracy of FedU (with DAPU),
FedBYOL, an always-local predictor and the single-client baseline, between two bounds:
a randomly initialised encoder (lower) and centralized BYOL on the pooled client data
(upper). Every trained configuration gets the same compute: R rounds × E local epochs
over the same images (one client holding all of them for the centralized run).

    OMP_NUM_THREADS=1 python benchmarks/ssl_linear_probe.py \
        --root ../shared/data/cifar10 --seeds 0 1 --out benchmarks/results/ssl.json

Results are appended to ``--out`` (JSON lines) as each run finishes, so a long run can
be read while it goes; ``--table`` prints the markdown table of a results file.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from fedkit.engine import prepare, run_round
from fedkit.evaluation.runner import representation_metrics
from fedkit.recipe import Recipe, validate

CONFIGS: dict[str, dict[str, Any]] = {
    "random-init encoder (lower bound)": {"plugins": [{"fedbyol": {}}], "train": False},
    "centralized BYOL (upper bound)": {"plugins": [{"fedbyol": {}}], "central": True},
    "FedU (with DAPU)": {"plugins": [{"fedu": {}}, {"dapu": {"mu": None}}]},
    "FedBYOL (always-global predictor)": {"plugins": [{"fedbyol": {}}]},
    "always-local predictor": {"plugins": [{"fedu": {"predictor": "local"}}]},
    "single-client (mean over clients)": {
        "plugins": [{"fedbyol": {}}, {"single_client": {}}],
        "personal": True,
    },
    "FedSimSiam": {"plugins": [{"fedsimsiam": {}}]},
    "FedSimCLR": {"plugins": [{"fedsimclr": {}}]},
    "FedCA (dictionary + alignment)": {
        "plugins": [{"fedca": {}}],
        "data": {"server_fraction": 0.1},
    },
    "FedEMA (on FedBYOL, τ=0.8)": {"plugins": [{"fedbyol": {}}, {"fedema": {"tau": 0.8}}]},
}
SHORT = dict(
    zip(
        [
            "random",
            "central",
            "fedu",
            "fedbyol",
            "local",
            "single",
            "fedsimsiam",
            "fedsimclr",
            "fedca",
            "fedema",
        ],
        CONFIGS,
        strict=True,
    )
)


def base_recipe(args: argparse.Namespace) -> dict[str, Any]:
    heads = {"projector_hidden": 512, "projection_dim": 128, "predictor_hidden": 512}
    return {
        "description": "ssl_linear_probe benchmark",
        "backbone": {"name": args.backbone},
        "data": {
            "dataset": "imagefolder",
            "root": args.root,
            "image_size": 32,
            "num_clients": 5,
            "partition": {"name": "classes_per_client", "k": 2},
            "max_train": args.images,
            "max_test": args.test_images,
            "local_test_size": 50,
        },
        "federation": {
            "rounds": args.rounds,
            "clients_per_round": 5,
            "local_epochs": args.epochs,
            "batch_size": args.batch_size,
            "drop_last": True,
            "optimizer": {"name": "sgd", "lr": args.lr, "momentum": 0.9, "weight_decay": 5e-4},
            "lr_schedule": "cosine",
        },
        "evaluation": {"protocol": "linear", "every": 0, "linear_epochs": args.probe_epochs},
        "device": "cpu",
        "_heads": heads,
    }


def make_recipe(args: argparse.Namespace, name: str, seed: int) -> Recipe:
    spec = CONFIGS[name]
    raw = base_recipe(args)
    heads = raw.pop("_heads")
    raw["seed"] = seed
    plugins = []
    for item in spec["plugins"]:
        ((plugin, options),) = item.items()
        options = dict(options)
        if plugin in ("fedu", "fedbyol", "fedca", "fedsimsiam", "fedsimclr"):
            options.update(heads, crop_scale=[args.crop_min, 1.0])
        if plugin == "dapu":
            options["mu"] = args.mu
        plugins.append({plugin: options})
    raw["plugins"] = plugins
    raw["data"].update(spec.get("data", {}))
    if spec.get("central"):
        raw["data"].update(num_clients=1, partition={"name": "iid"})
        raw["federation"]["clients_per_round"] = 1
    if spec.get("personal"):
        raw["evaluation"]["personal"] = True
    return validate(raw)


def run_config(args: argparse.Namespace, name: str, seed: int) -> dict[str, Any]:
    recipe = make_recipe(args, name, seed)
    began = time.perf_counter()
    run = prepare(recipe)
    if not CONFIGS[name].get("train", True):
        acc = representation_metrics(run.server, "linear")["linear_accuracy"]
        return {"config": name, "seed": seed, "linear_accuracy": acc, "seconds": 0.0}
    row: dict[str, Any] = {}
    decisions: dict[str, int] = {}
    for r in range(1, recipe.federation.rounds + 1):
        row = run_round(run, r)
        for entry in row["per_client"].values():
            if "dapu_global" in entry:
                decision = "global" if entry["dapu_global"] else "local"
                decisions[decision] = decisions.get(decision, 0) + 1
    personal = CONFIGS[name].get("personal")
    result = {
        "config": name,
        "seed": seed,
        "linear_accuracy": row["personal_linear_accuracy" if personal else "linear_accuracy"],
        "train_loss": row["train_loss"],
        "seconds": round(time.perf_counter() - began, 1),
        "bytes_up": row["bytes"]["up_model"],
    }
    if decisions:
        result["dapu_decisions"] = decisions
    if "client_linear_accuracy" in row:
        result["client_linear_accuracy"] = row["client_linear_accuracy"]
    return result


def table(path: Path) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    lines = [
        "| configuration | seeds | linear probe % (mean ± half-range) | per seed | s / run |",
        "|---|---|---|---|---|",
    ]
    for name in CONFIGS:
        mine = [r for r in rows if r["config"] == name]
        if not mine:
            continue
        acc = np.array([100 * r["linear_accuracy"] for r in mine])
        spread = (acc.max() - acc.min()) / 2
        per_seed = ", ".join(f"{a:.1f}" for a in acc)
        secs = np.mean([r["seconds"] for r in mine])
        lines.append(
            f"| {name} | {len(mine)} | {acc.mean():.1f} ± {spread:.1f} | {per_seed} | {secs:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="../shared/data/cifar10")
    parser.add_argument("--backbone", default="test_resnet")
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--test-images", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=4, help="local epochs per round")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--crop-min", type=float, default=0.2)
    parser.add_argument("--mu", type=float, default=0.4)
    parser.add_argument(
        "--probe-epochs",
        type=int,
        default=5000,
        help="linear-probe epochs; at batch 2048 on 2,000 images one step each, so 5000 "
        "gives the optimiser steps of the paper's 200 epochs over 50,000 images",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--configs", nargs="+", default=list(SHORT), choices=list(SHORT))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ssl.jsonl"))
    parser.add_argument("--table", action="store_true", help="print the table of --out and exit")
    args = parser.parse_args()
    if args.table:
        print(table(args.out))
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        for short in args.configs:
            result = run_config(args, SHORT[short], seed)
            result["settings"] = {k: v for k, v in vars(args).items() if k not in ("out", "table")}
            with args.out.open("a") as f:
                f.write(json.dumps(result) + "\n")
            print(json.dumps({k: v for k, v in result.items() if k != "settings"}), flush=True)
    print(table(args.out))


if __name__ == "__main__":
    main()
