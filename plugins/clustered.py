"""Shared machinery of the clustered plugins (ifca, cpcfl): building the pool of N models,
choosing a cluster (lowest loss or at random), local training with or without a frozen
encoder, and loading an encoder saved by another run."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file
from torch import Tensor, nn

from fedkit.atomic import write_safetensors
from fedkit.checkpoint import saved_part
from fedkit.client import Client
from fedkit.errors import FedkitError, RecipeError
from fedkit.models.backbones import create_backbone, feature_dim
from fedkit.models.heads import classifier_head
from fedkit.seeding import derive
from fedkit.server import Server
from fedkit.training import make_optimizer, normalize, supervised_loss, train_supervised

ENCODER_FILE = "encoder.safetensors"


class PoolOptions(BaseModel):
    """Options every clustered plugin shares: the pool, its heads, an optional encoder."""

    model_config = ConfigDict(extra="forbid")

    num_clusters: int = Field(3, ge=1)
    head: Literal["c", "c-1", "c-2", "c-3"] = "c"
    head_hidden: int = Field(128, gt=0)
    encoder: str | None = None
    broadcast_pool: bool = True


class PoolPlugin:
    """What the clustered plugins keep per run: their options, a scratch model for scoring
    cluster models, and the encoder state the pool starts from (``None``: random)."""

    def __init__(self, options: PoolOptions) -> None:
        self.options = options
        self.scratch = Scratch()
        self.encoder: dict[str, Tensor] | None = None


def load_encoder(path: str | Path, where: str = "encoder") -> dict[str, Tensor]:
    """An encoder's state from a safetensors file or a run directory.

    A run directory gives its ``encoder.safetensors`` (a CP-CFL pre-trained encoder) when
    it has one, otherwise the ``encoder.*`` keys of cluster 0 in its newest checkpoint
    (e.g. the encoder of a FedAvg run). Keys may carry an ``encoder.`` prefix or not.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        if (path / ENCODER_FILE).is_file():
            return _strip(load_file(path / ENCODER_FILE))
        try:
            return saved_part(path, "encoder")
        except FedkitError:
            raise RecipeError(
                where, f"a run directory with a checkpoint or {ENCODER_FILE}", str(path)
            ) from None
    if not path.is_file():
        raise RecipeError(where, "a safetensors file or a run directory", str(path))
    return _strip(load_file(path))


def _strip(state: dict[str, Tensor]) -> dict[str, Tensor]:
    if any(k.startswith("encoder.") for k in state):
        return {k[len("encoder.") :]: v for k, v in state.items() if k.startswith("encoder.")}
    return state


def save_encoder(encoder: nn.Module, path: Path) -> None:
    """Write an encoder's state (keys without prefix) as safetensors, atomically."""
    write_safetensors(path, {k: v.detach().cpu() for k, v in encoder.state_dict().items()})


def new_encoder(server: Server, state: dict[str, Tensor] | None = None) -> nn.Module:
    """The recipe's backbone, randomly initialised or loaded from ``state``."""
    encoder = create_backbone(server.recipe.backbone)
    if state is not None:
        try:
            encoder.load_state_dict(state)
        except RuntimeError as exc:
            first = str(exc).splitlines()[0]
            raise RecipeError(
                "encoder", f"an encoder saved from backbone {server.recipe.backbone.name}", first
            ) from None
    return encoder


def build_pool(
    server: Server,
    n: int,
    head: str,
    head_hidden: int,
    encoder: nn.Module | None = None,
) -> list[nn.ModuleDict]:
    """N models ``{encoder, classifier}``: copies of ``encoder`` with N random heads, or,
    without one, N independently initialised models."""
    pool = []
    for _ in range(n):
        enc = copy.deepcopy(encoder) if encoder is not None else new_encoder(server)
        dim = feature_dim(enc)
        head_module = classifier_head(dim, server.data.num_classes, head, head_hidden)
        pool.append(nn.ModuleDict({"encoder": enc, "classifier": head_module}))
    return pool


class Scratch:
    """A reusable working model for scoring cluster models on a client's data."""

    def __init__(self) -> None:
        self.model: nn.ModuleDict | None = None

    def loaded(self, server: Server, state: dict[str, Tensor]) -> nn.ModuleDict:
        if self.model is None:
            self.model = copy.deepcopy(server.template).to(server.device)
        keys = server.model_keys
        self.model.load_state_dict({k: v for k, v in state.items() if k in keys}, strict=False)
        return self.model


def cluster_losses(client: Client, server: Server, scratch: Scratch) -> list[float]:
    """Every cluster model's mean loss on the client's training data (each one downloaded)."""
    losses = []
    for cluster in range(len(server.pool)):
        model = scratch.loaded(server, server.download(client, cluster))
        losses.append(supervised_loss(model, client.train, server.device))
    return losses


def lowest_loss_cluster(client: Client, server: Server, scratch: Scratch) -> int:
    """IFCA's / CP-CFL's identity estimate: argmin of the cluster losses (first on ties)."""
    return int(np.argmin(cluster_losses(client, server, scratch)))


def random_cluster(client: Client, server: Server, broadcast: bool) -> int:
    """A cluster drawn uniformly, seeded by (run seed, round, client). With ``broadcast``
    the client receives the whole pool, as the papers' cost model counts."""
    if broadcast:
        for cluster in range(len(server.pool)):
            server.download(client, cluster)
    rng = np.random.default_rng(derive(server.recipe.seed, "cluster", client.round, client.id))
    return int(rng.integers(len(server.pool)))


def train_local(
    client: Client, model: nn.ModuleDict, server: Server, freeze_encoder: bool
) -> dict[str, Any]:
    """Supervised local training; with ``freeze_encoder`` only the classifier learns and the
    encoder stays in eval mode (BN statistics untouched), so its state does not change."""
    cfg = server.recipe.federation
    if not freeze_encoder:
        return train_supervised(
            model, client.train, cfg, client.round, device=client.device, generator=client.rng
        )
    return train_head(client, model, server)


def train_head(client: Client, model: nn.ModuleDict, server: Server) -> dict[str, Any]:
    """Train the classifier on features of the frozen encoder, computed once per round."""
    cfg, data, device = server.recipe.federation, client.train, client.device
    encoder, head = model["encoder"].eval(), model["classifier"].train()
    with torch.no_grad():
        feats = torch.cat(
            [
                encoder(normalize(data.images[i : i + 512].to(device), data))
                for i in range(0, len(data), 512)
            ]
        )
    labels = data.labels.to(device)
    optimizer = make_optimizer(head.parameters(), cfg, client.round)
    loss_sum, count = 0.0, 0
    for _ in range(cfg.local_epochs):
        loss_sum, count = 0.0, 0
        order = torch.randperm(len(labels), generator=client.rng).to(device)
        for start in range(0, len(labels), cfg.batch_size):
            idx = order[start : start + cfg.batch_size]
            loss = F.cross_entropy(head(feats[idx]), labels[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(idx)
            count += len(idx)
    return {"loss": loss_sum / max(count, 1)}


def collapsed(server: Server, sampled: list[int]) -> bool:
    """Whether every client of this round chose the same cluster (with a pool of several)."""
    chosen = {server.clients[c].cluster for c in sampled}
    return len(server.pool) > 1 and len(sampled) > 1 and len(chosen) == 1
