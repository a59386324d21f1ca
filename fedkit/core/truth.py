"""What an attack knows, and what it lets a simulation measure: the engine's use of the
simulation hooks.

A recipe may name an attack plugin; the plugin says which clients it controls
(``malicious_clients``), once per run. That set is simulation truth: the engine keeps it
on its ``Run`` beside the evaluator and hands it only to simulation hooks, through an
``Adversary`` view, never to the ``Server``. Each round the attack may replace its
clients' uploads after the replies were checked and before any server-side hook sees them
(``attack_uploads``); a defence's ``flagged`` clients are scored against the truth
(``detection_precision``, ``detection_recall``); on evaluation rounds the attack measures
its success on the global test set (``attack_evaluate``). Nothing here names an attack.
"""

from __future__ import annotations

from typing import Any

import torch

from fedkit.config.schema import Recipe
from fedkit.data.datasets import ImageSet
from fedkit.errors import FedkitError, PluginError, RecipeError
from fedkit.plugin import hookspecs
from fedkit.plugin.adversary import Adversary
from fedkit.plugin.entrypoints import discover
from fedkit.plugin.manager import Plugins
from fedkit.plugin.registry import hook_side, implemented_hooks, loaded_plugins
from fedkit.plugin.server import ServerRecord, Upload


def malicious(plugins: Plugins, record: ServerRecord) -> frozenset[int] | None:
    """The clients the run's attack controls (``None`` without an attack), checked:
    known client ids."""
    answer = plugins.call("malicious_clients", recipe=record.recipe)
    if answer is None:
        return None
    ids = frozenset(int(c) for c in answer)
    n = len(record.roster)
    if any(not 0 <= c < n for c in ids):
        raise RecipeError(
            "plugins", f"malicious_clients to answer client ids in 0..{n - 1}", sorted(ids)
        )
    return ids


def refuse_deployed(recipe: Recipe) -> None:
    """Refuse, in one line, a recipe naming a plugin with simulation hooks (an attack) in
    a real deployment, where no party knows which clients are malicious."""
    named = {spec.name for spec in recipe.plugins}
    loaded = loaded_plugins({k: v for k, v in discover().items() if k in named})
    for name in sorted(loaded):
        hooks = [h for h in implemented_hooks(loaded[name]) if hook_side(h) == hookspecs.SIMULATION]
        if hooks:
            raise FedkitError(
                f"plugin {name!r} simulates an attack ({', '.join(hooks)}): a Flower deployment "
                "has no simulation truth; run it with a simulating executor (sequential, "
                "isolated, ray, or flower's simulation)"
            )


def view(
    truth: frozenset[int], record: ServerRecord, test: ImageSet, row: dict[str, Any]
) -> Adversary:
    """The adversary view of this moment of the run: the round, its clients, the pool as
    it is now (a copy of the list: later updates of a cluster do not show), the truth."""
    return Adversary(
        record.recipe, truth, test, record.device, record.template,
        record.round, list(record.sampled), list(record.pool), row,
    )  # fmt: skip


def attacked(
    plugins: Plugins, adversary: Adversary, cluster: int, uploads: list[Upload]
) -> list[Upload]:
    """The cluster's uploads after the attack replaced its clients' ones; a crafted upload
    must come from a malicious client and keep its upload's keys, shapes and dtypes."""
    crafted = plugins.chain(
        "attack_uploads", "uploads", adversary=adversary, cluster=cluster, uploads=uploads
    )
    if crafted is uploads:
        return uploads
    honest = {u.client: u for u in uploads}
    for upload in crafted:
        before = honest.get(upload.client)
        if before is None or upload.weight != before.weight:
            problem = f"client {upload.client}'s upload is not one of cluster {cluster}'s"
        elif upload is before:
            continue
        elif upload.client not in adversary.malicious:
            problem = f"changed the upload of client {upload.client}, which is not malicious"
        elif upload.tensors.keys() != before.tensors.keys() or any(
            v.shape != before.tensors[k].shape or v.dtype != before.tensors[k].dtype
            for k, v in upload.tensors.items()
        ):
            problem = f"client {upload.client}'s crafted upload changed keys, shapes or dtypes"
        else:
            continue
        names = ", ".join(plugins.implementers("attack_uploads"))
        raise PluginError(names, "attack_uploads", ValueError(problem))
    if sorted(u.client for u in crafted) != sorted(honest):
        names = ", ".join(plugins.implementers("attack_uploads"))
        raise PluginError(names, "attack_uploads", ValueError("dropped or repeated a client"))
    return sorted(crafted, key=lambda u: u.client)


def detection(flagged: Any, truth: frozenset[int], answered: list[int]) -> dict[str, float]:
    """A defence's ``flagged`` clients scored against the round's malicious clients whose
    upload was aggregated: ``detection_precision`` (the flagged that are malicious; absent
    when nothing was flagged) and ``detection_recall`` (the malicious that were flagged;
    absent when none of them took part)."""
    if flagged is None:
        return {}
    chosen = {int(c) for c in flagged}
    attackers = truth & set(answered)
    caught = len(chosen & attackers)
    out = {}
    if chosen:
        out["detection_precision"] = caught / len(chosen)
    if attackers:
        out["detection_recall"] = caught / len(attackers)
    return out


def measured(plugins: Plugins, adversary: Adversary) -> None:
    """The attack's own scores of this evaluation round (``attack_evaluate``), into the
    adversary's row, with the gradients off as for the evaluator's scores."""
    with torch.no_grad():
        plugins.call("attack_evaluate", adversary=adversary, round=adversary.round)
