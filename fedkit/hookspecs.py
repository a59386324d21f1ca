"""The hooks a fedkit plugin can implement, in the order a run calls them.

Each docstring here is the reference documentation: ``docs/hooks.md`` is generated from
it (``python -m fedkit.hookdocs``) and a test checks the two agree.

Three kinds of hook:

* **all** hooks call every implementation (``configure``, ``private_parts``,
  ``round_end``, ``evaluate``).
* **firstresult** hooks stop at the first implementation returning something other than
  ``None`` (``init_models``, ``select_cluster``, ``local_train``). Recipe order decides:
  the plugin listed first is asked first.
* **key-level** hooks (``update_client``, ``upload_selection``, ``aggregate``) let every
  plugin *claim* the state keys it handles by returning a ``{key: value}`` mapping. Keys
  nobody claims get the plain defaults (send, weighted mean, replace). Two plugins
  claiming the same key is an error naming both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

from fedkit import PROJECT

if TYPE_CHECKING:
    from torch import Tensor, nn

    from fedkit.client import Client
    from fedkit.recipe import Recipe
    from fedkit.server import Server, Upload

hookspec = pluggy.HookspecMarker(PROJECT)

KEY_LEVEL_HOOKS = ("update_client", "upload_selection", "aggregate")


@hookspec
def configure(recipe: Recipe, server: Server) -> None:
    """Check the recipe as a whole before anything is trained.

    Called once per run, after every active plugin has been constructed with its own
    options, and before ``init_models``. Raise ``fedkit.errors.RecipeError`` for a setting
    this plugin cannot work with (for example a missing predictor, or an option that
    conflicts with another plugin). Values a plugin wants to keep for the run go in
    ``server.state`` (JSON values, checkpointed) rather than in module globals.

    :param recipe: the validated recipe.
    :param server: the server; its pool is still empty.
    :returns: nothing.
    """


@hookspec
def private_parts(recipe: Recipe) -> list[str] | None:
    """Name the model parts that never leave a client (e.g. a BYOL target network).

    Called once per run; the answers of all plugins are joined. Keys under a private part
    are kept out of the server's pool, out of the default upload, and out of the default
    update: each client keeps its own copy across rounds in the client state store.

    :param recipe: the validated recipe.
    :returns: part names (top-level keys of the model's ``ModuleDict``), or ``None``.
    """


@hookspec(firstresult=True)
def init_models(server: Server) -> list[nn.ModuleDict] | None:
    """Build the server's initial pool of models: one per cluster.

    Called once per run, on the server, after ``configure``. The first model is also the
    template every client's working model is built from, so it must contain every part
    (private ones too). A pool of one model is plain federated learning; clustered methods
    return N models. Server-side pre-training belongs here too; put tensors the run must
    keep (a pre-trained encoder, say) in ``server.tensors`` so that checkpoints hold them.
    Built-in default: none — a plugin must provide the model (a supervised plugin can
    use ``fedkit.models.build_classifier``: the recipe's backbone plus a linear head).

    :param server: the server, with ``recipe``, ``data`` and ``device`` set.
    :returns: a list of ``torch.nn.ModuleDict`` (one per cluster), or ``None`` to pass.
    """


@hookspec(firstresult=True)
def select_cluster(client: Client, server: Server) -> int | None:
    """Choose which model of the pool a sampled client works on this round.

    Called per sampled client per round, before ``update_client``. A plugin that looks at
    several cluster models (lowest-loss selection evaluates all of them) fetches each with
    ``server.download(client, cluster)``, which records the bytes in the ledger once per
    cluster per round. Default (no plugin answers): cluster 0.

    :param client: the sampled client (its data, ``state``, ``rng``, previous ``cluster``).
    :param server: the server with its pool.
    :returns: a cluster index in ``range(len(server.pool))``, or ``None`` to pass.
    """


@hookspec
def update_client(
    client: Client, server: Server, received: dict[str, Tensor], local: dict[str, Tensor]
) -> dict[str, Tensor] | None:
    """Merge the state the client received with the state it kept (key-level hook).

    Called per sampled client per round, after ``select_cluster``. ``received`` holds the
    chosen cluster's shared keys; ``local`` holds the client's full state from its last
    round (on its first participation, ``client.participations == 0`` and ``local`` is the
    template's fresh initialisation). Return the keys this plugin claims with the values
    the client should train from. Unclaimed keys: received keys replace local ones, other
    keys stay as they were.

    :param client: the client.
    :param server: the server.
    :param received: the cluster state sent down (do not modify in place).
    :param local: the client's kept state.
    :returns: ``{key: tensor}`` for the claimed keys, or ``None`` to claim nothing.
    """


@hookspec(firstresult=True)
def local_train(client: Client, model: nn.ModuleDict, server: Server) -> dict[str, Any] | None:
    """Train the client's working model on its private data.

    Called per sampled client per round, after ``update_client`` loaded the merged state
    into ``model`` (on ``client.device``). Train ``model`` in place. Global and numpy
    random generators are seeded per (round, client) before the call, and ``client.rng``
    is a ``torch.Generator`` seeded the same way, so runs are reproducible.

    :param client: the client, with ``train`` data, ``state`` and ``round``.
    :param model: the working ``ModuleDict`` (template architecture, client's state).
    :param server: the server (recipe, round, device).
    :returns: metrics such as ``{"loss": float}``; ``None`` to pass to the next plugin.
    """


@hookspec
def upload_selection(
    client: Client, server: Server, local: dict[str, Tensor]
) -> dict[str, Tensor | None] | None:
    """Choose what the client sends to the server after training (key-level hook).

    Called per sampled client per round, after ``local_train``; ``local`` is the client's
    state after training. Return the keys this plugin claims: a tensor to send it (under
    that key), ``None`` to keep it private. A claimed key that is not a model key (for
    example ``features.x``) is sent as data-derived and the ledger marks it so; a plugin
    that does this should set ``uploads_data_derived = True`` so that ``fedkit plugins``
    and ``fedkit run`` can warn. Unclaimed keys: the shared (non-private) model keys are
    sent as they are.

    :param client: the client.
    :param server: the server.
    :param local: the client's state after local training.
    :returns: ``{key: tensor or None}`` for the claimed keys, or ``None``.
    """


@hookspec
def aggregate(server: Server, cluster: int, uploads: list[Upload]) -> dict[str, Tensor] | None:
    """Combine the uploads of the clients that worked on one cluster (key-level hook).

    Called per cluster per round, for clusters at least one client chose (a cluster
    nobody chose keeps its model). Each ``Upload`` has ``client``, ``weight`` (the
    client's number of training samples) and ``tensors``. Return the keys this plugin
    claims with their new server values; claimed keys not in the model are kept in the
    cluster state and sent down with it next round. Unclaimed keys: the mean weighted by
    ``weight`` (floating tensors, BN statistics included); integer buffers take the
    weighted mean rounded down.

    :param server: the server.
    :param cluster: the cluster index.
    :param uploads: what each client of the cluster sent.
    :returns: ``{key: tensor}`` for the claimed keys, or ``None``.
    """


@hookspec
def round_end(server: Server, metrics: dict[str, Any]) -> None:
    """Run server-side logic after aggregation (logging, schedules, restarts).

    Called once per round, after every cluster was aggregated and before evaluation.
    Add entries to ``metrics`` to have them written to ``metrics.jsonl`` (JSON values
    only; they must be deterministic for resumed runs to match).

    :param server: the server, pool updated.
    :param metrics: this round's metrics row so far (mutable).
    :returns: nothing.
    """


@hookspec
def evaluate(server: Server, round: int) -> dict[str, Any] | None:
    """Add evaluation metrics for this round.

    Called every ``evaluation.every`` rounds and after the last round, after the core's
    own protocol (``evaluation.protocol``) ran. Results of all plugins are merged into
    the round's metrics row.

    :param server: the server.
    :param round: the round just finished (1-based).
    :returns: a mapping of metric names to JSON values, or ``None``.
    """
