"""Sample-level differential privacy on each client: DP-SGD (Abadi et al., CCS 2016) with
Opacus inside local training.

Every step of the core fit loop, each sample's gradient g_i (opacus's per-sample
gradients, computed by hooks it attaches to the working model's layers) is clipped to L2
norm C (``max_grad_norm``, over all trained parameters together), the clipped gradients
are summed, Gaussian noise N(0, (σ·C)²·I) is added (σ: ``noise_multiplier``) and the sum
is divided by the batch size n, exactly as opacus's ``DPOptimizer`` does. The rest of the
batch's gradient, whatever did not come through the samples (``p.grad − Σ_i g_i / n``:
FedProx's proximal term, any other term of the parameters alone), is added back
unclipped: it reads no data, so it costs no privacy. A term of another plugin that reads
the data (through the model's outputs) reaches the layers' hooks and is clipped with the
sample it came from.

How it composes: ``local_train`` attaches opacus's ``GradSampleHooks`` to the working
model and passes (returns ``None``), so the plugin that trains (fedavg, ifca, cpcfl)
still supplies its objective and the core's ``ctx.fit`` runs it with every plugin's
``loss_terms`` (fedprox's among them); ``before_step`` clips and noises; ``after_local_train``
takes the hooks off and does the accounting. A plugin that runs its own loop
(``local_train``: fedrep, fedbabu) cannot be combined with it.

Accounting: each round adds (σ, q, steps) to the client's history in ``ctx.state`` (plain
JSON, checkpointed, so a resumed run continues it), with q = batch_size / n; the client's
ε at ``delta`` from opacus's RDP accountant over that history (through ``_privacy``,
which ``dp`` shares) is logged as ``dpsgd_epsilon`` (per client in ``clients.jsonl``).
The accountant assumes Poisson sampling; fedkit's batches are a shuffled partition into
fixed-size batches, so ε is the customary approximation for shuffled DP-SGD, not a proof
for it (docs/plugins.md).

BatchNorm mixes the samples of a batch, so a per-sample gradient does not exist with it:
a model with BatchNorm (or any trained layer with buffers) is refused before round 1.
Needs the ``dp`` extra (opacus).
"""

from __future__ import annotations

import math
import warnings
from functools import lru_cache
from typing import Any
from weakref import WeakKeyDictionary

import torch
from pydantic import Field
from torch import Tensor, nn

from fedkit import ClientContext, FedkitError, PluginOptions, RecipeError, Server, derive, hookimpl
from fedkit_plugins._privacy import OPACUS_ORDERS, OPACUS_TOLERANCE, calibrated_noise
from fedkit_plugins._privacy import epsilon as accountant_epsilon

STATE = "dpsgd"
"""Where a client keeps its accounting in ``ctx.state``: ``history`` ([σ, q, steps] rows)
and, with ``target_epsilon``, the calibrated ``sigma``."""
SHOWN = 4
"""How many offending layers the refusal names before counting the rest."""

# opacus's layer hooks make every backward through a first layer whose input needs no
# gradient (the images) say so; it is expected here, and would repeat in every job
warnings.filterwarnings(
    "ignore", "Full backward hook is firing when gradients are computed", UserWarning
)


def unsupported_layers(model: nn.Module) -> list[str]:
    """Layers through which opacus has no per-sample gradient: BatchNorm (it mixes a
    batch's samples) and any trained layer that keeps buffers."""
    found = []
    for name, module in model.named_modules():
        trained = any(p.requires_grad for p in module.parameters(recurse=False))
        buffers = any(True for _ in module.buffers(recurse=False))
        if isinstance(module, nn.modules.batchnorm._BatchNorm) or (trained and buffers):
            found.append(name or type(module).__name__)
    return found


def epsilon(history: list[list[float]], delta: float) -> float:
    """ε at ``delta`` after the steps in ``history`` ([σ, q, steps] rows), from opacus's
    RDP accountant at its default orders (infinite once any step had no noise)."""
    return accountant_epsilon(history, delta, orders=OPACUS_ORDERS)


