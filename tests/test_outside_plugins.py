"""Plugins written the way an outside package writes them, against ``fedkit`` alone:
FedProx, SCAFFOLD, FedBN, a trimmed mean, Ditto, FedDyn, a data set and a partitioner
(MOON is in test_author_surface.py). Each is source text that imports nothing from fedkit
but the public face (an AST check), run in a tiny federation with one behaviour checked.
"""

from __future__ import annotations

import ast

import pytest
import torch

import fedkit
from fedkit.testing import RunResult, run_recipe, tiny_recipe

FEDPROX = """
from fedkit import hookimpl


class FedProx:
    @hookimpl
    def loss_terms(self, ctx, model, batch):
        pull = [
            (w - ctx.received[n].to(w.device)).pow(2).sum()
            for n, w in model.named_parameters()
            if n in ctx.received and w.requires_grad
        ]
        return {"prox": 0.5 * sum(pull)}
"""

SCAFFOLD = """
import torch

from fedkit import DROP, hookimpl

C, DELTA, OWN = "scaffold.c.", "scaffold.dc.", "c."


class Scaffold:
    @hookimpl
    def auxiliary_keys(self, server):
        return ["scaffold.*"]

    @hookimpl
    def aggregate(self, server, cluster, uploads):
        total = sum(u.weight for u in uploads)
        claims = {}
        for key in (k for k in uploads[0].tensors if k.startswith(DELTA)):
            name = key[len(DELTA):]
            mean = sum(u.tensors[key] * (u.weight / total) for u in uploads)
            claims[C + name] = server.pool[cluster].get(C + name, 0) + mean
            claims[key] = DROP
        return claims

    @hookimpl
    def before_step(self, ctx, model, optimizer):
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.grad is not None and C + n in ctx.received:
                    fix = ctx.received[C + n] - ctx.tensors.get(OWN + n, 0)
                    p.add_(fix.to(p.device), alpha=-ctx.lr)

    @hookimpl
    def upload_selection(self, ctx, local, model):
        out = {}
        for n, p in model.named_parameters():
            if p.requires_grad and n in ctx.received and ctx.steps:
                own = ctx.tensors.get(OWN + n, torch.zeros_like(p, device="cpu"))
                c = ctx.received.get(C + n, torch.zeros_like(own))
                new = own - c + (ctx.received[n] - local[n].cpu()) / (ctx.steps * ctx.lr)
                ctx.tensors[OWN + n], out[DELTA + n] = new, new - own
        return out
"""

FEDBN = """
from fedkit import hookimpl, norm_keys


class FedBN:
    @hookimpl
    def private_keys(self, server, model):
        return norm_keys(model)
"""

TRIMMED_MEAN = """
import torch
from pydantic import Field

from fedkit import PluginOptions, hookimpl


class TrimmedMean:
    class Options(PluginOptions):
        trim: int = Field(1, ge=0)

    def __init__(self, options):
        self.trim = options.trim

    @hookimpl
    def aggregate(self, server, cluster, uploads):
        if len(uploads) <= 2 * self.trim:
            return None
        claims = {}
        for key, first in uploads[0].tensors.items():
            if first.is_floating_point():
                stacked, _ = torch.stack([u.tensors[key] for u in uploads]).sort(dim=0)
                claims[key] = stacked[self.trim : len(uploads) - self.trim].mean(dim=0)
        return claims
"""

DITTO = """
import copy

from fedkit import (
    Objective, hookimpl, make_optimizer, run_loop, split_loss, supervised_objective
)

MINE = "ditto."


class Ditto:
    @hookimpl
    def after_local_train(self, ctx, model, before):
        personal = copy.deepcopy(model)
        kept = {k[len(MINE):]: v for k, v in ctx.tensors.items() if k.startswith(MINE)}
        personal.load_state_dict(kept or before)
        base = supervised_objective(ctx, personal)

        def loss(m, batch):
            value, _ = split_loss(base.loss(m, batch))
            pull = sum((p - before[n]).pow(2).sum() for n, p in m.named_parameters())
            return value + 0.05 * pull

        cfg = ctx.recipe.federation
        optimizer = make_optimizer(personal.parameters(), cfg.optimizer, ctx.lr)
        run_loop(personal, Objective(loss, base.batches), optimizer, 1)
        for key, value in personal.state_dict().items():
            ctx.tensors[MINE + key] = value.detach().cpu()

    @hookimpl
    def personal_model(self, ctx, model):
        if not any(k.startswith(MINE) for k in ctx.tensors):
            return None
        model.load_state_dict({k[len(MINE):]: v for k, v in ctx.tensors.items()})
        return model
"""

FEDDYN = """
from fedkit import hookimpl

H = "feddyn.h."
ALPHA = 0.01


class FedDyn:
    @hookimpl
    def loss_terms(self, ctx, model, batch):
        linear = sum(
            (p * ctx.tensors[H + n].to(p.device)).sum()
            for n, p in model.named_parameters()
            if H + n in ctx.tensors
        )
        pull = sum(
            (p - ctx.received[n].to(p.device)).pow(2).sum()
            for n, p in model.named_parameters()
            if n in ctx.received and p.requires_grad
        )
        return {"dyn": 0.5 * ALPHA * pull - linear}

    @hookimpl
    def after_local_train(self, ctx, model, before):
        ctx.log(had_state=float(any(k.startswith(H) for k in ctx.tensors)))
        for n, p in model.named_parameters():
            if n in before:
                h = ctx.tensors.get(H + n, 0)
                ctx.tensors[H + n] = h - ALPHA * (p.detach().cpu() - before[n].cpu())
"""

