"""The client side of a run: what happens to one sampled client in one round.

A ``Worker`` is built from a ``ClientSetup`` wherever clients run (in the server's
process for the sequential executor, in a Ray actor, on a device elsewhere). It holds the
client-side plugin instances and one working model, and turns a ``ClientJob`` plus the
client's data and memory into a ``ClientResult``:

training_data → select_cluster → update_client → local_train | local_objective + fit →
after_local_train → upload_selection → process_upload,

and an ``EvalJob`` plus the same into an ``EvalResult``: the client's personal model
(``personal_model``), scored by the core's protocol and by ``evaluate_client``, on the
client. Only scores leave it.

``run_safely`` turns a client's failure (an exception in its hooks, a non-finite value
in its upload, an injected fault) into a failed result: failures are data, the round
goes on without that client. Bad input (a ``FedkitError``) still stops the run.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from fedkit.core.faults import InjectedCrash, InjectedFault
from fedkit.core.messages import (
    ClientJob,
    ClientResult,
    ClientSetup,
    EvalJob,
    EvalResult,
)
from fedkit.data.datasets import ImageSet
from fedkit.data.federated import ClientData
from fedkit.errors import FedkitError, MissingOffer, PluginError, RecipeError
from fedkit.evaluation.scoring import score_encoder, supervised_scores
from fedkit.plugin.context import ClientContext, ModelKeys, receive
from fedkit.plugin.hookspecs import CLIENT
from fedkit.plugin.keys import parameter_keys
from fedkit.plugin.manager import Plugins
from fedkit.plugin.markers import DROP
from fedkit.plugin.reported import checked as checked_values
from fedkit.rundir.store import ClientMemory
from fedkit.seeding import derive, seed_everything
from fedkit.training import precision
from fedkit.training.loop import NonFiniteLoss

Benchmark = tuple[ImageSet, ImageSet]
"""The simulation's sets a client's encoder is scored on (train, test), when asked."""


@torch.no_grad()
def snapshot(model: nn.Module) -> dict[str, Tensor]:
    """A copy of every tensor of ``model``'s state: the walk that keeps the tensors
    themselves (no detached alias made per key), cloned with autograd off."""
    return {k: v.clone() for k, v in model.state_dict(keep_vars=True).items()}


def plain_loading(model: nn.Module) -> bool:
    """Whether ``load_state_dict`` on ``model`` amounts to copying each tensor into place:
    no module overrides ``_load_from_state_dict`` (BatchNorm's override only fills in a
    missing counter) or registers a load hook."""
    for module in model.modules():
        own = type(module)._load_from_state_dict
        if own is not nn.Module._load_from_state_dict and not isinstance(module, _BatchNorm):
            return False
        if module._load_state_dict_pre_hooks or module._load_state_dict_post_hooks:
            return False
    return True


def non_finite(tensors: dict[str, Tensor], *, owned: bool = False) -> str | None:
    """The first key whose floating tensor holds a NaN or an infinity, if any.

    A NaN or infinity makes its tensor's sum non-finite, so one check of the sum of the
    sums (Python floats: one reduction per tensor, nothing stacked) clears the usual
    all-finite case (per-tensor checks cost more than training a small client); only a
    non-finite sum (or an overflowing one) searches key by key. With ``owned`` (the
    caller's own fresh copies) the check is PyTorch's fused one of its gradient scaler,
    a single call over every tensor, which writes each value back unchanged."""
    floats = [v for v in tensors.values() if v.is_floating_point()]
    if owned and floats and _all_finite(floats):
        return None
    if not owned and math.isfinite(sum(v.sum().item() for v in floats)):
        return None
    for key, value in tensors.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return key
    return None


def _all_finite(floats: list[Tensor]) -> bool:
    """Whether every value is finite, by the gradient scaler's check with a scale of one
    (``False`` also when the fused check cannot run, so the caller searches)."""
    found = torch.zeros(1, device=floats[0].device)
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(floats, found, torch.ones_like(found))
    except RuntimeError:
        return False
    return not bool(found.item())


class NonFiniteUpload(ArithmeticError):
    """A client's upload holds a NaN or an infinity (the client fails, the round goes on)."""

    def __init__(self, key: str, fetched: list[int]) -> None:
        super().__init__(f"upload key {key!r} holds a non-finite value")
        self.fetched = fetched


class Worker:
    """Runs client jobs with client-side plugins built from the recipe."""

    def __init__(self, setup: ClientSetup) -> None:
        self.setup = setup
        self.plugins = Plugins(setup.recipe, setup.available, side=CLIENT)
        self.device = torch.device(setup.device)
        self.template_state = snapshot(setup.template)
        self.model = copy.deepcopy(setup.template).to(self.device)
        self.keys = ModelKeys(
            frozenset(self.template_state),
            frozenset(parameter_keys(setup.template)),
            frozenset(setup.private),
        )
        self.kept = setup.kept if setup.kept is not None else self.keys.model
        self._wants_before = self.plugins.wants("after_local_train", "before")
        self._plain_loading = plain_loading(self.model)

    def load(self, state: dict[str, Tensor]) -> None:
        """Load a complete state into the working model: one ``copy_`` per tensor when
        every module loads the default way (``load_state_dict``'s per-module machinery
        costs more than a small client's training), else ``load_state_dict``."""
        # the tensors themselves, looked up each time: a layout or device change may
        # have replaced a buffer since the last load
        slots = self.model.state_dict(keep_vars=True) if self._plain_loading else None
        if slots is None or state.keys() != slots.keys():
            self.model.load_state_dict(state)
            return
        pairs = [(slots[k], v) for k, v in state.items()]
        if any(dst.shape != src.shape for dst, src in pairs):
            self.model.load_state_dict(state)  # raises, naming the key
            return
        with torch.no_grad():
            for dst, src in pairs:
                dst.copy_(src)

    def context(
        self,
        round: int,
        lr: float,
        data: ClientData,
        memory: ClientMemory,
        rng: torch.Generator,
        offers: Any = (),
        received: dict[str, Tensor] | None = None,
    ) -> ClientContext:
        """The client context of a job: the client's data, what it keeps, what it got."""
        return ClientContext(
            data.id,
            data.train,
            data.test,
            recipe=self.setup.recipe,
            round=round,
            lr=lr,
            device=self.device,
            rng=rng,
            keys=self.keys,
            state=memory.state,
            tensors=memory.tensors,
            participations=memory.participations,
            cluster=memory.cluster,
            offers=offers,
            received=received,
            plugins=self.plugins,
        )

    def run(
        self, job: ClientJob, data: ClientData, memory: ClientMemory | None
    ) -> tuple[ClientResult, ClientMemory]:
        """One client's round; returns its result and its memory for the next round."""
        memory = memory.copy() if memory is not None else ClientMemory()
        rng = seed_everything(job.seed)
        ctx = self.context(job.round, job.lr, data, memory, rng, job.offers, job.extra)
        self.act_out(job)
        plugins, model = self.plugins, self.model
        ctx.train = plugins.chain("training_data", "data", ctx=ctx, data=ctx.train)
        cluster = plugins.call("select_cluster", ctx=ctx, model=model)
        ctx.cluster = 0 if cluster is None else int(cluster)
        receive(ctx, ctx.cluster)
        local = {**self.template_state, **(memory.model or {})}
        claimed = plugins.claims(
            "update_client", reference=local, ctx=ctx, received=ctx.received, local=local
        )
        merged = {**local, **ctx.received, **claimed}
        self.load({k: merged[k] for k in local})
        before = snapshot(model) if self._wants_before else {}
        self.train(ctx)
        plugins.call("after_local_train", ctx=ctx, model=model, before=before)
        after = snapshot(model)
        chosen = plugins.claims("upload_selection", ctx=ctx, local=after, model=model)
        if self.device.type != "cpu":
            after = {k: v.cpu() for k, v in after.items()}
        upload = {k: v for k, v in after.items() if k not in self.keys.private}
        upload.update({k: v if v is DROP else v.detach().cpu() for k, v in chosen.items()})
        upload = {k: v for k, v in upload.items() if v is not DROP}
        upload = plugins.chain("process_upload", "upload", ctx=ctx, upload=upload)
        if job.fault == "nan":
            upload = poisoned(upload)
        self.check_upload(upload, after, ctx.fetched)
        memory.model = {k: after[k] for k in self.kept}
        memory.state, memory.tensors = ctx.state, ctx.tensors
        memory.participations += 1
        memory.cluster = ctx.cluster
        result = ClientResult(
            data.id, ctx.cluster, float(len(data.train)), upload, ctx.fetched, ctx.logged
        )
        return result, memory

    def check_upload(
        self, upload: dict[str, Tensor], own: dict[str, Tensor], fetched: list[int]
    ) -> None:
        """Raise ``NonFiniteUpload`` when a floating tensor of the upload is not finite: the
        worker's own copies (``own``) in one fused check, what plugins made separately."""
        mine = {k: v for k, v in upload.items() if own.get(k) is v}
        other = {k: v for k, v in upload.items() if own.get(k) is not v}
        bad = non_finite(mine, owned=True) or non_finite(other)
        if bad is not None:
            raise NonFiniteUpload(bad, fetched)

    def act_out(self, job: ClientJob) -> None:
        """Injected faults that act before the client's work (testing)."""
        if job.fault == "exception":
            raise InjectedFault(f"injected exception in client {job.client}, round {job.round}")
        if job.fault == "crash" and job.attempt == 0:
            raise InjectedCrash(f"injected crash of client {job.client}'s worker")
        if job.fault == "straggler":
            time.sleep(self.setup.recipe.faults.delay)

    def run_safely(
        self, job: ClientJob, data: ClientData, memory: ClientMemory | None
    ) -> tuple[ClientResult, ClientMemory | None]:
        """``run``, with a client's failure returned as a failed result (memory ``None``:
        the client's round did not happen). A ``FedkitError`` (bad input), an
        ``InjectedCrash`` (the worker is meant to die) and a ``MissingOffer`` (the
        transport must send a cluster state first) propagate."""
        if job.fault == "dropout":
            return ClientResult.failed(job.client, "dropout", "the client never answered"), None
        try:
            with precision.compute(self.setup.recipe, self.device):
                result, memory = self.run(job, data, memory)
        except (FedkitError, InjectedCrash, MissingOffer):
            raise
        except NonFiniteUpload as exc:
            return ClientResult.failed(job.client, "non-finite", str(exc), exc.fetched), None
        except Exception as exc:  # noqa: BLE001 - any client failure is data
            loss = NonFiniteLoss in (type(exc), type(exc.__cause__))
            kind = "non-finite" if loss else "exception"
            return ClientResult.failed(job.client, kind, failure_text(exc)), None
        return result, memory

    def train(self, ctx: ClientContext) -> None:
        """The plugin's own loop (``local_train``), else the core fit loop on its objective."""
        if self.plugins.call("local_train", ctx=ctx, model=self.model) is not None:
            return
        objective = self.plugins.call("local_objective", ctx=ctx, model=self.model)
        if objective is None:
            raise RecipeError(
                "plugins",
                "a plugin that trains clients (implements local_objective or local_train)",
                self.plugins.names,
            )
        ctx.fit(self.model, objective)

    def personal_state(self, job: EvalJob, memory: ClientMemory) -> dict[str, Tensor]:
        """A client's default personal model: its cluster's state with its own values of
        the private keys (the template's before it first trained)."""
        state = dict(self.template_state)
        state.update({k: v for k, v in job.state.items() if k in state})
        if memory.model is not None:
            state.update({k: memory.model[k] for k in self.keys.private})
        return state

    @torch.no_grad()
    def evaluate(
        self,
        job: EvalJob,
        data: ClientData,
        memory: ClientMemory | None,
        benchmark: Benchmark | None = None,
    ) -> EvalResult:
        """Score a client's personal model on the client: the core's scores (``job.scores``),
        then every plugin's ``evaluate_client``. What the client keeps is not changed."""
        recipe = self.setup.recipe
        kept = memory if memory is not None else ClientMemory()
        rng = torch.Generator().manual_seed(derive(recipe.seed, "evaluate", job.round, data.id))
        ctx = self.context(job.round, job.lr, data, kept.copy(), rng, received=dict(job.state))
        try:
            with precision.compute(recipe, self.device):
                self.load(self.personal_state(job, kept))
                chosen = self.plugins.call("personal_model", ctx=ctx, model=self.model.eval())
                model = (chosen if chosen is not None else self.model).eval()
                scores = supervised_scores(model, data.test, self.device, job.scores)
                if "encoder" in job.scores and kept.model is not None and benchmark is not None:
                    scores.update(self.encoder_scores(model["encoder"], benchmark))
                self.plugins.call("evaluate_client", ctx=ctx, model=model)
        except FedkitError:
            raise
        except Exception as exc:  # noqa: BLE001 - a client's failure is data
            return EvalResult(data.id, {}, "exception", failure_text(exc))
        return EvalResult(data.id, {**checked_values(scores), **ctx.logged})

    def encoder_scores(self, encoder: nn.Module, benchmark: Benchmark) -> dict[str, Any]:
        """The recipe's representation protocol on a client's encoder (it trains a probe)."""
        recipe = self.setup.recipe
        with torch.enable_grad():
            return score_encoder(
                encoder, *benchmark, recipe.evaluation.protocol, recipe.evaluation,
                recipe.seed, self.device,
            )  # fmt: skip


def failure_text(exc: Exception) -> str:
    """How a client's failure reads in the row: a plugin error names plugin and hook."""
    return str(exc) if isinstance(exc, PluginError) else f"{type(exc).__name__}: {exc}"


def poisoned(upload: dict[str, Tensor]) -> dict[str, Tensor]:
    """The upload with its first floating tensor's first value set to NaN (testing)."""
    out = dict(upload)
    for key, value in out.items():
        if value.is_floating_point() and value.numel():
            out[key] = value.clone()
            out[key].view(-1)[0] = math.nan
            break
    return out
