"""FedCA (Zhang et al., 2020): SimCLR on every client plus two modules.

* Dictionary: after local training each client encodes its own samples (no augmentation,
  end-of-round encoder + projector), L2-normalises them and uploads them under
  ``fedca.dictionary``. The server concatenates the uploads, shuffles the rows (seeded)
  and keeps at most ``dictionary_size`` of them in the cluster state, so every client
  receives the dictionary next round and appends it to the negatives of its NT-Xent
  loss. These are features of private data leaving the client: the ledger counts
  them as data-derived and the plugin declares ``uploads_data_derived``.
* Alignment: the server's unlabelled split (``data.server_fraction``) is the public data
  set. A base encoder (the recipe's backbone) is trained on it once with SimCLR
  (``fedkit.ssl.pretrain``) and its features of the public images are computed. Each
  client adds ``align_weight · mean_x ‖f_k(x) − f_base(x)‖²`` over a batch of public
  images per step (a ``loss_terms`` term, logged as ``loss_align``). The server sends
  the public images and base features to a client once, on its first participation
  (``downlink``: the ledger books them as data-derived), and the client keeps them in
  ``ctx.tensors``. The base encoder never leaves the server; the core keeps its features
  (``server.once``), so a resumed run does not train it again.

Defaults are fedkit's choices, not verified against the FedCA paper: temperature 0.1,
all local samples uploaded, no dictionary cap, alignment weight 0.01, public batch 64,
base model SimCLR for 10 epochs. The FedCA paper writes the alignment loss as a sum over the
public set; the mean over a public batch differs by a constant factor held in
``align_weight``.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field
from torch import Tensor, nn

from fedkit import (
    ClientContext,
    ClientInfo,
    ImageSet,
    Objective,
    PretrainConfig,
    RecipeError,
    Server,
    Upload,
    create_backbone,
    derive,
    extract_features,
    hookimpl,
    normalize,
    nt_xent,
    pretrain_encoder,
)
from fedkit_plugins._ssl_common import ONLINE, online_parts, ssl_objective
from fedkit_plugins.fedsimclr import SimCLROptions

DICTIONARY = "fedca.dictionary"
PUBLIC_IMAGES = "fedca.public_images"
PUBLIC_FEATURES = "fedca.public_features"
BASE = "fedca_base"


class FedCAOptions(SimCLROptions):
    """FedSimCLR's options plus the dictionary and alignment modules (defaults unverified)."""

    dictionary: bool = True
    samples_per_client: int | None = Field(None, gt=0)
    dictionary_size: int | None = Field(None, gt=0)
    alignment: bool = True
    align_weight: float = Field(0.01, ge=0)
    public_batch: int = Field(64, gt=0)
    base: PretrainConfig = Field(default_factory=PretrainConfig)


def alignment_loss(features: Tensor, base_features: Tensor) -> Tensor:
    """Mean over samples of the squared L2 distance ‖f_k(x) − f_base(x)‖²."""
    return (features - base_features.detach()).pow(2).sum(dim=1).mean()


def fedca_loss(
    z1: Tensor,
    z2: Tensor,
    temperature: float,
    dictionary: Tensor | None = None,
    public_features: Tensor | None = None,
    base_features: Tensor | None = None,
    align_weight: float = 0.0,
) -> Tensor:
    """NT-Xent of the two views with the dictionary as extra negatives, plus the weighted
    alignment loss when public and base features are given."""
    loss = nt_xent(z1, z2, temperature, extra_negatives=dictionary)
    if public_features is not None and base_features is not None:
        loss = loss + align_weight * alignment_loss(public_features, base_features)
    return loss


def encode_dictionary(model: nn.ModuleDict, data: ImageSet, device: torch.device) -> Tensor:
    """L2-normalised projections of ``data``'s images (no augmentation, eval mode), on
    the CPU; ``model`` must already be on ``device``."""
    net = nn.Sequential(model["encoder"], model["projector"])
    z = extract_features(net, data.images, device=device, mean=data.mean, std=data.std)
    return nn.functional.normalize(z, dim=1)


