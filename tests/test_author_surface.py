"""The smaller author surface of contract v3: loss terms see the objective's forward
outputs (a representation-level regulariser composes with any method), ``ctx.lr`` is the
learning rate the optimiser used, ``ctx.scratch`` lives for one job, and every attribute
of the client context and the server is documented in docs/plugins.md."""

from __future__ import annotations

import copy
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import prepared, ssl_recipe, tiny_recipe
from pydantic import Field

from fedkit import ClientContext, PluginOptions, Server, hookimpl
from fedkit.core.engine import run_round
from fedkit.plugin import context as context_module
from fedkit.testing import assert_same_runs, run_recipe
from fedkit.training import make_optimizer, round_lr

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


@pytest.mark.slow
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


class OwnOptimiser:
    """Trains a copy with an optimiser of its own, built with ``make_optimizer``."""

    @hookimpl
    def after_local_train(self, ctx, model, before):
        opt = make_optimizer(model.parameters(), ctx.recipe.federation.optimizer, ctx.lr)
        ctx.log(ctx_lr=ctx.lr, own_lr=opt.param_groups[0]["lr"])


def test_the_job_carries_the_rounds_lr_and_the_client_trains_with_it():
    """The engine puts the round's learning rate in every job; the client's ``ctx.lr``,
    the fit loop's optimiser and a plugin's ``make_optimizer`` all take that value, not
    one of their own (a job sent with another rate trains with that rate)."""
    raw = tiny_recipe(
        plugins=["fedavg", "rates", "own"], federation={"rounds": 3, "lr_schedule": "cosine"}
    )
    run = prepared(raw, rates=Rates, own=OwnOptimiser)
    sent, execute = [], run.executor.run

    def halved(jobs):
        sent.append({job.lr for job in jobs})
        return execute([replace(job, lr=job.lr / 2) for job in jobs])

    run.executor.run = halved
    for r in (1, 2, 3):
        row = run_round(run, r)
        want = round_lr(run.recipe.federation, r)
        assert sent[-1] == {want}  # computed once by the server, the same in every job
        for values in row["per_client"].values():
            assert values["ctx_lr"] == values["own_lr"] == values["step_lr"] == want / 2
    run.close()
    with pytest.raises(TypeError, match=r"federation.optimizer, ctx.lr\).*row M31"):
        make_optimizer([], run.recipe.federation, 1)  # the old (params, federation, round)


def _public(cls: type, extra: set[str]) -> set[str]:
    names = {n for n in dir(cls) if not n.startswith("_")}
    return names | extra


def test_every_context_and_server_attribute_is_documented():
    page = (ROOT / "docs" / "plugins.md").read_text()
    slots = {n for n in ClientContext.__slots__ if not n.startswith("_")}
    assert _public(ClientContext, slots) == set(context_module.ATTRIBUTES)
    for name in context_module.ATTRIBUTES:
        assert f"`ctx.{name}`" in page, f"docs/plugins.md does not document ctx.{name}"
    assert _public(Server, set()) == documented_server_attributes()


def documented_server_attributes() -> set[str]:
    """The attributes the server tables of docs/plugins.md name (in their first column)."""
    page = (ROOT / "docs" / "plugins.md").read_text()
    cells = [line.split(" | ")[0] for line in page.splitlines() if line.startswith("| `server.")]
    return set(re.findall(r"`server\.(\w+)`", " ".join(cells)))


def test_the_guide_opens_with_at_most_eight_concepts():
    page = (ROOT / "docs" / "plugins.md").read_text()
    opening = page.split("## The concepts", 1)[1].split("\n## ", 1)[0]
    concepts = [line for line in opening.splitlines() if re.match(r"\d+\. ", line)]
    assert 1 <= len(concepts) <= 8


def test_the_server_view_is_read_only_and_logs_into_the_rounds_row():
    run = prepared(tiny_recipe())
    server = run.server
    for name in [*documented_server_attributes(), "data", "extra"]:
        with pytest.raises(AttributeError):
            setattr(server, name, None)
    server.state["kept"] = 1  # what plugins keep changes in place
    server.log(seen=2)
    assert run.record.row["seen"] == 2 and run.record.state == {"kept": 1}
    run.close()