def recorded(history: list[list[float]], sigma: float, q: float, steps: int) -> list[list[float]]:
    """``history`` with ``steps`` more at (σ, q): RDP adds up, so rows that share (σ, q)
    merge and the state stays small however many rounds a client trains."""
    rows = [list(row) for row in history]
    for row in rows:
        if row[0] == sigma and row[1] == q:
            row[2] += steps
            return rows
    return [*rows, [sigma, q, steps]]


def planned_steps(ctx: ClientContext) -> int:
    """The most steps a client can take in the run: every round, ``local_epochs`` epochs of
    ``ceil(n / batch_size)`` batches (``n // batch_size`` with ``drop_last``)."""
    fed, n = ctx.recipe.federation, ctx.num_samples
    per_epoch = n // fed.batch_size if fed.drop_last else math.ceil(n / fed.batch_size)
    return fed.rounds * fed.local_epochs * max(per_epoch, 1)


@lru_cache(maxsize=64)
def calibrated(target_epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """σ for which opacus's RDP accountant gives at most ``target_epsilon`` after ``steps``
    steps at ``sample_rate`` (opacus's ``get_noise_multiplier`` at its default orders and
    tolerance; clients of one size share the answer)."""
    return calibrated_noise(
        target_epsilon, delta, sample_rate, steps, orders=OPACUS_ORDERS, tolerance=OPACUS_TOLERANCE
    )


class DPSGD:
    """DP-SGD on each client: per-sample clipping to C and Gaussian noise σ·C per step."""

    class Options(PluginOptions):
        max_grad_norm: float = Field(1.0, gt=0)
        noise_multiplier: float = Field(1.0, ge=0)
        target_epsilon: float | None = Field(None, gt=0)
        delta: float = Field(1e-5, gt=0, lt=1)

    def __init__(self, options: Options) -> None:
        self.options = options
        self._attached: WeakKeyDictionary[nn.Module, Any] = WeakKeyDictionary()

    # ---------------------------------------------------------------- server side

    @hookimpl
    def configure(self, server: Server) -> None:
        try:
            import opacus  # noqa: F401
        except ImportError:
            raise RecipeError(
                "plugins", "the dp extra installed (pip install 'fedkit-fl[dp]')", "dpsgd"
            ) from None
        o = self.options
        if o.target_epsilon is not None and "noise_multiplier" in o.model_fields_set:
            raise RecipeError(
                "plugins.dpsgd",
                "noise_multiplier or target_epsilon, not both (the target sets the noise)",
            )

    @hookimpl
    def private_keys(self, server: Server, model: nn.ModuleDict) -> None:
        """Refuse, before round 1, a model opacus has no per-sample gradients for."""
        layers = unsupported_layers(model)
        if layers:
            more = f" and {len(layers) - SHOWN} more" if len(layers) > SHOWN else ""
            raise RecipeError(
                "plugins.dpsgd",
                "a model without BatchNorm (DP-SGD needs per-sample gradients and BatchNorm "
                "mixes the samples of a batch: use a backbone without it, e.g. niid_bench_cnn)",
                f"{', '.join(layers[:SHOWN])}{more}",
            )

    # ---------------------------------------------------------------- client side

    def _sigma(self, ctx: ClientContext) -> float:
        """σ: the option, or calibrated once per client from ``target_epsilon`` for the
        most steps it can take in the run (kept in ``ctx.state``, so it never changes)."""
        o = self.options
        if o.target_epsilon is None:
            return o.noise_multiplier
        kept = ctx.state.get(STATE, {})
        if "sigma" not in kept:
            q, steps = self._sample_rate(ctx), planned_steps(ctx)
            sigma = calibrated(o.target_epsilon, o.delta, q, steps)
            ctx.state[STATE] = kept = {**kept, "sigma": sigma}
        return kept["sigma"]

    @staticmethod
    def _sample_rate(ctx: ClientContext) -> float:
        return min(1.0, ctx.recipe.federation.batch_size / max(ctx.num_samples, 1))

    def _detach(self, model: nn.Module) -> None:
        hooks = self._attached.pop(model, None)
        if hooks is not None:
            hooks.cleanup()

    @hookimpl
    def local_train(self, ctx: ClientContext, model: nn.ModuleDict) -> None:
        """Attach opacus's per-sample gradient hooks, then pass: the training plugin's
        objective runs in the core loop, through the hooked layers."""
        from opacus.grad_sample import GradSampleHooks

        layers = unsupported_layers(model)
        if layers:
            raise FedkitError(f"dpsgd: no per-sample gradients through {', '.join(layers)}")
        self._detach(model)  # left over from a job that failed mid-training
        self._attached[model] = GradSampleHooks(model, loss_reduction="mean", strict=True)
        seed = derive(ctx.recipe.seed, "dpsgd", ctx.round, ctx.id)
        ctx.scratch[STATE] = {
            "sigma": self._sigma(ctx),
            "generator": torch.Generator(device=ctx.device).manual_seed(seed),
            "steps": 0,
            "clipped": 0,
            "samples": 0,
        }
        return None

    @hookimpl
    def before_step(self, ctx: ClientContext, model: nn.ModuleDict, optimizer: Any) -> None:
        """Replace the data's part of each gradient by the mean of clipped per-sample
        gradients plus noise; keep the part that came from no sample."""
        run = ctx.scratch.get(STATE)
        if run is None:
            return
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        samples = [self._samples(p) for p in params]
        if not samples:
            return
        n = samples[0].shape[0]
        norms = torch.stack([g.reshape(n, -1).norm(2, dim=1) for g in samples], dim=1).norm(
            2, dim=1
        )
        c = self.options.max_grad_norm
        factor = (c / (norms + 1e-6)).clamp(max=1.0)
        std = run["sigma"] * c
        for p, g in zip(params, samples, strict=True):
            summed = torch.einsum("i,i...->...", factor.to(g.dtype), g)
            if std > 0:
                summed += torch.normal(
                    0.0, std, p.shape, generator=run["generator"], device=p.device, dtype=g.dtype
                )
            other = p.grad - g.sum(0) / n
            p.grad = (summed / n + other).to(p.grad.dtype)
        for p in model.parameters():
            if hasattr(p, "grad_sample"):
                p.grad_sample = None
        run["steps"] += 1
        run["clipped"] += int((norms > c).sum())
        run["samples"] += n

    @staticmethod
    def _samples(p: Tensor) -> Tensor:
        grads = getattr(p, "grad_sample", None)
        if grads is None or isinstance(grads, list):
            why = "none" if grads is None else "several backward passes in one step"
            raise FedkitError(
                f"dpsgd: a trained parameter of shape {tuple(p.shape)} has a gradient but no "
                f"per-sample gradient ({why}); DP-SGD needs every trained parameter used "
                "in a layer's forward pass, once per step"
            )
        return grads

    @hookimpl
    def after_local_train(self, ctx: ClientContext, model: nn.ModuleDict) -> None:
        """Take the hooks off, add this round's steps to the history and log ε."""
        self._detach(model)
        run = ctx.scratch.pop(STATE, None)
        if run is None:
            return
        kept = ctx.state.get(STATE, {})
        q = self._sample_rate(ctx)
        history = recorded(kept.get("history", []), run["sigma"], q, run["steps"])
        ctx.state[STATE] = {**kept, "history": history}  # a new dict: the old one may be shared
        ctx.log(
            dpsgd_epsilon=epsilon(history, self.options.delta),
            dpsgd_noise_multiplier=run["sigma"],
            dpsgd_sample_rate=q,
            dpsgd_steps=run["steps"],
            dpsgd_clipped=run["clipped"] / max(run["samples"], 1),
        )
