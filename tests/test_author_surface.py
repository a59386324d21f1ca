"""The smaller author surface of contract v3: loss terms see the objective's forward
outputs (a representation-level regulariser composes with any method), ``ctx.lr`` is the
learning rate the optimiser used, ``ctx.scratch`` lives for one job, and every attribute
of the client context and the server is documented in docs/plugins.md."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import prepared, tiny_recipe
from pydantic import Field
from test_ssl_plugins import ssl_recipe

from fedkit import ClientContext, PluginOptions, Server, hookimpl
from fedkit.core import server as server_module
from fedkit.core.engine import run_round
from fedkit.plugin import context as context_module
from fedkit.testing import assert_same_runs, run_recipe
from fedkit.training import round_lr

ROOT = Path(__file__).resolve().parent.parent


class Moon:
    """MOON-style: pull each step's representation towards the global model's."""

    class Options(PluginOptions):
        mu: float = Field(1.0, ge=0)

    def __init__(self, options: Options) -> None:
        self.mu = options.mu

    @hookimpl
    def loss_terms(self, ctx, model, batch, outputs):
        if "global" not in ctx.scratch:  # the global encoder, once per job
            encoder = copy.deepcopy(model["encoder"]).eval()
            start = len("encoder.")
            own = {k[start:]: v for k, v in ctx.received.items() if k.startswith("encoder.")}
            encoder.load_state_dict(own)
            ctx.scratch["global"] = encoder.requires_grad_(False)
        features = outputs["features"]
        ctx.scratch["checked"] = ctx.scratch.get("checked", 0) + 1
        assert features.requires_grad and features.shape[0] == len(batch[0])
        with torch.no_grad():
            target = ctx.scratch["global"](batch[0])
        return {"moon": self.mu * (1 - F.cosine_similarity(features, target)).mean()}

    @hookimpl
    def after_local_train(self, ctx, model, before):
        ctx.log(moon_steps=ctx.scratch["checked"])


@pytest.mark.parametrize(
    "raw",
    [tiny_recipe(plugins=["fedavg", "moon"]), ssl_recipe("fedsimclr", "moon")],
    ids=["fedavg", "fedsimclr"],
)
def test_a_representation_regulariser_composes_with_any_method(raw):
    result = run_recipe(raw, plugins={"moon": Moon})
    row = result.rows[-1]
    assert row["train_loss_moon"] > 0
    steps = [v["moon_steps"] for v in row["per_client"].values()]
    assert all(s > 0 for s in steps)  # every step saw the objective's features
    off = copy.deepcopy(raw)
    off["plugins"][-1] = {"moon": {"mu": 0.0}}
    plain = copy.deepcopy(raw)
    plain["plugins"] = plain["plugins"][:-1]
    assert_same_runs(
        run_recipe(plain),
        run_recipe(off, plugins={"moon": Moon}),
        ignore=["train_loss_moon", "train_moon_steps"],
    )


def test_the_objectives_features_are_the_encoders_output_in_the_graph():
    from fedkit.training.supervised import supervised_step

    model = torch.nn.ModuleDict(
        {"encoder": torch.nn.Linear(4, 3), "classifier": torch.nn.Linear(3, 2)}
    )
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 0, 1, 1])
    loss, outputs = supervised_step(model, (x, y))
    assert torch.equal(outputs["features"], model["encoder"](x))
    assert torch.equal(loss, F.cross_entropy(outputs["logits"], y))
    assert outputs["features"].grad_fn is not None


class Rates:
    """Reports the learning rate it sees at a step and after training."""

    @hookimpl
    def before_step(self, ctx, model, optimizer):
        assert ctx.lr == optimizer.param_groups[0]["lr"]
        ctx.scratch["seen"] = ctx.lr

    @hookimpl
    def after_local_train(self, ctx, model, before):
        ctx.log(step_lr=ctx.scratch["seen"], lr=ctx.lr)


def test_ctx_lr_is_the_learning_rate_the_optimiser_used():
    raw = tiny_recipe(
        plugins=["fedavg", "rates"], federation={"rounds": 3, "lr_schedule": "cosine"}
    )
    run = prepared(raw, rates=Rates)
    for r in (1, 2, 3):
        row = run_round(run, r)
        want = round_lr(run.recipe.federation, r)
        assert row["train_step_lr"] == pytest.approx(want) and row["train_lr"] == pytest.approx(
            want
        )
    memory = run.executor.memory(0)
    assert "seen" not in memory.state and not memory.tensors  # scratch is never kept
    run.close()


def _public(cls: type, extra: set[str]) -> set[str]:
    names = {n for n in dir(cls) if not n.startswith("_")}
    return names | extra


def test_every_context_and_server_attribute_is_documented():
    page = (ROOT / "docs" / "plugins.md").read_text()
    slots = {n for n in ClientContext.__slots__ if not n.startswith("_")}
    assert _public(ClientContext, slots) == set(context_module.ATTRIBUTES)
    run = prepared(tiny_recipe())
    server = run.server
    instance = {n for n in vars(server) if not n.startswith("_")}
    assert _public(Server, instance) == set(server_module.ATTRIBUTES)
    run.close()
    for name in context_module.ATTRIBUTES:
        assert f"`ctx.{name}`" in page, f"docs/plugins.md does not document ctx.{name}"
    for name in server_module.ATTRIBUTES:
        assert f"`server.{name}`" in page, f"docs/plugins.md does not document server.{name}"


def test_the_guide_opens_with_at_most_eight_concepts():
    page = (ROOT / "docs" / "plugins.md").read_text()
    opening = page.split("## The concepts", 1)[1].split("\n## ", 1)[0]
    concepts = [line for line in opening.splitlines() if re.match(r"\d+\. ", line)]
    assert 1 <= len(concepts) <= 8
