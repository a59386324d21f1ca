"""Attacks by malicious clients, for measuring defences in simulation.

Each attack is a plugin with the options ``fraction`` (of all clients, rounded down) and
``seed``: the malicious clients are ``fraction · num_clients`` drawn without replacement
from a generator seeded by ``derive(seed, "malicious")``, the same set on every side, in
every run with that recipe (``malicious_set``). Which they are is simulation truth: the
engine keeps the plugin's answer to ``malicious_clients`` with the evaluator and shows it
only to simulation hooks; no server-side hook sees it (docs/robustness.md, decision 0025).

What one client does alone runs on that client:

* ``label_flip``: it trains on labels ``y → C − 1 − y`` (``training_data``).
* ``sign_flip``: it sends ``G − s·Δ`` for its honest update ``Δ = L − G`` (``process_upload``).
* ``gaussian_noise``: it sends ``G + ε``, ``ε ~ N(0, σ²)`` per coordinate, in place of its
  update (the "Gaussian attack" of Fang et al. 2020 and FLTrust).
* ``backdoor`` (Bagdasaryan et al., AISTATS 2020, model replacement): it trains on its data
  with a share of the images stamped with a pixel pattern (a white ``size × size`` square
  in the bottom-right corner) and relabelled to ``target``, then sends
  ``G + γ·(L − G)`` with ``γ = n/η`` (``n``: ``clients_per_round``, ``η``: the server's
  learning rate, 1 for FedAvg). Its success rate, on the global test set's images whose
  true label is not ``target``, stamped, classified as ``target``, is ``backdoor_success``.

What needs other clients' updates runs on the simulation side, between the replies and
aggregation (``attack_uploads``), with what the paper's threat model lets the attacker see;
every malicious client of the cluster then sends the same crafted update, added to the
cluster's state:

* ``alie`` (Baruch et al., NeurIPS 2019, "A little is enough"): ``μ − z_max·σ`` per
  coordinate, ``μ`` and ``σ`` (population) over the malicious clients' own honest updates;
  ``z_max = Φ⁻¹((n − s)/n)``, ``s = ⌊n/2 + 1⌋ − f`` for the round's ``n`` clients of the
  cluster and ``f`` malicious among them (``s`` kept within ``1..n−1``).
* ``ipm`` (Xie et al., UAI 2020, inner-product manipulation): ``−ε·mean(benign updates)``.
* ``min_max``, ``min_sum`` (Shejwalkar and Houmansadr, NDSS 2021, AGR-agnostic, with the
  benign updates): ``∇b + γ·∇p``, ``∇b`` the benign mean, ``∇p`` the perturbation
  (``unit_vec``: ``−∇b/‖∇b‖``, ``std``: ``−std(benign)``, ``sign``: ``−sign(∇b)``), ``γ`` the
  largest found by the paper's halving search (from ``gamma_init``, to ``tau``) such that
  the largest distance to a benign update stays within the largest distance between two
  (min-max), or the sum of squared distances within the largest such sum of a benign
  update (min-sum).

Updates are taken over the floating-point keys the upload shares with the cluster's
state; other keys are sent as the client computed them.
"""

from __future__ import annotations

import dataclasses
import math
from statistics import NormalDist
from typing import Any, Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from fedkit import (
    ClientContext,
    ImageSet,
    PluginOptions,
    Recipe,
    Upload,
    derive,
    hookimpl,
    normalize,
)


def malicious_set(num_clients: int, fraction: float, seed: int) -> list[int]:
    """The malicious clients: ``⌊fraction·num_clients⌋`` of them, drawn from ``seed``."""
    count = int(math.floor(fraction * num_clients + 1e-9))
    rng = np.random.default_rng(derive(seed, "malicious"))
    return sorted(int(c) for c in rng.choice(num_clients, size=count, replace=False))


