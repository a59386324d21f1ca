"""Client-level differential privacy: DP-FedAvg (McMahan et al., ICLR 2018).

On the client, the whole update Δ_k = upload − received (every floating model key it
sends, BatchNorm statistics included) is clipped to L2 norm ``clip`` C:
Δ̃_k = Δ_k · min(1, C/‖Δ_k‖) (``process_upload``, after every other plugin chose what
to send). On the server, each cluster becomes x + (1/K)·Σ_k Δ̃_k + N(0, (σ·C/K)²·I) over
its K uploads, unweighted so that one client moves the mean by at most C/K
(``aggregate``; the noise generator is seeded per round and cluster, so runs resume
exactly). Integer buffers keep the core default.

The privacy spent is accounted with opacus's ``accountant`` (``rdp``, or ``prv``;
through ``_privacy``, which ``dpsgd`` shares) for ``rounds`` steps of the subsampled
Gaussian mechanism with sampling rate q = clients_per_round / num_clients and noise
multiplier σ. ε at round r is a function of
(σ, q, r, δ) alone, so a resumed run continues the same accounting. Each round, ε (at
``delta``) goes to the metrics row (``dp_epsilon``) and to the ledger's ``privacy``
entry (level ``client``). With ``target_epsilon`` and no ``noise_multiplier``, σ is
calibrated by opacus's ``get_noise_multiplier`` so that ε after ``federation.rounds``
stays within the target (kept in the server state: a resumed run keeps its σ); with
both, a run whose ε would exceed the target is refused before round 1, naming the first
round over it. The accountant assumes Poisson sampling; fedkit samples a fixed number of
clients per round, the usual approximation (decision 0021). Uploads of non-model keys
(features, control variates) are refused: DP bounds model updates only. Needs the
``dp`` extra (``pip install fedkit-fl[dp]``).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field, ValidationInfo, field_validator
from torch import Tensor

from fedkit import ClientContext, PluginOptions, RecipeError, Server, Upload, derive, hookimpl
from fedkit_plugins._keys import option_key
from fedkit_plugins._privacy import RDP_ORDERS, epsilon
from fedkit_plugins._privacy import calibrated_noise as shared_calibration

DEFAULT_NOISE = 1.0
"""σ when neither ``noise_multiplier`` nor ``target_epsilon`` is given."""
CALIBRATION_TOLERANCE = 1e-3
"""Calibration stops once ε is within this fraction of the target (below it, never above)."""


def accountant_epsilon(
    noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "rdp"
) -> float:
    """ε after ``steps`` rounds of the subsampled Gaussian mechanism, from opacus's
    ``accountant`` (``rdp`` or ``prv``, at ``RDP_ORDERS``); 0 before any round, ∞ without
    noise."""
    history = [(noise_multiplier, sample_rate, steps)]
    return epsilon(history, delta, accountant=accountant, orders=RDP_ORDERS)


def calibrated_noise(
    target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "rdp"
) -> float:
    """The σ with which ``steps`` rounds spend at most ``target_epsilon``: opacus's own
    calibration (a bisection on its accountant), to ``CALIBRATION_TOLERANCE``."""
    return shared_calibration(
        target_epsilon,
        delta,
        sample_rate,
        steps,
        accountant=accountant,
        orders=RDP_ORDERS,
        tolerance=CALIBRATION_TOLERANCE * target_epsilon,
    )


def first_round_over(
    target_epsilon: float,
    noise_multiplier: float,
    sample_rate: float,
    rounds: int,
    delta: float,
    accountant: str = "rdp",
) -> int | None:
    """The first round after which ε exceeds ``target_epsilon`` (ε grows with the
    rounds, so a bisection), or ``None`` if ``rounds`` rounds stay within it."""

    def over(r: int) -> bool:
        eps = accountant_epsilon(noise_multiplier, sample_rate, r, delta, accountant)
        return eps > target_epsilon

    if not over(rounds):
        return None
    low, high = 0, rounds  # ε(low) within the target, ε(high) over it
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if over(middle) else (middle, high)
    return high


def client_update(upload: Upload, key: str, x: Tensor) -> Tensor:
    """A client's clipped update of ``key``: its ``delta`` when asynchronous aggregation
    gives one (from the version it started from), else its upload minus ``x``."""
    if upload.delta is not None and key in upload.delta:
        return upload.delta[key].double()
    return upload.tensors[key].double() - x


def clipped(update: dict[str, Tensor], clip: float) -> tuple[dict[str, Tensor], float]:
    """The update scaled to L2 norm at most ``clip`` (over all its tensors), and its norm."""
    norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in update.values()))
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    return {k: t * scale for k, t in update.items()}, norm


class DP:
    """DP-FedAvg: clip each client's update to C, Gaussian noise σ·C/K on the mean."""

    secure_aggregation = "unweighted"
    """``aggregate`` reads only the unweighted mean of the clipped uploads (and K), so it
    runs under secure aggregation with every client weighted alike."""

    class Options(PluginOptions):
        clip: float = Field(1.0, gt=0)
        noise_multiplier: float | None = Field(None, ge=0)
        """σ; left out, calibrated from ``target_epsilon``, else ``DEFAULT_NOISE``."""
        target_epsilon: float | None = Field(None, gt=0)
        """The budget: ε after ``federation.rounds`` rounds, at ``delta``."""
        delta: float = Field(1e-5, gt=0, lt=1)
        accountant: Literal["rdp", "prv"] = "rdp"

        @field_validator("target_epsilon")
        @classmethod
        def _noise_for_a_budget(cls, target: float | None, info: ValidationInfo) -> float | None:
            if target is not None and info.data.get("noise_multiplier") == 0:
                raise ValueError(
                    "no target_epsilon with noise_multiplier 0 (no noise spends an infinite ε): "
                    "give noise_multiplier > 0, or leave it out to calibrate it from the target"
                )
            return target

    def __init__(self, options: Options) -> None:
        self.options = options
        # σ of the server's noise: the option, the default, or (server side, in
        # ``configure``) calibrated from ``target_epsilon``
        fixed = options.noise_multiplier
        self.sigma = fixed if fixed is not None else DEFAULT_NOISE

    # ---------------------------------------------------------------- client side

    @hookimpl
    def process_upload(self, ctx: ClientContext, upload: dict[str, Tensor]) -> dict[str, Tensor]:
        for key in upload:
            if key not in ctx.keys.model:
                raise RecipeError(
                    "plugins",
                    "uploads of model keys only with dp (it bounds model updates)",
                    key,
                )
        floats = [k for k, v in upload.items() if v.is_floating_point()]
        update = {k: upload[k].double() - ctx.received[k].double() for k in floats}
        update, norm = clipped(update, self.options.clip)
        ctx.log(dp_update_norm=norm, dp_clipped=norm > self.options.clip)
        out = dict(upload)
        for k in floats:
            out[k] = (ctx.received[k].double() + update[k]).to(upload[k].dtype)
        return out

    # ---------------------------------------------------------------- server side

    @hookimpl
    def configure(self, server: Server) -> None:
        """Calibrate σ from the budget, or refuse a run that would exceed it."""
        try:
            import opacus  # noqa: F401
        except ImportError:
            raise RecipeError(
                "plugins", "the dp extra installed (pip install 'fedkit-fl[dp]')", "dp"
            ) from None
        o = self.options
        if o.target_epsilon is None:
            return
        rounds, q = server.recipe.federation.rounds, sample_rate(server)
        if o.noise_multiplier is None:
            kept = server.state.setdefault("dp", {})  # a resumed run keeps the σ it began with
            if "noise_multiplier" not in kept:
                try:
                    kept["noise_multiplier"] = calibrated_noise(
                        o.target_epsilon, o.delta, q, rounds, o.accountant
                    )
                except ValueError:  # opacus: "the privacy budget is too low" (σ > 1e6)
                    raise RecipeError(
                        f"{option_key(server, 'dp')}.target_epsilon",
                        f"a budget a noise multiplier up to 1e6 meets in {rounds} rounds",
                        o.target_epsilon,
                    ) from None
            self.sigma = kept["noise_multiplier"]
        first = first_round_over(o.target_epsilon, self.sigma, q, rounds, o.delta, o.accountant)
        if first is not None:
            reached = accountant_epsilon(self.sigma, q, rounds, o.delta, o.accountant)
            raise RecipeError(
                f"{option_key(server, 'dp')}.target_epsilon",
                f"a budget the run keeps to: with noise_multiplier {self.sigma:g}, q = {q:g} "
                f"and δ = {o.delta:g}, the {o.accountant} accountant gives ε = {reached:.4g} "
                f"after {rounds} rounds, over the target from round {first}",
                o.target_epsilon,
                hint="; give fewer rounds, more noise, or leave noise_multiplier out to "
                "calibrate it",
            )

    @hookimpl
    def aggregate(self, server: Server, cluster: int, uploads: list[Upload]) -> dict[str, Tensor]:
        """x + mean of the clipped updates + N(0, (σC/K)²) per floating model key."""
        k = len(uploads)
        previous = server.pool[cluster]
        seed = derive(server.recipe.seed, "dp", server.round, cluster)
        generator = torch.Generator().manual_seed(seed)
        std = self.sigma * self.options.clip / k
        out = {}
        keys = {key for u in uploads for key, v in u.tensors.items() if v.is_floating_point()}
        for key in sorted(keys):
            x = previous[key].double()
            mean = sum(client_update(u, key, x) for u in uploads) / k
            noise = torch.randn(x.shape, generator=generator, dtype=torch.float64) * std
            out[key] = (x + mean + noise).to(previous[key].dtype)
        return out

    @hookimpl
    def round_end(self, server: Server) -> None:
        """ε spent so far: in the metrics row and booked in the ledger."""
        o, q = self.options, sample_rate(server)
        eps = accountant_epsilon(self.sigma, q, server.round, o.delta, o.accountant)
        server.log(dp_epsilon=eps, dp_delta=o.delta, dp_noise_multiplier=self.sigma)
        server.ledger.spend(
            server.round,
            epsilon=eps,
            delta=o.delta,
            level="client",
            accountant=o.accountant,
            noise_multiplier=self.sigma,
            sample_rate=q,
        )


def sample_rate(server: Server) -> float:
    """q: the fraction of clients sampled each round."""
    return server.recipe.federation.clients_per_round / server.recipe.data.num_clients
