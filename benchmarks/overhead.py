"""Framework overhead: fedkit's round loop against a bare PyTorch loop doing the same steps.

    OMP_NUM_THREADS=1 python benchmarks/overhead.py [--cases quickstart tiny fedu_dapu] \
        [--repeats 3] [--root ../shared/data/cifar10]

Cases: ``quickstart`` (the quickstart recipe's model, data and settings, 3 rounds),
``tiny`` (500 IID clients of about 3 digits images, 50 per round, 5 rounds) and
``fedu_dapu`` (FedU + DAPU local SSL on 2,000 CIFAR images of the ImageFolder at
``--root``: 5 clients, 2 rounds of 1 epoch, two views, EMA target).

Both sides use the same data objects (the run's ``FederatedData``), the same initial
model, clients per round, local epochs, batch size, optimiser and a sample-weighted mean;
evaluation is off. The bare loop is what a researcher would write by hand: load the global
state, train on the client's images (normalised per batch, or two augmented views with
the same batched augmentation), keep a copy of the state, average (FedU: plus each
client's target and predictor, and DAPU's divergence). Each side runs all its rounds
once as a warm-up, then the two take turns ``--repeats`` times (the order swapped every
repeat), each from a freshly prepared start that is not timed; the best time of each is
reported (single passes vary by ±15 % on these machines). A ratio bare / fedkit of 1.00
means no measurable overhead.
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from fedkit.config.schema import validate
from fedkit.core.engine import Run, prepare, rounds
from fedkit.models.backbones import build_classifier, logits
from fedkit.ssl.augment import TwoViewAugment
from fedkit.testing import tiny_recipe
from fedkit.training import make_optimizer, round_lr

CASES: dict[str, dict[str, Any]] = {
    "quickstart": {
        "backbone": {"name": "test_convnext"},
        "data": {
            "dataset": "digits",
            "image_size": 32,
            "num_clients": 10,
            "partition": {"name": "dirichlet", "alpha": 0.5},
            "local_test_size": 20,
            "max_train": None,
        },
        "federation": {
            "rounds": 3,
            "clients_per_round": 10,
            "local_epochs": 2,
            "batch_size": 32,
            "optimizer": {"name": "adam", "lr": 0.002},
        },
    },
    "tiny": {
        "backbone": {"name": "test_resnet"},
        "data": {
            "dataset": "digits",
            "image_size": 16,
            "num_clients": 500,
            "partition": {"name": "iid"},
            "local_test_size": 2,
            "max_train": 1500,
        },
        "federation": {
            "rounds": 5,
            "clients_per_round": 50,
            "local_epochs": 1,
            "batch_size": 32,
            "optimizer": {"name": "sgd", "lr": 0.05},
        },
    },
}


SSL = {
    "backbone": {"name": "test_resnet"},
    "data": {
        "dataset": "imagefolder",
        "image_size": 32,
        "num_clients": 5,
        "partition": {"name": "classes_per_client", "k": 2},
        "max_train": 2000,
        "max_test": 100,
        "local_test_size": 2,
    },
    "federation": {
        "rounds": 2,
        "clients_per_round": 5,
        "local_epochs": 1,
        "batch_size": 64,
        "drop_last": True,
        "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4},
        "lr_schedule": "cosine",
    },
    "plugins": [
        {
            "fedu": {
                "projector_hidden": 512,
                "projection_dim": 128,
                "predictor_hidden": 512,
                "crop_scale": [0.2, 1.0],
            }
        },
        {"dapu": {"mu": 0.4}},
    ],
}


def recipe(case: str, root: str) -> dict[str, Any]:
    if case == "fedu_dapu":
        raw = tiny_recipe(**copy.deepcopy(SSL))
        raw["data"]["root"] = root
    else:
        raw = tiny_recipe(**CASES[case])
    raw["evaluation"] = {"protocol": "none", "every": 0}
    raw["engine"] = {"executor": "sequential", "store": "memory"}
    return raw


def fedkit_side(raw: dict[str, Any]) -> Callable[[], Callable[[], None]]:
    """Each call prepares a fresh run (untimed) and returns its timed part: the rounds."""
    recipe_ = validate(raw)

    def fresh() -> Callable[[], None]:
        run = prepare(recipe_)

        def go() -> None:
            for _ in rounds(run):
                pass
            run.close()

        return go

    return fresh


def shards(run: Run) -> list[tuple[Tensor, Tensor]]:
    """Each client's (uint8 images, labels), indexed out of the run's own data."""
    train = run.data.train
    return [
        (train.images[torch.as_tensor(i)], train.labels[torch.as_tensor(i)])
        for i in run.data.clients
    ]


def sampled(generator: torch.Generator, clients: int, k: int) -> list[int]:
    return sorted(torch.randperm(clients, generator=generator)[:k].tolist())


def average(states: list[dict[str, Tensor]], weights: list[float]) -> dict[str, Tensor]:
    """The weighted mean of every key, accumulated in float64."""
    total = sum(weights)
    out = {}
    for key, first in states[0].items():
        acc = sum(s[key].double() * (w / total) for s, w in zip(states, weights, strict=True))
        out[key] = acc.to(first.dtype) if first.is_floating_point() else acc.floor().long()
    return out


class RunningMean:
    """A weighted mean accumulated client by client (float64 sums, one per key): the
    aggregation a hand-written cross-device loop does, with no copy of the uploads kept."""

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.weight = 0.0

    def add(self, state: dict[str, Tensor], weight: float) -> None:
        for key, value in state.items():
            if key in self.sums:
                self.sums[key].add_(value.double(), alpha=weight)
            else:
                self.sums[key] = value.double() * weight
                self.dtypes[key] = value.dtype
        self.weight += weight

    def result(self) -> dict[str, Tensor]:
        out = {}
        for key, total in self.sums.items():
            mean = total / self.weight
            floating = self.dtypes[key].is_floating_point
            out[key] = mean.to(self.dtypes[key]) if floating else mean.floor().long()
        return out


class Shared(NamedTuple):
    """What every client job of the bare loop shares, looked up once: the federation
    settings, the normalisation and whether the model has BatchNorm."""

    cfg: Any
    mean: Tensor
    std: Tensor
    batchnorm: bool


def shared(run: Run, model: torch.nn.Module) -> Shared:
    train = run.data.train
    return Shared(
        run.recipe.federation,
        torch.tensor(train.mean).view(1, -1, 1, 1),
        torch.tensor(train.std).view(1, -1, 1, 1),
        any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()),
    )


def no_mark(phase: str) -> None:
    """The default ``mark`` of ``bare_client``: no timing."""


def bare_client(
    model: torch.nn.Module,
    state: dict[str, Tensor],
    shard: tuple[Tensor, Tensor],
    common: Shared,
    round_number: int,
    generator: torch.Generator,
    mark: Callable[[str], None] = no_mark,
) -> dict[str, Tensor]:
    """One client's job in the bare FedAvg loop: load the global state, train the local
    epochs, copy the state. ``mark(phase)`` is called as each phase ends (the breakdown
    in ``overhead_breakdown.py`` times the phases with it)."""
    images, labels = shard
    cfg = common.cfg
    model.load_state_dict(state)
    mark("load_state_dict")
    model.train()
    optimizer = make_optimizer(model.parameters(), cfg.optimizer, round_lr(cfg, round_number))
    for _ in range(cfg.local_epochs):
        order = torch.randperm(len(labels), generator=generator)
        for start in range(0, len(labels), cfg.batch_size):
            idx = order[start : start + cfg.batch_size]
            if len(idx) < 2 and common.batchnorm:
                continue  # as fedkit: BatchNorm cannot train on one image
            x = (images[idx].float() / 255.0 - common.mean) / common.std
            loss = F.cross_entropy(logits(model, x), labels[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    mark("train")
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mark("copy of the state after training")
    return out


def bare_supervised(run: Run) -> Callable[[], Callable[[], None]]:
    """FedAvg by hand on the same data objects and initial model."""
    cfg = run.recipe.federation
    model = build_classifier(run.recipe.backbone, run.server.num_classes)
    initial = {k: v.clone() for k, v in run.server.pool[0].items()}
    common, data = shared(run, model), shards(run)

    def fresh() -> Callable[[], None]:
        generator = torch.Generator().manual_seed(0)

        def go() -> None:
            state = {k: v.clone() for k, v in initial.items()}
            for r in range(1, cfg.rounds + 1):
                picked = sampled(generator, len(data), cfg.clients_per_round)
                total = RunningMean()
                for c in picked:
                    upload = bare_client(model, state, data[c], common, r, generator)
                    total.add(upload, float(len(data[c][1])))
                state = total.result()

        return go

    return fresh


def bare_fedu(run: Run) -> Callable[[], Callable[[], None]]:
    """FedU + DAPU by hand: BYOL on two views with an EMA target per client, the online
    network and predictor averaged, DAPU's divergence deciding each client's predictor."""
    cfg = run.recipe.federation
    opts = run.plugins.objects["fedu"].options
    mu = run.plugins.objects["dapu"].options.mu
    model = copy.deepcopy(run.server.template)
    initial = {k: v.clone() for k, v in run.server.pool[0].items()}
    train = run.data.train
    augment = TwoViewAugment(
        tuple(train.images.shape[-2:]), train.mean, train.std, scale=opts.crop_scale
    )
    data = shards(run)
    online = ("encoder.", "projector.", "predictor.")
    convs = [
        k
        for k, v in initial.items()
        if k.startswith("encoder.") and "conv" in k and "weight" in k and v.dim() == 4
    ]
    params = [p for part in ("encoder", "projector", "predictor") for p in model[part].parameters()]
    pairs = [
        (t, o)
        for src, dst in (("encoder", "target_encoder"), ("projector", "target_projector"))
        for t, o in zip(model[dst].parameters(), model[src].parameters(), strict=True)
    ]

    def byol(p: Tensor, z: Tensor) -> Tensor:
        return (2 - 2 * F.cosine_similarity(p, z.detach(), dim=-1)).mean()

    def fresh() -> Callable[[], None]:
        generator = torch.Generator().manual_seed(0)
        targets: dict[int, dict[str, Tensor]] = {}
        predictors: dict[int, dict[str, Tensor]] = {}
        divergences: dict[int, float] = {}

        def go() -> None:
            state = {k: v.clone() for k, v in initial.items() if k.startswith(online)}
            for r in range(1, cfg.rounds + 1):
                states, weights = [], []
                for c in sampled(generator, len(data), cfg.clients_per_round):
                    images, _ = data[c]
                    load = dict(state)
                    if c in targets:
                        load.update(targets[c])
                        if divergences[c] >= mu:
                            load.update(predictors[c])
                    else:
                        for k, v in state.items():
                            if k.startswith(("encoder.", "projector.")):
                                load["target_" + k] = v
                    model.load_state_dict(load)
                    model.train()
                    optimizer = make_optimizer(params, cfg.optimizer, round_lr(cfg, r))
                    for _ in range(cfg.local_epochs):
                        order = torch.randperm(len(images), generator=generator)
                        stop = len(images) - len(images) % cfg.batch_size
                        for start in range(0, stop, cfg.batch_size):
                            v1, v2 = augment(
                                images[order[start : start + cfg.batch_size]], generator
                            )
                            p1 = model["predictor"](model["projector"](model["encoder"](v1)))
                            p2 = model["predictor"](model["projector"](model["encoder"](v2)))
                            with torch.no_grad():
                                t1 = model["target_projector"](model["target_encoder"](v1))
                                t2 = model["target_projector"](model["target_encoder"](v2))
                            loss = byol(p1, t2) + byol(p2, t1)
                            optimizer.zero_grad(set_to_none=True)
                            loss.backward()
                            optimizer.step()
                            with torch.no_grad():
                                for t, o in pairs:
                                    t.mul_(opts.momentum).add_(o, alpha=1 - opts.momentum)
                    after = {k: v.detach().clone() for k, v in model.state_dict().items()}
                    divergences[c] = float(
                        torch.stack(
                            [
                                torch.linalg.vector_norm(state[k].double() - after[k].double())
                                for k in convs
                            ]
                        ).mean()
                    )
                    targets[c] = {k: v for k, v in after.items() if k.startswith("target_")}
                    predictors[c] = {k: v for k, v in after.items() if k.startswith("predictor.")}
                    states.append({k: v for k, v in after.items() if k.startswith(online)})
                    weights.append(float(len(images)))
                state = average(states, weights)

        return go

    return fresh


def measure(case: str, root: str, repeats: int) -> dict[str, float]:
    raw = recipe(case, root)
    fedkit_fresh = fedkit_side(raw)
    reference = prepare(validate(raw))
    bare_fresh = (bare_fedu if case == "fedu_dapu" else bare_supervised)(reference)
    sides = {"bare": bare_fresh, "fedkit": fedkit_fresh}
    times: dict[str, list[float]] = {"bare": [], "fedkit": []}
    for repeat in range(repeats + 1):  # the first pass of each side is a warm-up
        order = list(sides.items()) if repeat % 2 else list(sides.items())[::-1]
        for name, fresh in order:
            go = fresh()
            began = time.perf_counter()
            go()
            if repeat:
                times[name].append(time.perf_counter() - began)
    reference.close()
    best = {name: min(values) for name, values in times.items()}
    return {**best, "ratio": best["bare"] / best["fedkit"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases", nargs="+", default=[*CASES, "fedu_dapu"], choices=[*CASES, "fedu_dapu"]
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--root", default="../shared/data/cifar10", help="ImageFolder root of the SSL case"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| workload | bare PyTorch loop | fedkit `run_round` | bare / fedkit |")
    print("|---|---|---|---|")
    for case in args.cases:
        m = measure(case, args.root, args.repeats)
        print(
            f"| {case} | {m['bare']:.2f} s | {m['fedkit']:.2f} s | {m['ratio']:.2f} |", flush=True
        )


if __name__ == "__main__":
    main()
