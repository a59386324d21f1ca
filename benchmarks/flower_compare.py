"""fedkit against Flower (flwr) on one FedAvg workload: wall time and final test accuracy.

    OMP_NUM_THREADS=1 /tmp/flwr-venv/bin/python benchmarks/flower_compare.py [--rounds 10]

Both sides run in this one process, fedkit first, then Flower's simulation runtime, on
the same workload: sklearn's digits at 16×16 (16 rather than 32 to keep it quick), 20
clients with an IID split of exactly 50 training images each (fedkit's partition; Flower
is handed the same index lists), timm ``test_resnet`` with a linear head (fedkit's
``build_classifier`` on both sides, Flower's clients starting from the very weights
fedkit initialised), 5 clients per round, 10 rounds, 1 local epoch, batch size 10, SGD
lr 0.05 with momentum 0.9, every model key (BatchNorm buffers too) averaged with weights
proportional to the client's sample count. Accuracy is ``fedkit.training.accuracy`` of
the final global model on digits' global test split (360 images), for both.

fedkit runs its default in-process sequential executor, in-memory client store and no
evaluation between rounds. Flower runs the Message API as its current docs describe it:
a ``ServerApp`` whose main calls ``flwr.serverapp.strategy.FedAvg.start`` (5 of 20 nodes
per round, no federated evaluation, a server-side ``evaluate_fn`` scoring the last
round), a ``ClientApp`` with a plain PyTorch training loop, ``run_simulation`` with the
Ray backend (``--ray-cpus`` CPUs, ``--client-cpus`` per client: 2 clients train at
once by default, while fedkit trains one after another on one thread). Each client
builds its model per message, as Flower's PyTorch quickstart does. Flower's INFO
logging is turned down to WARNING and its telemetry (and Ray's usage stats) are off.

Timed: fedkit from recipe validation through ``prepare``, the rounds and the final
accuracy; Flower the whole ``run_simulation`` call (Ray start-up, actors, the rounds,
shutdown) plus the final accuracy. Imports in this process are not timed for either
side. "rounds 2..R" is the time from the end of round 1 to the end of the last round on
each side, i.e. without start-up and the first round's warm-up. The speed ratio is
Flower seconds / fedkit seconds. One JSON line with every setting and result is
appended to ``--out``; it also splits each side's time: fedkit's ``prepare_s`` and
``round_1_s``, Flower's ``round_1_s`` (counted from the call, so with Ray's start-up and
the actors' imports) and ``after_last_round_s`` (the final accuracy and the shutdown).
Clients are sampled by each framework's own sampler, so the two runs do not train the
same clients in each round.

The Flower virtualenv, kept apart from fedkit's ``.venv`` (from the repository root; the
last line adds fedkit and its dependencies, timm and scikit-learn among them):

    python -m venv /tmp/flwr-venv
    /tmp/flwr-venv/bin/pip install torch torchvision
    /tmp/flwr-venv/bin/pip install "flwr[simulation]"
    /tmp/flwr-venv/bin/pip install -e .
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from fedkit.config.schema import BackboneConfig
from fedkit.core.engine import prepare, run_round
from fedkit.data.datasets import ImageSet
from fedkit.models.backbones import build_classifier, logits
from fedkit.testing import activate, tiny_recipe
from fedkit.training import accuracy


def recipe(args: argparse.Namespace) -> dict[str, Any]:
    """The fedkit recipe of the workload."""
    return tiny_recipe(
        seed=args.seed,
        backbone={"name": "test_resnet"},
        data={
            "dataset": "digits",
            "image_size": args.image_size,
            "num_clients": args.clients,
            "max_train": args.clients * args.samples,
            "local_test_size": 1,
            "partition": {"name": "iid"},
        },
        federation={
            "rounds": args.rounds,
            "clients_per_round": args.per_round,
            "local_epochs": args.local_epochs,
            "batch_size": args.batch_size,
            "optimizer": {"name": args.optimizer, "lr": args.lr, "momentum": args.momentum},
        },
        plugins=["fedavg"],
        evaluation={"protocol": "none", "every": 0},
        engine={"executor": "sequential", "store": "memory"},
    )


def run_fedkit(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run fedkit; returns its timings and accuracy, and what Flower needs from the run
    (client shards, initial state, test set, model config)."""
    began = time.perf_counter()
    active = activate(recipe(args))
    run = prepare(active.recipe, active)
    prepared = time.perf_counter()
    data = run.data
    sizes = data.client_sizes()
    if sizes != [args.samples] * args.clients:
        raise SystemExit(f"expected {args.clients} clients of {args.samples} images, got {sizes}")
    shared = {
        "initial": {k: v.clone() for k, v in run.server.pool[0].items()},
        "shards": [
            (data.train.images[torch.as_tensor(i)], data.train.labels[torch.as_tensor(i)])
            for i in data.clients
        ],
        "mean": tuple(data.train.mean),
        "std": tuple(data.train.std),
        "test": data.test,
        "backbone": run.recipe.backbone,
        "classes": data.num_classes,
    }
    started = time.perf_counter()
    ends = []
    try:
        for r in range(1, args.rounds + 1):
            run_round(run, r)
            ends.append(time.perf_counter())
    finally:
        run.close()
    acc = accuracy(run.server.model(0), data.test, run.server.device)
    done = time.perf_counter()
    wall = (prepared - began) + (done - started)
    return {
        "wall_s": wall,
        "prepare_s": prepared - began,
        "round_1_s": ends[0] - started,
        "rounds_after_first_s": ends[-1] - ends[0],
        "test_accuracy": acc,
    }, shared


