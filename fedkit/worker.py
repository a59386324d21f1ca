"""The client side of a run: what happens to one sampled client in one round.

A ``Worker`` is built from a ``ClientSetup`` wherever clients run (in the server's
process for the sequential executor, in a worker process or on a device elsewhere). It
holds the client-side plugin instances and one working model, and turns a
``ClientJob`` plus the client's data and memory into a ``ClientResult``:

select_cluster → update_client → local_train | local_objective + fit →
after_local_train → upload_selection → process_upload.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor

from fedkit.client import ClientContext, ClientData, ClientMemory, ModelKeys
from fedkit.errors import RecipeError
from fedkit.hookspecs import CLIENT
from fedkit.keys import parameter_keys
from fedkit.messages import ClientJob, ClientResult, ClientSetup
from fedkit.plugins import Plugins
from fedkit.seeding import seed_everything


def _detached(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in state.items()}


class Worker:
    """Runs client jobs with client-side plugins built from the recipe."""

    def __init__(self, setup: ClientSetup) -> None:
        self.setup = setup
        self.plugins = Plugins(setup.recipe, setup.available, side=CLIENT)
        self.device = torch.device(setup.device)
        self.template_state = {
            k: v.detach().clone() for k, v in setup.template.state_dict().items()
        }
        self.model = copy.deepcopy(setup.template).to(self.device)
        self.keys = ModelKeys(
            frozenset(self.template_state),
            frozenset(parameter_keys(setup.template)),
            frozenset(setup.private),
        )
        self._measures = bool(self.plugins.implementers("after_local_train"))

    def context(self, job: ClientJob, data: ClientData, memory: ClientMemory) -> ClientContext:
        """The client context of a job (seeds the global RNGs for the client's round)."""
        return ClientContext(
            data,
            memory,
            recipe=self.setup.recipe,
            round=job.round,
            device=self.device,
            rng=seed_everything(job.seed),
            keys=self.keys,
            offers=job.offers,
            received=job.extra,
            plugins=self.plugins,
        )

    def run(
        self, job: ClientJob, data: ClientData, memory: ClientMemory | None
    ) -> tuple[ClientResult, ClientMemory]:
        """One client's round; returns its result and its memory for the next round."""
        memory = memory if memory is not None else ClientMemory()
        ctx = self.context(job, data, memory)
        plugins, model = self.plugins, self.model
        cluster = plugins.call("select_cluster", ctx=ctx, model=model)
        ctx.cluster = 0 if cluster is None else int(cluster)
        ctx.received.update(ctx.fetch(ctx.cluster))
        local = memory.model if memory.model is not None else self.template_state
        claimed = plugins.claims("update_client", ctx=ctx, received=ctx.received, local=local)
        merged = {**local, **ctx.received, **claimed}
        model.load_state_dict({k: merged[k] for k in local})
        before = _detached(model.state_dict()) if self._measures else {}
        stats = self.train(ctx)
        for extra in plugins.call("after_local_train", ctx=ctx, model=model, before=before):
            stats.update(extra or {})
        after = _detached(model.state_dict())
        chosen = plugins.claims("upload_selection", ctx=ctx, local=after, model=model)
        upload = {k: v for k, v in after.items() if k not in self.keys.private}
        upload.update(chosen)
        upload = {k: v.detach().cpu() for k, v in upload.items() if v is not None}
        upload = plugins.chain("process_upload", "upload", ctx=ctx, upload=upload)
        memory.model = {k: v.cpu() for k, v in after.items()}
        memory.participations += 1
        memory.cluster = ctx.cluster
        metrics: dict[str, Any] = {**ctx.logged, **stats}
        result = ClientResult(
            data.id, ctx.cluster, float(len(data.train)), upload, ctx.fetched, metrics
        )
        return result, memory

    def train(self, ctx: ClientContext) -> dict[str, Any]:
        """The plugin's own loop (``local_train``), else the core fit loop on its objective."""
        stats = self.plugins.call("local_train", ctx=ctx, model=self.model)
        if stats is None:
            objective = self.plugins.call("local_objective", ctx=ctx, model=self.model)
            if objective is None:
                raise RecipeError(
                    "plugins",
                    "a plugin that trains clients (implements local_objective or local_train)",
                    self.plugins.names,
                )
            stats = ctx.fit(self.model, objective)
        return dict(stats)
