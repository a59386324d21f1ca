"""Byzantine-robust aggregation: defences as ``aggregate`` plugins (docs/robustness.md).

Each defence claims every floating model key that all of a cluster's uploads carry and
sets it to ``previous + robust(updates)``, where a client's update is its upload minus
the cluster state the round started from (``server.pool[cluster]``), all those keys
flattened into one vector. Integer buffers and non-model keys keep the core default.
Being ``aggregate`` implementations, they work per cluster wherever a method keeps
several (IFCA, CP-CFL). Sample counts are ignored (every paper weighs clients alike)
except by ``rfa``, whose paper weighs by them.

* ``median``: coordinate-wise median (Yin et al., 2018); an even count takes the mean of
  the two middle values.
* ``trimmed_mean``: per coordinate, drop the ⌊β·n⌋ largest and smallest values, average
  the rest (Yin et al., 2018).
* ``krum``: Krum and Multi-Krum (Blanchard et al., 2017): score = sum of squared
  distances to the n−f−2 nearest others; the ``m`` lowest scores (ties: lower client id)
  are averaged. Needs n ≥ 2f+3.
* ``bulyan``: Bulyan (El Mhamdi et al., 2018): θ = n−2f updates chosen by Krum one at a
  time, then per coordinate the mean of the β = θ−2f values closest to their median.
  Needs n ≥ 4f+3.
* ``rfa``: geometric median by the smoothed Weiszfeld algorithm (Pillutla et al., 2022).
* ``bucketing``: bucketing (Karimireddy et al., 2022): random buckets of ``s`` updates,
  then centred clipping (Karimireddy et al., 2021) of the bucket means around the last
  round's robust update.
* ``fltrust``: FLTrust (Cao et al., 2021): the server trains on its own split; trust
  score ReLU(cos) with that update; each update rescaled to its norm.
* ``flame``: FLAME (Nguyen et al., 2022): HDBSCAN on cosine distances keeps the majority
  cluster, clipping to the median distance, Gaussian noise λ·S.

Detection as data: per round every defence logs ``defence`` (its name) and ``flagged``
(sorted ids of the clients it dropped or down-weighted, over all clusters) in the metrics
row; each defence's docstring says what it flags.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor

from fedkit import (
    PluginOptions,
    RecipeError,
    Server,
    Upload,
    derive,
    hookimpl,
    make_optimizer,
    run_loop,
    supervised_objective,
)
from fedkit_plugins._keys import option_key

# --------------------------------------------------------------------------- arithmetic
# Each function takes the updates as an n×d float64 matrix, one row per client in
# client-id order, and returns the robust update (d) and the rows it flags.


def coordinate_median(updates: Tensor) -> Tensor:
    """Coordinate-wise median; for an even count the mean of the two middle values."""
    ordered = updates.sort(dim=0).values
    n = ordered.shape[0]
    if n % 2:
        return ordered[n // 2]
    return (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def trimmed_mean(updates: Tensor, trim: int) -> Tensor:
    """Coordinate-wise mean after dropping the ``trim`` largest and ``trim`` smallest."""
    n = updates.shape[0]
    if n - 2 * trim < 1:
        raise ValueError(f"trimming {trim} from each side of {n} values leaves none")
    ordered = updates.sort(dim=0).values
    return ordered[trim : n - trim].mean(dim=0)


def krum_scores(updates: Tensor, f: int) -> Tensor:
    """Krum's score per row: the sum of squared distances to its n−f−2 nearest other rows
    (at least one while there is another row: Bulyan's last picks have fewer than
    2f+3 rows left)."""
    n = updates.shape[0]
    if n == 1:
        return torch.zeros(1, dtype=updates.dtype)
    distances = torch.cdist(updates, updates, compute_mode="donot_use_mm_for_euclid_dist").pow(2)
    neighbours = min(max(n - f - 2, 1), n - 1)
    others = distances + torch.diag(torch.full((n,), math.inf, dtype=updates.dtype))
    return others.sort(dim=1).values[:, :neighbours].sum(dim=1)


def krum_order(updates: Tensor, f: int, ids: list[int]) -> list[int]:
    """Rows from the lowest Krum score up; equal scores in client-id order."""
    scores = krum_scores(updates, f).tolist()
    return sorted(range(len(ids)), key=lambda i: (scores[i], ids[i]))


def multi_krum(updates: Tensor, f: int, m: int, ids: list[int]) -> tuple[Tensor, list[int]]:
    """The mean of the ``m`` rows with the lowest Krum scores (m = 1: Krum), and the rows
    left out."""
    order = krum_order(updates, f, ids)
    chosen = sorted(order[:m])
    return updates[chosen].mean(dim=0), sorted(order[m:])


def bulyan(updates: Tensor, f: int, ids: list[int]) -> tuple[Tensor, list[int]]:
    """Bulyan over Krum: pick θ = n−2f rows one at a time (Krum recomputed on the rows
    left each time), then per coordinate average the β = θ−2f picked values closest to
    the picked values' median (ties: the earlier pick). Returns it and the rows not
    picked."""
    n = updates.shape[0]
    theta = n - 2 * f
    left, picked = list(range(n)), []
    while len(picked) < theta:
        best = krum_order(updates[left], f, [ids[i] for i in left])[0]
        picked.append(left.pop(best))
    chosen = updates[picked]
    beta = theta - 2 * f
    median = coordinate_median(chosen)
    closest = (chosen - median).abs().sort(dim=0, stable=True).indices[:beta]
    return chosen.gather(0, closest).mean(dim=0), sorted(left)


def geometric_median(
    updates: Tensor, weights: Tensor, nu: float, iterations: int
) -> tuple[Tensor, Tensor]:
    """Smoothed Weiszfeld (RFA, Pillutla et al. 2022, algorithm 2): start at the weighted
    mean, then ``iterations`` times v ← Σ βᵢwᵢ / Σ βᵢ with βᵢ = αᵢ / max(ν, ‖v − wᵢ‖).
    Returns v and the final normalised weights βᵢ / Σ β."""
    alpha = weights / weights.sum()
    v = (alpha[:, None] * updates).sum(dim=0)
    beta = alpha
    for _ in range(iterations):
        distance = (updates - v).norm(dim=1).clamp(min=nu)
        beta = alpha / distance
        beta = beta / beta.sum()
        v = (beta[:, None] * updates).sum(dim=0)
    return v, beta


def buckets_of(n: int, size: int, generator: torch.Generator) -> list[list[int]]:
    """Rows 0..n−1 shuffled with ``generator`` and cut into buckets of ``size`` (the last
    one may be smaller)."""
    order = torch.randperm(n, generator=generator).tolist()
    return [sorted(order[i : i + size]) for i in range(0, len(order), size)]


def centred_clip(
    points: Tensor, centre: Tensor, tau: float, iterations: int
) -> tuple[Tensor, list[int]]:
    """Centred clipping (Karimireddy et al. 2021): ``iterations`` times
    v ← v + mean of (xᵢ − v)·min(1, τ/‖xᵢ − v‖). Returns v and the points clipped in the
    last iteration."""
    v, clipped = centre, []
    for _ in range(iterations):
        diff = points - v
        norm = diff.norm(dim=1)
        scale = torch.where(norm > tau, tau / norm.clamp(min=1e-300), torch.ones_like(norm))
        clipped = [i for i, s in enumerate(scale.tolist()) if s < 1]
        v = v + (scale[:, None] * diff).mean(dim=0)
    return v, clipped


def fltrust(updates: Tensor, reference: Tensor) -> tuple[Tensor, Tensor]:
    """FLTrust: TSᵢ = ReLU(cos(gᵢ, g₀)); gᵢ rescaled to ‖g₀‖; Σ TSᵢ·ĝᵢ / Σ TSᵢ (zero
    when every score is zero). Returns it and the trust scores."""
    ref_norm = reference.norm()
    norms = updates.norm(dim=1)
    cos = (updates @ reference) / (norms * ref_norm).clamp(min=1e-300)
    trust = cos.clamp(min=0)
    rescaled = updates * (ref_norm / norms.clamp(min=1e-300))[:, None]
    total = trust.sum()
    if total == 0:
        return torch.zeros_like(reference), trust
    return (trust[:, None] * rescaled).sum(dim=0) / total, trust


def matched_epochs(
    weights: list[float], epochs: int, batch_size: int, drop_last: bool, own: int
) -> int:
    """Epochs over the server's ``own`` samples that take at least as many optimiser steps
    as the median client took (``epochs`` over its ``weights`` samples): FLTrust's server
    runs the clients' number of local iterations (Cao et al., 2021), and its update's norm
    sets every client's, so a server that stepped less shrinks the whole round."""

    def steps(n: int) -> int:
        return max(1, n // batch_size if drop_last and n >= batch_size else -(-n // batch_size))

    clients = sorted(epochs * steps(int(w)) for w in weights)
    median = clients[(len(clients) - 1) // 2] if clients else epochs
    return max(1, -(-median // steps(own)))


def flame_admitted(vectors: Tensor) -> list[int]:
    """FLAME's filter: HDBSCAN (min_cluster_size ⌊n/2⌋+1, min_samples 1, one cluster
    allowed) on pairwise cosine distances; the rows of the largest cluster (all rows
    when it labels every row noise, or for fewer than 3 rows)."""
    n = vectors.shape[0]
    if n < 3:
        return list(range(n))
    from sklearn.cluster import HDBSCAN

    unit = vectors / vectors.norm(dim=1, keepdim=True).clamp(min=1e-300)
    distance = (1 - unit @ unit.T).clamp(min=0)
    distance.fill_diagonal_(0)
    labels = (
        HDBSCAN(
            min_cluster_size=n // 2 + 1,
            min_samples=1,
            metric="precomputed",
            allow_single_cluster=True,
            copy=True,
        )
        .fit(distance.numpy())
        .labels_.tolist()
    )
    clusters = [c for c in set(labels) if c >= 0]
    if not clusters:
        return list(range(n))
    largest = max(clusters, key=lambda c: (labels.count(c), -c))
    return [i for i, c in enumerate(labels) if c == largest]


def flame(
    updates: Tensor, cosine_on: Tensor, lam: float, generator: torch.Generator
) -> tuple[Tensor, list[int], float, Tensor]:
    """FLAME on updates: admitted rows (``flame_admitted`` on ``cosine_on``), each scaled
    by min(1, S/eᵢ) with S the median of every row's norm eᵢ, averaged. Returns the mean,
    the admitted rows, S, and Gaussian noise of std λ·S (one draw per coordinate) for the
    caller to add to the parameters."""
    admitted = flame_admitted(cosine_on)
    norms = updates.norm(dim=1)
    s = float(coordinate_median(norms[:, None])[0])
    chosen = updates[admitted]
    scale = (s / norms[admitted].clamp(min=1e-300)).clamp(max=1)
    mean = (scale[:, None] * chosen).mean(dim=0)
    noise = torch.randn(mean.shape, generator=generator, dtype=mean.dtype) * (lam * s)
    return mean, admitted, s, noise


# --------------------------------------------------------------------------- plugins


class Defence:
    """What every defence shares: the update matrix, the f/n bound, the detection log."""

    name: ClassVar[str]

    class Options(PluginOptions):
        """No options (a defence that has some declares its own)."""

    def __init__(self, options: PluginOptions) -> None:
        self.options = options
        self.flagged: dict[int, set[int]] = {}  # round -> client ids, over its clusters

    def bound(self) -> tuple[int, str] | None:
        """The least cohort this defence works with, and the bound in words (None: any)."""
        return None

    def check(self, server: Server, n: int, where: str) -> None:
        """Refuse a cohort of ``n`` below the bound, naming the plugin, f, n and the bound."""
        bound = self.bound()
        if bound is not None and n < bound[0]:
            f = getattr(self.options, "f", None)
            raise RecipeError(
                f"{option_key(server, self.name)}.f",
                f"{bound[1]} for {self.name} with f = {f}, but {where} has n = {n}",
                f,
                hint=" (assume fewer Byzantine clients, or sample more clients per round)",
            )

    @hookimpl
    def configure(self, server: Server) -> None:
        recipe = server.recipe
        n = min(recipe.federation.clients_per_round, recipe.data.num_clients)
        self.check(server, n, "federation.clients_per_round")

    @hookimpl
    def aggregate(
        self, server: Server, cluster: int, uploads: list[Upload]
    ) -> dict[str, Tensor] | None:
        """Claim previous + robust update for the floating model keys every upload has;
        clients without training data (weight 0) sent their received state and count as
        no one (the core's weighted mean ignores them too)."""
        previous = server.pool[cluster]
        uploads = [u for u in uploads if u.weight > 0]
        shared = set.intersection(*(set(u.tensors) for u in uploads))
        keys = sorted(
            k for k in shared & set(previous) & server.model_keys if previous[k].is_floating_point()
        )
        if not keys:
            return None
        self.check(server, len(uploads), f"round {server.round}'s cluster {cluster}")
        base = torch.cat([previous[k].double().flatten() for k in keys])
        updates = torch.stack(
            [torch.cat([u.tensors[k].double().flatten() for k in keys]) - base for u in uploads]
        )
        ids = [u.client for u in uploads]
        update, flagged = self.robust(server, cluster, updates, uploads, keys)
        out, start = {}, 0
        for k in keys:
            size = previous[k].numel()
            piece = update[start : start + size].view(previous[k].shape)
            out[k] = (previous[k].double() + piece).to(previous[k].dtype)
            start += size
        self.flagged = {server.round: self.flagged.get(server.round, set())}
        self.flagged[server.round].update(ids[i] for i in flagged)
        server.log(flagged=sorted(self.flagged[server.round]), defence=self.name)
        return out

    def robust(
        self, server: Server, cluster: int, updates: Tensor, uploads: list[Upload], keys: list[str]
    ) -> tuple[Tensor, list[int]]:
        """The robust update of one cluster and the rows it flags."""
        raise NotImplementedError


class Median(Defence):
    """Coordinate-wise median of the updates (Yin et al., 2018).

    Flags nobody: no client is dropped as a whole."""

    name = "median"

    def robust(
        self, server: Server, cluster: int, updates: Tensor, uploads: list[Upload], keys: list[str]
    ) -> tuple[Tensor, list[int]]:
        return coordinate_median(updates), []


class TrimmedMean(Defence):
    """Coordinate-wise trimmed mean of the updates (Yin et al., 2018).

    Drops the ⌊β·n⌋ largest and smallest values of each coordinate. Flags nobody: clients
    are trimmed per coordinate, not as a whole."""

    name = "trimmed_mean"

    class Options(PluginOptions):
        beta: float = Field(0.1, ge=0, lt=0.5)

    def robust(
        self, server: Server, cluster: int, updates: Tensor, uploads: list[Upload], keys: list[str]
    ) -> tuple[Tensor, list[int]]:
        trim = math.floor(self.options.beta * updates.shape[0])
        return trimmed_mean(updates, trim), []


class Krum(Defence):
    """Krum (m = 1) and Multi-Krum (m > 1) of Blanchard et al., 2017.

    Needs n ≥ 2f+3 and m ≤ n; flags the clients not among the m chosen."""

    name = "krum"

    class Options(PluginOptions):
        f: int = Field(1, ge=0)
        m: int = Field(1, ge=1)

    def bound(self) -> tuple[int, str]:
        o = self.options
        least = max(2 * o.f + 3, o.m)
        return least, f"n > 2f+2 = {2 * o.f + 2} and n ≥ m = {o.m}"

    def robust(
        self, server: Server, cluster: int, updates: Tensor, uploads: list[Upload], keys: list[str]
    ) -> tuple[Tensor, list[int]]:
        ids = [u.client for u in uploads]
        return multi_krum(updates, self.options.f, self.options.m, ids)


class Bulyan(Defence):
    """Bulyan over Krum (El Mhamdi et al., 2018).

    Needs n ≥ 4f+3; flags the clients not among the θ = n−2f that Krum picked."""

    name = "bulyan"

    class Options(PluginOptions):
        f: int = Field(1, ge=0)

    def bound(self) -> tuple[int, str]:
        return 4 * self.options.f + 3, f"n ≥ 4f+3 = {4 * self.options.f + 3}"

    def robust(
        self, server: Server, cluster: int, updates: Tensor, uploads: list[Upload], keys: list[str]
    ) -> tuple[Tensor, list[int]]:
        return bulyan(updates, self.options.f, [u.client for u in uploads])


class RFA(Defence):
    """Geometric median by smoothed Weiszfeld (RFA, Pillutla et al., 2022).

    Clients are weighed by sample count. Flags the clients whose final Weiszfeld weight
    is below ``flag_below`` times their sample share."""

    name = "rfa"

    class Options(PluginOptions):
        nu: float = Field(1e-6, gt=0)
        iterations: int = Field(3, ge=1)
        flag_below: float = Field(0.5, ge=0, le=1)

    def robust(
        self, server: Server, cluster: int, updates: Tensor, uploads: list[Upload], keys: list[str]
    ) -> tuple[Tensor, list[int]]:
        o = self.options
        weights = torch.tensor([float(u.weight) for u in uploads], dtype=torch.float64)
        v, beta = geometric_median(updates, weights, o.nu, o.iterations)
        share = weights / weights.sum()
        return v, [i for i in range(len(uploads)) if beta[i] < o.flag_below * share[i]]


class Bucketing(Defence):
    """Bucketing with centred clipping of the bucket means (Karimireddy et al., 2022).

    Centred clipping (CClip, Karimireddy et al., 2021) is the paper's main pairing; it is
    centred on the cluster's last robust update (kept in ``server.tensors``; zero at
    first). Flags the clients whose bucket was clipped."""

    name = "bucketing"

    class Options(PluginOptions):
        s: int = Field(2, ge=1)
        tau: float = Field(1.0, gt=0)
        iterations: int = Field(1, ge=1)

    def robust(
        self, server: Server, cluster: int, updates: Tensor, uploads: list[Upload], keys: list[str]
    ) -> tuple[Tensor, list[int]]:
        o = self.options
        generator = torch.Generator().manual_seed(
            derive(server.recipe.seed, self.name, server.round, cluster)
        )
        buckets = buckets_of(updates.shape[0], o.s, generator)
        means = torch.stack([updates[b].mean(dim=0) for b in buckets])
        name = f"{self.name}/{cluster}/centre"
        centre = server.tensors.get(name)
        if centre is None or centre.shape != means.shape[1:]:
            centre = torch.zeros(means.shape[1], dtype=torch.float64)
        v, clipped = centred_clip(means, centre, o.tau, o.iterations)
        server.tensors[name] = v
        return v, sorted(i for b in clipped for i in buckets[b])


class FLTrust(Defence):
    """FLTrust: trust scores against the server's own update (Cao et al., 2021).

    The server's update g₀ is the recipe's supervised training on its own split
    (``data.server_fraction``) from the cluster's state, at ``federation.optimizer.lr``,
    for as many steps as the round's median client took (``matched_epochs``: the paper's
    equal local iterations; the row logs ``fltrust_epochs``). Flags clients whose trust
    score is zero (their update points away from g₀)."""

    name = "fltrust"

    @hookimpl
    def configure(self, server: Server) -> None:
        if len(server.own_data) == 0:
            raise RecipeError(
                "data.server_fraction",
                "> 0: fltrust trains the server's reference update on the server's own split",
                server.recipe.data.server_fraction,
            )
        if bool((server.own_data.labels < 0).any()):
            raise RecipeError(
                "data.server_fraction",
                "a labelled server split: fltrust's reference update is supervised",
                server.recipe.data.server_fraction,
            )

    def reference(
        self, server: Server, cluster: int, keys: list[str], weights: list[float]
    ) -> Tensor:
        """g₀: the server's own update from the cluster state, flattened over ``keys``,
        trained for the steps the clients of ``weights`` (sample counts) took."""
        recipe = server.recipe
        model = server.model(cluster)
        before = {k: v.detach().double().cpu().clone() for k, v in model.state_dict().items()}
        generator = torch.Generator().manual_seed(
            derive(recipe.seed, self.name, server.round, cluster)
        )
        trainer = SimpleNamespace(
            recipe=recipe, train=server.own_data, rng=generator, device=server.device
        )
        objective = supervised_objective(trainer, model)
        opt = recipe.federation.optimizer
        optimizer = make_optimizer(objective.trained_params(model), opt, opt.lr)
        fed = recipe.federation
        epochs = matched_epochs(
            weights, objective.epochs or fed.local_epochs, fed.batch_size, fed.drop_last,
            len(server.own_data),
        )  # fmt: skip
        server.log(fltrust_epochs=epochs)
        run_loop(model, objective, optimizer, epochs)
        after = model.state_dict()
        return torch.cat([(after[k].detach().double().cpu() - before[k]).flatten() for k in keys])

    def robust(
        self, server: Server, cluster: int, updates: Tensor, uploads: list[Upload], keys: list[str]
    ) -> tuple[Tensor, list[int]]:
        reference = self.reference(server, cluster, keys, [u.weight for u in uploads])
        update, trust = fltrust(updates, reference)
        server.log(fltrust_reference_norm=float(reference.norm()))
        return update, [i for i, t in enumerate(trust.tolist()) if t == 0]


class FLAME(Defence):
    """FLAME: HDBSCAN filter, median-norm clipping, noise (Nguyen et al., 2022).

    HDBSCAN runs on cosine distances between the local models (``cosine_on: models``, the
    paper's) or their updates; noise λ·S goes on the trainable parameters. Flags the
    clients outside the majority cluster."""

    name = "flame"

    class Options(PluginOptions):
        lam: float = Field(0.001, ge=0)
        """λ: the noise level relative to the clipping bound (the paper's 0.001 for images)."""
        cosine_on: Literal["models", "updates"] = "models"

    def robust(
        self, server: Server, cluster: int, updates: Tensor, uploads: list[Upload], keys: list[str]
    ) -> tuple[Tensor, list[int]]:
        previous = server.pool[cluster]
        base = torch.cat([previous[k].double().flatten() for k in keys])
        compared = updates + base if self.options.cosine_on == "models" else updates
        generator = torch.Generator().manual_seed(
            derive(server.recipe.seed, self.name, server.round, cluster)
        )
        mean, admitted, s, noise = flame(updates, compared, self.options.lam, generator)
        trained = torch.cat(
            [torch.full((previous[k].numel(),), float(k in server.parameter_keys)) for k in keys]
        ).double()
        server.log(flame_clip_bound=s)
        rejected = sorted(set(range(len(uploads))) - set(admitted))
        return mean + noise * trained, rejected