def attacked_keys(upload: dict[str, Tensor], state: dict[str, Tensor]) -> list[str]:
    """The keys an attack changes: floating-point keys the upload shares with the state."""
    return sorted(k for k, v in upload.items() if v.is_floating_point() and k in state)


def flat_update(upload: dict[str, Tensor], state: dict[str, Tensor], keys: list[str]) -> Tensor:
    """``upload − state`` over ``keys``, one float64 vector."""
    return torch.cat([(upload[k].double() - state[k].double()).reshape(-1) for k in keys])


def with_update(
    upload: dict[str, Tensor], state: dict[str, Tensor], keys: list[str], update: Tensor
) -> dict[str, Tensor]:
    """``upload`` with ``state + update`` in place of each of ``keys`` (dtypes kept)."""
    out, at = dict(upload), 0
    for k in keys:
        n = state[k].numel()
        piece = update[at : at + n].reshape(state[k].shape)
        out[k] = (state[k].double() + piece).to(upload[k].dtype)
        at += n
    return out


def z_max(n: int, f: int) -> float:
    """ALIE's ``z_max = Φ⁻¹((n − s)/n)``, ``s = ⌊n/2 + 1⌋ − f`` kept within ``1..n−1``."""
    if n < 2:
        return 0.0
    s = min(max(math.floor(n / 2 + 1) - f, 1), n - 1)
    return NormalDist().inv_cdf((n - s) / n)


def alie(own: Tensor, z: float) -> Tensor:
    """``μ − z·σ`` per coordinate over the rows of ``own`` (population standard deviation)."""
    return own.mean(0) - z * own.std(0, correction=0)


def ipm(benign: Tensor, epsilon: float) -> Tensor:
    """``−ε`` times the mean of the benign updates (rows)."""
    return -epsilon * benign.mean(0)


def perturbation(benign: Tensor, kind: str) -> Tensor:
    """Shejwalkar and Houmansadr's ``∇p``: the inverse unit vector, std or sign."""
    mean = benign.mean(0)
    if kind == "unit_vec":
        return -mean / mean.norm().clamp_min(1e-12)
    if kind == "sign":
        return -torch.sign(mean)
    return -benign.std(0, correction=1 if len(benign) > 1 else 0)


def min_max_or_sum(
    benign: Tensor, kind: str, rule: str, gamma_init: float = 10.0, tau: float = 1e-5
) -> Tensor:
    """The crafted update ``∇b + γ·∇p`` of min-max (``rule="max"``) or min-sum (``"sum"``),
    ``γ`` from the paper's search: step up by half the last step while the condition holds,
    down otherwise, halving the step, until the last success is within ``tau``."""
    mean, push = benign.mean(0), perturbation(benign, kind)
    pairwise = torch.cdist(benign, benign).pow(2)
    bound = pairwise.max() if rule == "max" else pairwise.sum(1).max()

    def holds(gamma: float) -> bool:
        distances = (benign - (mean + gamma * push)).pow(2).sum(1)
        return bool((distances.max() if rule == "max" else distances.sum()) <= bound)

    gamma, step, good = gamma_init, gamma_init / 2, 0.0
    while abs(good - gamma) > tau:
        if holds(gamma):
            good, gamma = gamma, gamma + step
        else:
            gamma = gamma - step
        step /= 2
    return mean + good * push


def stamp(images: Tensor, size: int) -> Tensor:
    """Images (uint8, N×C×H×W) with the trigger: a white ``size × size`` bottom-right square."""
    out = images.clone()
    out[..., -size:, -size:] = 255
    return out