DATASET = """
import torch

from fedkit import RawImages, hookimpl


def stripes(cfg, split, limit):
    n = 120 if split == "train" else 40
    labels = torch.arange(n) % 2
    images = torch.zeros(n, 3, 8, 8, dtype=torch.uint8)
    images[labels == 1, :, ::2] = 255
    return RawImages(images, labels, ["plain", "striped"])


class Stripes:
    @staticmethod
    @hookimpl
    def register_datasets(register):
        register("stripes", stripes, needs_root=False)
"""

PARTITIONER = """
import numpy as np

from fedkit import Partition, hookimpl


def halves(labels, num_clients, rng):
    order = np.argsort(labels, kind="stable")
    return Partition([np.sort(part) for part in np.array_split(order, num_clients)])


class Halves:
    @staticmethod
    @hookimpl
    def register_partitioners(register):
        register("halves", halves)
"""

SOURCES = {
    "FedProx": FEDPROX,
    "Scaffold": SCAFFOLD,
    "FedBN": FEDBN,
    "TrimmedMean": TRIMMED_MEAN,
    "Ditto": DITTO,
    "FedDyn": FEDDYN,
    "Stripes": DATASET,
    "Halves": PARTITIONER,
}


def plugin(name: str) -> type:
    namespace: dict = {}
    exec(compile(SOURCES[name], f"<outside {name}>", "exec"), namespace)  # noqa: S102
    return namespace[name]


def one_round(*plugins: str, **sections) -> RunResult:
    """FedAvg with ``plugins`` (class names, listed lower-case) for one SGD round."""
    raw = tiny_recipe(
        plugins=["fedavg", *(p.lower() for p in plugins)],
        federation={"rounds": 1, "optimizer": {"name": "sgd", "lr": 0.05}},
        **sections,
    )
    return run_recipe(raw, plugins={p.lower(): plugin(p) for p in plugins})


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_each_outside_plugin_imports_only_the_public_face(name):
    for node in ast.walk(ast.parse(SOURCES[name])):
        modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
            if node.module == "fedkit":
                assert {a.name for a in node.names} <= set(fedkit.__all__)
        assert not [m for m in modules if m.startswith("fedkit.")], f"{name} imports {modules}"


def test_fedprox_adds_its_term_to_the_logged_loss():
    assert one_round("FedProx").rows[-1]["train_loss_prox"] > 0


def test_scaffold_keeps_its_control_variates_in_the_cluster_state():
    pool = one_round("Scaffold").pool[0]
    controls = [k for k in pool if k.startswith("scaffold.c.")]
    assert controls and not any(k.startswith("scaffold.dc.") for k in pool)
    assert any(pool[k].abs().sum() > 0 for k in controls)


def test_fedbn_keeps_the_normalisation_keys_on_the_clients():
    pool = one_round("FedBN").pool[0]
    assert "classifier.weight" in pool and not any("running_mean" in k for k in pool)


def test_a_trimmed_mean_claim_ignores_an_outlier_the_plain_mean_follows():
    uploads = [
        fedkit.Upload(c, 1.0, {"w": torch.tensor([v])}) for c, v in enumerate((1.0, 2.0, 90.0))
    ]
    trimmed = plugin("TrimmedMean")(plugin("TrimmedMean").Options())
    assert trimmed.aggregate(None, 0, uploads)["w"].item() == 2.0  # the plain mean is 31
    assert one_round("TrimmedMean").rows[-1]["clients"]


def test_ditto_evaluates_a_personal_model_that_differs_from_the_global_one():
    plain = one_round(evaluation={"personal": True})
    ditto = one_round("Ditto", evaluation={"personal": True})
    assert plain.pool[0]["classifier.weight"].equal(ditto.pool[0]["classifier.weight"])
    assert plain.rows[-1]["personalized_accuracy"] != ditto.rows[-1]["personalized_accuracy"]


def test_feddyn_keeps_its_state_on_the_clients_between_rounds():
    raw = tiny_recipe(plugins=["fedavg", "feddyn"])
    row = run_recipe(raw, plugins={"feddyn": plugin("FedDyn")}).rows[-1]
    assert all(v["had_state"] == 1.0 for v in row["per_client"].values())
    assert "train_loss_dyn" in row


def test_a_registered_data_set_and_partitioner_run_a_federation():
    raw = tiny_recipe(
        data={
            "dataset": "stripes",
            "max_train": None,
            "image_size": 8,
            "partition": {"name": "halves"},
        }
    )
    raw["federation"]["rounds"] = 1
    result = run_recipe(raw, plugins={"stripes": plugin("Stripes"), "halves": plugin("Halves")})
    assert 0.0 <= result.rows[-1]["test_accuracy"] <= 1.0