def client_update(
    model: torch.nn.ModuleDict,
    images: Tensor,
    labels: Tensor,
    args: argparse.Namespace,
    norm: tuple[Tensor, Tensor],
    generator: torch.Generator,
) -> float:
    """Plain PyTorch local training on one client's uint8 images; the mean loss."""
    mean, std = norm
    if args.optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(
            model.parameters(), lr=args.lr, momentum=args.momentum
        )
    else:
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    model.train()
    total, seen = 0.0, 0
    for _ in range(args.local_epochs):
        order = torch.randperm(len(labels), generator=generator)
        for start in range(0, len(labels), args.batch_size):
            idx = order[start : start + args.batch_size]
            if len(idx) < 2:
                continue
            x = (images[idx].float() / 255.0 - mean) / std
            loss = F.cross_entropy(logits(model, x), labels[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
            seen += len(idx)
    return total / max(seen, 1)


def run_flower(args: argparse.Namespace, shared: dict[str, Any]) -> dict[str, Any]:
    """Run the same FedAvg in Flower's simulation runtime; timings and accuracy."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    logging.getLogger("flwr").setLevel(logging.WARNING)
    shards: list[tuple[Tensor, Tensor]] = shared["shards"]
    backbone: BackboneConfig = shared["backbone"]
    classes: int = shared["classes"]
    mean = torch.tensor(shared["mean"]).view(1, -1, 1, 1)
    std = torch.tensor(shared["std"]).view(1, -1, 1, 1)
    test: ImageSet = shared["test"]
    marks: dict[int, float] = {}
    found: dict[str, float] = {}

    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        partition = int(context.node_config["partition-id"])
        server_round = int(msg.content["config"]["server-round"])
        images, labels = shards[partition]
        model = build_classifier(backbone, classes)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        generator = torch.Generator().manual_seed(
            args.seed * 1_000_000 + server_round * 1_000 + partition
        )
        loss = client_update(model, images, labels, args, (mean, std), generator)
        metrics = MetricRecord({"num-examples": len(labels), "train_loss": loss})
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
        return Message(content=content, reply_to=msg)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        marks[server_round] = time.perf_counter()
        if server_round < args.rounds:
            return None
        model = build_classifier(backbone, classes)
        model.load_state_dict(arrays.to_torch_state_dict())
        found["test_accuracy"] = accuracy(model, test, torch.device("cpu"))
        return MetricRecord({"test_accuracy": found["test_accuracy"]})

    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(
            fraction_train=args.per_round / args.clients,
            fraction_evaluate=0.0,
            min_train_nodes=args.per_round,
            min_available_nodes=args.clients,
        )
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(shared["initial"]),
            num_rounds=args.rounds,
            evaluate_fn=evaluate,
        )

    backend = {
        "init_args": {"num_cpus": args.ray_cpus, "include_dashboard": False},
        "client_resources": {"num_cpus": args.client_cpus, "num_gpus": 0.0},
    }
    began = time.perf_counter()
    try:
        run_simulation(
            server_app=server_app,
            client_app=client_app,
            num_supernodes=args.clients,
            backend_config=backend,
        )
    finally:
        if ray.is_initialized():
            ray.shutdown()
    done = time.perf_counter()
    if "test_accuracy" not in found:
        raise SystemExit("Flower's run ended without scoring its last round")
    return {
        "wall_s": done - began,
        "round_1_s": marks[1] - began,
        "rounds_after_first_s": marks[args.rounds] - marks[1],
        "after_last_round_s": done - marks[args.rounds],
        "test_accuracy": found["test_accuracy"],
    }


def versions() -> dict[str, str]:
    """Versions of what was measured."""
    from importlib.metadata import version

    found = {name: version(name) for name in ("fedkit-fl", "flwr", "ray", "torch", "timm")}
    return {**found, "python": platform.python_version()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--samples", type=int, default=50, help="training images per client")
    parser.add_argument("--per-round", type=int, default=5, help="clients per round")
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD only")
    parser.add_argument("--image-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ray-cpus", type=int, default=2, help="CPUs of Flower's Ray cluster")
    parser.add_argument("--client-cpus", type=float, default=1.0, help="CPUs per Flower client")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/flower_compare.jsonl"))
    args = parser.parse_args()
    torch.set_num_threads(1)

    fedkit_result, shared = run_fedkit(args)
    print(f"fedkit: {fedkit_result['wall_s']:.2f} s", flush=True)
    flower_result = run_flower(args, shared)
    ratio = flower_result["wall_s"] / fedkit_result["wall_s"]
    steady = flower_result["rounds_after_first_s"] / fedkit_result["rounds_after_first_s"]

    print()
    print("| framework | wall s | rounds 2..R s | final test accuracy |")
    print("|---|---|---|---|")
    for name, result in (("fedkit", fedkit_result), ("Flower", flower_result)):
        print(
            f"| {name} | {result['wall_s']:.2f} | {result['rounds_after_first_s']:.2f} "
            f"| {result['test_accuracy']:.4f} |"
        )
    print()
    print(f"speed ratio (Flower s / fedkit s): {ratio:.1f}× wall, {steady:.1f}× rounds 2..R")

    settings = {k: v for k, v in vars(args).items() if k != "out"}
    settings.update(dataset="digits", backbone="test_resnet", partition="iid")
    line = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": settings,
        "fedkit": fedkit_result,
        "flower": flower_result,
        "ratio_wall": ratio,
        "ratio_rounds_after_first": steady,
        "versions": versions(),
        "cpus": os.cpu_count(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