class Attack:
    """What every attack shares: its options and its malicious clients."""

    class Options(PluginOptions):
        fraction: float = Field(0.2, ge=0.0, le=1.0)
        seed: int = 0

    def __init__(self, options: Any) -> None:
        self.options = options
        self._chosen: dict[int, frozenset[int]] = {}

    def chosen(self, num_clients: int) -> frozenset[int]:
        if num_clients not in self._chosen:
            found = malicious_set(num_clients, self.options.fraction, self.options.seed)
            self._chosen[num_clients] = frozenset(found)
        return self._chosen[num_clients]

    def malicious(self, ctx: ClientContext) -> bool:
        """Whether this client is one of the attack's (the attacker knows its own)."""
        return ctx.id in self.chosen(ctx.recipe.data.num_clients)

    @hookimpl
    def malicious_clients(self, recipe: Recipe) -> list[int]:
        return sorted(self.chosen(recipe.data.num_clients))


class LabelFlip(Attack):
    """Label flipping: malicious clients train on labels ``y → C − 1 − y``."""

    @hookimpl
    def training_data(self, ctx: ClientContext, data: ImageSet) -> ImageSet | None:
        if not self.malicious(ctx):
            return None
        labels = data.labels.clone()
        known = labels >= 0
        labels[known] = data.num_classes - 1 - labels[known]
        return dataclasses.replace(data, labels=labels)


class SignFlip(Attack):
    """Sign flipping: malicious clients send ``G − s·Δ`` for their update ``Δ``."""

    class Options(Attack.Options):
        scale: float = Field(1.0, gt=0.0)

    @hookimpl
    def process_upload(self, ctx: ClientContext, upload: dict[str, Tensor]) -> dict | None:
        if not self.malicious(ctx):
            return None
        keys = attacked_keys(upload, ctx.received)
        own = flat_update(upload, ctx.received, keys)
        return with_update(upload, ctx.received, keys, -self.options.scale * own)


class GaussianNoise(Attack):
    """Gaussian noise: malicious clients send ``G + ε``, ``ε ~ N(0, σ²)``, for an update."""

    class Options(Attack.Options):
        std: float = Field(1.0, gt=0.0)

    @hookimpl
    def process_upload(self, ctx: ClientContext, upload: dict[str, Tensor]) -> dict | None:
        if not self.malicious(ctx):
            return None
        keys = attacked_keys(upload, ctx.received)
        size = sum(ctx.received[k].numel() for k in keys)
        rng = torch.Generator().manual_seed(derive(self.options.seed, "noise", ctx.round, ctx.id))
        noise = torch.randn(size, generator=rng, dtype=torch.float64) * self.options.std
        return with_update(upload, ctx.received, keys, noise)


class Backdoor(Attack):
    """Model-replacement backdoor (Bagdasaryan et al. 2020): a pixel-pattern trigger
    relabelled to ``target``, the update scaled by ``n/η``; ``backdoor_success`` per
    evaluation round."""

    class Options(Attack.Options):
        target: int = Field(0, ge=0)
        poison_fraction: float = Field(0.5, gt=0.0, le=1.0)
        size: int = Field(3, ge=1)
        eta: float = Field(1.0, gt=0.0)
        scale: float | None = Field(None, gt=0.0)

    @hookimpl
    def training_data(self, ctx: ClientContext, data: ImageSet) -> ImageSet | None:
        if not self.malicious(ctx) or len(data) == 0:
            return None
        rng = np.random.default_rng(derive(self.options.seed, "backdoor", ctx.round, ctx.id))
        count = max(1, round(self.options.poison_fraction * len(data)))
        chosen = torch.from_numpy(np.sort(rng.choice(len(data), size=count, replace=False)))
        images, labels = data.images.clone(), data.labels.clone()
        images[chosen] = stamp(images[chosen], self.options.size)
        labels[chosen] = self.options.target
        return dataclasses.replace(data, images=images, labels=labels)

    @hookimpl
    def process_upload(self, ctx: ClientContext, upload: dict[str, Tensor]) -> dict | None:
        if not self.malicious(ctx):
            return None
        opts = self.options
        n = ctx.recipe.federation.clients_per_round
        gamma = opts.scale if opts.scale is not None else n / opts.eta
        keys = attacked_keys(upload, ctx.received)
        own = flat_update(upload, ctx.received, keys)
        return with_update(upload, ctx.received, keys, gamma * own)

    @hookimpl
    def attack_evaluate(self, adversary: Any) -> None:
        test = adversary.test
        victims = test.labels != self.options.target
        if not bool(victims.any()):
            return
        model = adversary.model(0)
        images = stamp(test.images[victims], self.options.size)
        hits = 0
        for start in range(0, len(images), 512):
            x = normalize(images[start : start + 512].to(adversary.device), test)
            logits = model["classifier"](model["encoder"](x))
            hits += int((logits.argmax(1) == self.options.target).sum())
        adversary.log(backdoor_success=hits / len(images))