class FedCA:
    """FedCA: SimCLR + a global dictionary of client features + alignment to a base model."""

    Options = FedCAOptions
    uploads_data_derived = True

    def __init__(self, options: FedCAOptions) -> None:
        self.options = options
        self.base_features: Tensor | None = None  # server side only

    # ---------------------------------------------------------------- server side

    @hookimpl
    def configure(self, server: Server) -> None:
        recipe = server.recipe
        if self.options.alignment and len(server.own_data) == 0:
            raise RecipeError(
                "data.server_fraction",
                "> 0: FedCA's alignment module uses the server split as its public data",
                recipe.data.server_fraction,
                hint=" (or set plugins.fedca.alignment: false)",
            )

    @hookimpl
    def init_models(self, server: Server) -> list[nn.ModuleDict]:
        model = nn.ModuleDict(online_parts(server, self.options, predictor=False))
        if self.options.alignment:
            kept = server.once(BASE, lambda: {"features": self._base_features(server)})
            self.base_features = kept["features"]
        return [model]

    def _public(self, server: Server) -> ImageSet:
        return server.own_data

    def _base_features(self, server: Server) -> Tensor:
        """Train the base encoder on the public set; its features of the public images."""
        public = self._public(server)
        encoder = create_backbone(server.recipe.backbone)
        generator = torch.Generator().manual_seed(derive(server.recipe.seed, "fedca", "base"))
        losses = pretrain_encoder(
            encoder, public, self.options.base, device=server.device, generator=generator
        )
        server.state["fedca"] = {"base_losses": losses, "public_images": len(public)}
        return extract_features(
            encoder, public.images, device=server.device, mean=public.mean, std=public.std
        )

    @hookimpl
    def downlink(self, server: Server, client: ClientInfo) -> dict[str, Tensor] | None:
        """The public images and base features, once, on a client's first participation."""
        if not self.options.alignment or client.participations > 0:
            return None
        return {PUBLIC_IMAGES: self._public(server).images, PUBLIC_FEATURES: self.base_features}

    @hookimpl
    def aggregate(self, server: Server, cluster: int, uploads: list[Upload]) -> dict[str, Tensor]:
        """The global dictionary: every upload's features in a seeded random order (so
        that row positions do not tell which client sent a row), cut to ``dictionary_size``."""
        parts = [u.tensors[DICTIONARY] for u in uploads if DICTIONARY in u.tensors]
        if not parts:
            return {}
        bank = torch.cat(parts)
        seed = derive(server.recipe.seed, "fedca", "dictionary", server.round, cluster)
        order = torch.randperm(len(bank), generator=_gen(seed))
        return {DICTIONARY: bank[order[: self.options.dictionary_size]]}

    # ---------------------------------------------------------------- client side

    @hookimpl
    def kept_keys(self, server: Server, model: nn.ModuleDict) -> list[str]:
        return []  # update_client only stores what it received in ctx.tensors

    @hookimpl
    def update_client(
        self, ctx: ClientContext, received: dict[str, Tensor], local: dict[str, Tensor]
    ) -> None:
        """Keep the public set and base features the server sent on the first visit."""
        for key in (PUBLIC_IMAGES, PUBLIC_FEATURES):
            if key in received:
                ctx.tensors[key] = received[key]

    @hookimpl
    def local_objective(self, ctx: ClientContext, model: nn.ModuleDict) -> Objective:
        """NT-Xent with this round's dictionary as extra negatives."""
        o = self.options
        dictionary = ctx.received.get(DICTIONARY) if o.dictionary else None
        if dictionary is not None and len(dictionary) == 0:
            dictionary = None

        def loss(model: nn.ModuleDict, v1: Tensor, v2: Tensor) -> tuple[Tensor, dict]:
            h1 = model["encoder"](v1)
            z1 = model["projector"](h1)
            z2 = model["projector"](model["encoder"](v2))
            loss = fedca_loss(z1, z2, o.temperature, dictionary)
            return loss, {"features": h1, "projections": z1}

        return ssl_objective(ctx, model, o, loss, ONLINE)

    @hookimpl
    def loss_terms(self, ctx: ClientContext, model: nn.ModuleDict, batch: Any) -> dict[str, Tensor]:
        """The alignment term on a fresh batch of public images."""
        o = self.options
        if not o.alignment or o.align_weight == 0:
            return {}
        public, base = ctx.tensors[PUBLIC_IMAGES], ctx.tensors[PUBLIC_FEATURES]
        idx = torch.randperm(len(public), generator=ctx.rng)[: o.public_batch]
        h = model["encoder"](normalize(public[idx].to(ctx.device), ctx.train))
        return {"align": o.align_weight * alignment_loss(h, base[idx].to(h.device))}

    @hookimpl
    def upload_selection(
        self, ctx: ClientContext, local: dict[str, Tensor], model: nn.ModuleDict
    ) -> dict[str, Tensor] | None:
        """Add the client's normalised sample features (end-of-round model)."""
        if not self.options.dictionary:
            return None
        data = ctx.train
        n = self.options.samples_per_client
        if n is not None and n < len(data):
            seed = derive(ctx.recipe.seed, "fedca", "samples", ctx.round, ctx.id)
            data = data.subset(torch.randperm(len(data), generator=_gen(seed))[:n])
        return {DICTIONARY: encode_dictionary(model, data, ctx.device)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
