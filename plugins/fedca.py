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
  images per step. The public images and base features are sent to a client once, on
  its first participation, and recorded in the ledger then; the base encoder itself
  never leaves the server (saved as ``fedca-base.safetensors`` in the run directory).

Defaults are fedkit's choices, not verified against the FedCA paper: temperature 0.1,
all local samples uploaded, no dictionary cap, alignment weight 0.01, public batch 64,
base model SimCLR for 10 epochs. METHODS.md writes the alignment loss as a sum over the
public set; the mean over a public batch differs by a constant factor held in
``align_weight``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from pydantic import Field
from safetensors.torch import load_file
from torch import Tensor, nn

from fedkit import hookimpl
from fedkit.atomic import write_safetensors
from fedkit.client import Client
from fedkit.data.datasets import ImageSet
from fedkit.errors import RecipeError
from fedkit.evaluation.features import extract_features
from fedkit.models import create_backbone
from fedkit.recipe import Recipe
from fedkit.seeding import derive
from fedkit.server import Server, Upload
from fedkit.ssl.local import TwoViewLoss
from fedkit.ssl.losses import nt_xent
from fedkit.ssl.pretrain import PretrainConfig, pretrain_encoder
from fedkit.training import normalize
from fedkit_plugins._ssl_common import online_parts, train_ssl
from fedkit_plugins.fedsimclr import SimCLROptions

DICTIONARY = "fedca.dictionary"
PUBLIC_IMAGES = "fedca.public_images"
PUBLIC_FEATURES = "fedca.public_features"
BASE_FILE = "fedca-base.safetensors"


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
        self.public: ImageSet | None = None
        self.base_features: Tensor | None = None

    @hookimpl
    def configure(self, recipe: Recipe, server: Server) -> None:
        if self.options.alignment and len(server.data.server) == 0:
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
            self.public = server.data.train.subset(server.data.server)
            base = self._base_encoder(server)
            self.base_features = extract_features(
                base,
                self.public.images,
                device=server.device,
                mean=self.public.mean,
                std=self.public.std,
            )
        return [model]

    def _base_encoder(self, server: Server) -> nn.Module:
        """The base encoder: loaded from the run directory, or trained on the public set."""
        encoder = create_backbone(server.recipe.backbone)
        saved = server.out / BASE_FILE if server.out is not None else None
        if saved is not None and saved.is_file():
            encoder.load_state_dict(load_file(saved))
            return encoder.to(server.device).eval()
        generator = torch.Generator().manual_seed(derive(server.recipe.seed, "fedca", "base"))
        losses = pretrain_encoder(
            encoder, self.public, self.options.base, device=server.device, generator=generator
        )
        server.state["fedca"] = {"base_losses": losses, "public_images": len(self.public)}
        if saved is not None:
            write_safetensors(saved, {k: v.detach().cpu() for k, v in encoder.state_dict().items()})
        return encoder

    @hookimpl
    def update_client(
        self, client: Client, server: Server, received: dict[str, Tensor], local: dict[str, Tensor]
    ) -> None:
        """Record the one-time download of the public images and base features."""
        if self.options.alignment and client.participations == 0:
            sent = {PUBLIC_IMAGES: self.public.images, PUBLIC_FEATURES: self.base_features}
            server.ledger.record(server.round, client.id, "down", sent, server.model_keys)

    def objective(self, client: Client) -> TwoViewLoss:
        """The client's loss this round: its received dictionary, fresh public batches."""
        o = self.options
        dictionary = client.received.get(DICTIONARY) if o.dictionary else None
        if dictionary is not None and len(dictionary) == 0:
            dictionary = None

        def loss(model: nn.ModuleDict, v1: Tensor, v2: Tensor) -> Tensor:
            z1 = model["projector"](model["encoder"](v1))
            z2 = model["projector"](model["encoder"](v2))
            if not o.alignment or o.align_weight == 0:
                return fedca_loss(z1, z2, o.temperature, dictionary)
            idx = torch.randperm(len(self.public), generator=client.rng)[: o.public_batch]
            x = normalize(self.public.images[idx].to(v1.device), self.public)
            h = model["encoder"](x)
            base = self.base_features[idx].to(h.device)
            return fedca_loss(z1, z2, o.temperature, dictionary, h, base, o.align_weight)

        return loss

    @hookimpl
    def local_train(self, client: Client, model: nn.ModuleDict, server: Server) -> dict[str, Any]:
        loss = self.objective(client)
        return train_ssl(client, model, server, self.options, loss, ("encoder", "projector"))

    @hookimpl
    def upload_selection(
        self, client: Client, server: Server, local: dict[str, Tensor]
    ) -> dict[str, Tensor] | None:
        """Add the client's normalised sample features (end-of-round model)."""
        if not self.options.dictionary:
            return None
        model = copy.deepcopy(server.template).to(client.device)
        model.load_state_dict(local)
        data = client.train
        n = self.options.samples_per_client
        if n is not None and n < len(data):
            seed = derive(server.recipe.seed, "fedca", "samples", server.round, client.id)
            data = data.subset(torch.randperm(len(data), generator=_gen(seed))[:n])
        return {DICTIONARY: encode_dictionary(model, data, client.device)}

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


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