class Crafted(Attack):
    """An attack that replaces its clients' uploads on the simulation side (a base: a
    subclass's ``craft(own, benign, n, f)`` makes the update from the malicious clients'
    own honest updates, the benign ones, the cluster's clients and malicious ones)."""

    @hookimpl
    def attack_uploads(self, adversary: Any, cluster: int, uploads: list[Upload]) -> list | None:
        state = adversary.pool[cluster]
        bad = [u for u in uploads if u.client in adversary.malicious]
        if not bad:
            return None
        keys = attacked_keys(bad[0].tensors, state)
        rows = {u.client: flat_update(u.tensors, state, keys) for u in uploads}
        own = torch.stack([rows[u.client] for u in bad])
        good = [rows[u.client] for u in uploads if u.client not in adversary.malicious]
        benign = torch.stack(good) if good else own[:0]
        update = self.craft(own, benign, len(uploads), len(bad))
        if update is None:
            return None
        return [
            crafted(u, with_update(u.tensors, state, keys, update))
            if u.client in adversary.malicious
            else u
            for u in uploads
        ]


def crafted(upload: Upload, tensors: dict[str, Tensor]) -> Upload:
    """``upload`` carrying ``tensors`` instead; an asynchronous upload's ``delta`` moves
    with them (the same change from the version the client started from)."""
    delta = upload.delta
    if delta is not None:
        delta = {k: tensors[k] - (upload.tensors[k] - d) for k, d in delta.items()}
    return dataclasses.replace(upload, tensors=tensors, delta=delta)


class ALIE(Crafted):
    """A little is enough (Baruch et al. 2019): ``μ − z_max·σ`` of the malicious clients'
    own honest updates."""

    class Options(Attack.Options):
        z: float | None = None

    def craft(self, own: Tensor, benign: Tensor, n: int, f: int) -> Tensor | None:
        z = self.options.z if self.options.z is not None else z_max(n, f)
        return alie(own, z)


class IPM(Crafted):
    """Inner-product manipulation (Xie et al. 2020): ``−ε·mean(benign updates)``."""

    class Options(Attack.Options):
        epsilon: float = Field(0.1, gt=0.0)

    def craft(self, own: Tensor, benign: Tensor, n: int, f: int) -> Tensor | None:
        return ipm(benign, self.options.epsilon) if len(benign) else None


class _MinCrafted(Crafted):
    rule = "max"

    class Options(Attack.Options):
        perturbation: Literal["unit_vec", "std", "sign"] = "unit_vec"
        gamma_init: float = Field(10.0, gt=0.0)
        tau: float = Field(1e-5, gt=0.0)

    def craft(self, own: Tensor, benign: Tensor, n: int, f: int) -> Tensor | None:
        if not len(benign):
            return None
        opts = self.options
        return min_max_or_sum(benign, opts.perturbation, self.rule, opts.gamma_init, opts.tau)


class MinMax(_MinCrafted):
    """Min-max (Shejwalkar and Houmansadr 2021): the farthest crafted update whose largest
    distance to a benign update stays within the benign updates' largest distance."""

    rule = "max"


class MinSum(_MinCrafted):
    """Min-sum (Shejwalkar and Houmansadr 2021): the farthest crafted update whose summed
    squared distances to the benign updates stay within the largest such benign sum."""

    rule = "sum"
