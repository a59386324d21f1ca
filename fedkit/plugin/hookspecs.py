"""The hooks a fedkit plugin can implement (contract v3), in the order a run calls them.

Each docstring here is the reference documentation: ``docs/hooks.md`` is generated from
it (``python -m fedkit.cli.reference docs``) and a test checks the two agree.

**Three sides.** *Registry* hooks run once per process, on every installed plugin, before
any recipe is read: they add data sets, partitioners, executors and client stores under a
name a recipe can use. Every other hook runs either on the server or on a client, as it
would in a real federation. Server-side hooks receive the ``Server``: the model pool, the
recipe, the ledger, what clients declared (``roster``) and the server's own data split,
never a client's data. Client-side hooks receive a ``ClientContext`` that holds only what
a real client has: its id, its private data, what it keeps between rounds, what the server
sent it this round, the recipe, the round, its device and RNG. Each side builds its own
plugin instances from the recipe, so nothing a plugin stores on ``self`` on one side is
visible on the other; whatever crosses goes through the core, which books it in the
ledger. *Simulation* hooks stand for what no party of a real federation is: an adversary
that controls some clients and, in simulation, knows which (``malicious_clients``), crafts
their uploads from what its threat model lets it see (``attack_uploads``) and measures its
success (``attack_evaluate``). They receive an ``Adversary`` view, never the ``Server``,
and no server-side hook receives what they know.

**Four kinds of hook.** Every call goes through pluggy's hook call, so tracing
(``add_hookcall_monitoring``) and wrappers see every hook; the recipe's order of plugins
is the call order (``tryfirst``/``trylast`` are refused).

* **all**: every implementation is called (``configure``, ``round_end``, ...).
* **firstresult**: the first implementation that returns something other than ``None``
  answers; the plugin listed first in the recipe is asked first. Two active plugins
  implementing one is an error (the second would never run).
* **claims** (key-level): every plugin returns ``{key: value}`` for the keys it takes
  charge of; keys nobody claims get the core default. Two plugins claiming one key is an
  error naming both. ``fedkit.DROP`` as a value removes the key (``upload_selection``,
  ``aggregate``, ``server_update``).
* **chain**: each plugin, in recipe order, receives the previous plugin's result and may
  return a replacement (``None`` keeps it).

``None`` returned from any hook means "nothing from this plugin". Metrics go through one
channel per side: ``ctx.log(name=value)`` on a client, ``server.log(name=value)`` on the
server. What a client reports crosses to the server, so it is typed (a number, a bool or
a string of at most 256 characters) and booked in the ledger (``up_metrics``,
``eval_metrics``); and the server checks every reply before any hook sees it (keys,
shapes, dtypes, sizes, finiteness: ``fedkit.core.reply_checks``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from fedkit.plugin.markers import hookspec

if TYPE_CHECKING:
    from torch import Tensor, nn
    from torch.optim import Optimizer

    from fedkit.config.schema import Recipe
    from fedkit.data.datasets import ImageSet
    from fedkit.plugin.adversary import Adversary
    from fedkit.plugin.context import ClientContext
    from fedkit.plugin.server import ClientInfo, Server, Upload
    from fedkit.training.loop import Objective

REGISTRY, SERVER, CLIENT, SIMULATION = "registry", "server", "client", "simulation"
SIDES = (REGISTRY, SERVER, CLIENT, SIMULATION)
KINDS = ("all", "firstresult", "claims", "chain")

F = TypeVar("F", bound=Callable[..., Any])


def spec(side: str, kind: str = "all") -> Callable[[F], F]:
    """Declare a hook: the side it runs on and how its implementations combine."""
    assert side in SIDES and kind in KINDS

    def mark(fn: F) -> F:
        fn.side, fn.kind = side, kind  # type: ignore[attr-defined]
        return hookspec(firstresult=kind == "firstresult")(fn)

    return mark


# --------------------------------------------------------------------------- registry


@spec(REGISTRY)
def register_datasets(register: Callable[..., None]) -> None:
    """Add data sets a recipe can name in ``data.dataset``.

    Called once per process on every installed plugin, before any recipe is read. Call
    ``register(name, load, needs_root=True, download=False, splits=("train", "test"))``
    once per data set. ``load(cfg, split, limit)`` gets the recipe's ``data`` section
    (``fedkit.config.schema.DataConfig``), the split name and the most images the recipe
    keeps of it (``None``: all), and returns ``fedkit.data.RawImages(images, labels,
    classes)``: uint8 images ``N×3×H×W`` or grayscale ``N×H×W``, int64 labels, class names.
    Returning more than ``limit`` is fine (fedkit keeps a class-balanced subset), and so is
    any image size (fedkit resizes to ``data.image_size``). ``needs_root``: the recipe must
    give ``data.root``; ``download``: ``data.download: true`` may fetch the files there.
    In a plugin class this hook is a ``@staticmethod`` (it runs before there are options).

    :param register: adds one data set under a name; a name two plugins register is an
        error naming both.
    :returns: nothing.
    """


@spec(REGISTRY)
def register_partitioners(register: Callable[..., None]) -> None:
    """Add partitioners a recipe can name in ``data.partition.name``.

    Called once per process on every installed plugin. Call ``register(name, fn)``;
    ``fn(labels, num_clients, rng, **params)`` splits the train labels (a numpy array)
    among the clients with the ``numpy.random.Generator`` it is given and returns
    ``fedkit.data.Partition(clients, groups=None, client_classes=None)``: sorted train
    indices per client, and the true group of each client when the partition defines
    groups (evaluation then reports how well clustered methods find them). The recipe's
    ``data.partition`` keys besides ``name`` are ``params``, checked against the
    function's keyword arguments before it runs. A ``@staticmethod`` in a plugin class.

    :param register: adds one partitioner under a name.
    :returns: nothing.
    """


@spec(REGISTRY)
def register_executors(register: Callable[..., None]) -> None:
    """Add executors a recipe can name in ``engine.executor``: where clients run.

    Called once per process on every installed plugin. Call ``register(name, factory)``;
    ``factory(setup, population, store)`` returns an object with ``run(jobs)`` and
    ``evaluate(jobs)`` (iterators of results), ``persist(folder)``, ``adopt(folder,
    files)``, ``memory(client)`` and ``close()`` (``fedkit.core.executor.Executor``). The
    executor holds the client side: each client's data and the store of what it keeps;
    nothing it keeps may travel to the server. A ``@staticmethod`` in a plugin class.

    :param register: adds one executor under a name.
    :returns: nothing.
    """


@spec(REGISTRY)
def register_stores(register: Callable[..., None]) -> None:
    """Add client stores a recipe can name in ``engine.store``: where what clients keep
    between rounds lives.

    Called once per process on every installed plugin. Call ``register(name, factory)``;
    ``factory(folder, cache)`` returns a ``fedkit.rundir.store.StateStore`` (``folder``:
    where a store that writes files keeps them, ``None`` for a run without a directory;
    ``cache``: ``engine.cache``). Stores live on the client side of an executor. A
    ``@staticmethod`` in a plugin class.

    :param register: adds one store under a name.
    :returns: nothing.
    """


# --------------------------------------------------------------------------- set-up


@spec(SERVER)
def configure(server: Server) -> None:
    """Check the recipe as a whole before anything is trained.

    Called once per run on the server, after every active plugin was constructed with
    its options and before ``init_models``; on resume, ``server.state`` and
    ``server.tensors`` already hold the checkpoint's values. Raise
    ``fedkit.errors.RecipeError`` for a setting this plugin cannot work with.

    :param server: the server (``server.recipe`` is the validated recipe); its pool is
        still empty.
    :returns: nothing.
    """


@spec(SERVER, "firstresult")
def init_models(server: Server) -> list[nn.ModuleDict] | None:
    """Build the server's initial pool of models: one per cluster.

    Called once per run on the server, after ``configure``, with the global RNGs seeded
    from the run seed. The first model is also the *template*: every client's working
    model is built from it, so it holds every part (private ones too) and its values are
    what a client starts from on its first participation. Work done once (server-side
    pre-training on ``server.own_data``, loading a warm-start encoder) goes through
    ``server.once(name, compute)``: the core keeps the result in checkpoints and hands it
    back on resume.

    :param server: the server, with ``recipe``, ``num_classes``, ``own_data`` and
        ``device`` set.
    :returns: a list of ``torch.nn.ModuleDict`` (one per cluster), or ``None`` to pass.
    """


@spec(SERVER)
def private_keys(server: Server, model: nn.ModuleDict) -> Iterable[str] | None:
    """Name the model keys that never leave a client (a target network, BN layers).

    Called once per run on the server with the template; the answers of all plugins are
    joined and sent to every client with the template. A private key is not in the pool,
    not sent down, not uploaded and not counted; each client keeps its own value across
    rounds, and its personal model uses it. ``fedkit.plugin.keys`` has helpers:
    ``under(model, parts)`` for whole parts, ``norm_keys(model)`` for normalisation
    layers.

    :param server: the server.
    :param model: the template model.
    :returns: state-dict keys of ``model``, or ``None``.
    """


@spec(SERVER)
def kept_keys(server: Server, model: nn.ModuleDict) -> Iterable[str] | None:
    """Name the shared keys a client must keep between rounds for this plugin.

    Called once per run on the server with the template. A client's store keeps only its
    private keys and the keys named here (plus its ``ctx.tensors`` and ``ctx.state``), so
    memory and checkpoints grow with what clients really keep, not with whole models. A
    plugin whose ``update_client`` takes a shared key's *local* value (a local predictor
    decided per round, a moving average of local and global) names that key here. A
    plugin that implements ``update_client`` without this hook keeps every model key, to
    be safe; one that only reads ``received`` returns ``[]``.

    :param server: the server.
    :param model: the template model.
    :returns: state-dict keys of ``model``, or ``None``.
    """


@spec(SERVER)
def auxiliary_keys(server: Server) -> Iterable[str] | None:
    """Declare which non-model keys this plugin sends are auxiliary, not data-derived.

    The ledger books every transfer in three categories: model parameters (keys of the
    template), auxiliary tensors (control variates, optimiser state: not computed from
    data features) and data-derived tensors (features, statistics, public data). A
    non-model key is data-derived unless a plugin declares it auxiliary here. The server
    accepts a declared auxiliary key of any shape; auxiliary and data-derived tensors
    together are bounded per reply (``reply_checks.EXTRA_FACTOR`` times the template).

    :param server: the server.
    :returns: ``fnmatch`` patterns of keys (``"myplugin.*"``), or ``None``.
    """


# --------------------------------------------------------------------------- server, round start


@spec(SERVER, "firstresult")
def sample_clients(server: Server, round: int) -> list[int] | None:
    """Choose the clients taking part in a round.

    Called once per round on the server. The default draws
    ``federation.clients_per_round`` clients uniformly without replacement from a
    generator seeded by (seed, round), among the clients that declared training data.
    Availability models, power-of-choice or dropout schedules answer here; draw from
    ``numpy.random.default_rng(fedkit.seeding.derive(server.recipe.seed, "my-plugin",
    round))`` so that resumed runs match.

    :param server: the server (``roster`` holds what it knows of each client).
    :param round: the round about to run (1-based).
    :returns: distinct client ids, or ``None`` to pass.
    """


@spec(SERVER, "claims")
def downlink(server: Server, client: ClientInfo) -> dict[str, Tensor] | None:
    """Send a sampled client tensors besides its cluster's state (claims).

    Called on the server per sampled client per round, before the client runs. What is
    returned reaches the client in ``ctx.received`` and is booked in the ledger (public
    data, a per-client message). Values that every client of a cluster needs belong in
    the cluster state instead (claim them in ``aggregate``).

    :param server: the server.
    :param client: what the server knows of the client (id, samples, participations).
    :returns: ``{key: tensor}``, or ``None``.
    """


# --------------------------------------------------------------------------- client


@spec(CLIENT, "chain")
def training_data(ctx: ClientContext, data: ImageSet) -> ImageSet | None:
    """Replace the images a client trains on this round (chain).

    Called on the client first in its round, in recipe order, each plugin seeing the
    previous one's result; what the last returns is ``ctx.train`` for the rest of the
    round (``select_cluster`` and training included). The client's declared sample count
    (its weight) and its test set stay as they were, and nothing is kept: the next round
    starts from the client's own data again. Poisoning by a malicious client (flipped
    labels, a backdoor trigger) and augmentation that changes the set go here.

    :param ctx: the client context (``ctx.train``: the client's own training set).
    :param data: the training set so far (an ``ImageSet``; do not change it in place).
    :returns: an ``ImageSet`` to train on instead, or ``None`` to keep it.
    """


@spec(CLIENT, "firstresult")
def select_cluster(ctx: ClientContext, model: nn.ModuleDict) -> int | None:
    """Choose which cluster model the client works on this round.

    Called on the client first in its round. ``ctx.fetch(c)`` downloads cluster ``c``'s
    state (booked once per cluster per round); ``model`` is the client's working model,
    free to load fetched states into for scoring (it is reloaded afterwards). Default
    (no plugin answers): cluster 0.

    :param ctx: the client context; ``ctx.received`` holds only ``downlink`` tensors yet.
    :param model: the working model (template architecture, on ``ctx.device``).
    :returns: a cluster index, or ``None`` to pass.
    """


@spec(CLIENT, "claims")
def update_client(
    ctx: ClientContext, received: dict[str, Tensor], local: dict[str, Tensor]
) -> dict[str, Tensor] | None:
    """Merge the state the client received with the state it kept (claims).

    Called on the client after ``select_cluster``. ``received`` is the chosen cluster's
    state plus any ``downlink`` tensors; ``local`` is the client's model state: the
    values it kept from its last round for its private keys and for the keys plugins
    declare in ``kept_keys``, the template's values for every other key (and for all of
    them on a first participation, ``ctx.participations == 0``). Unclaimed keys: received
    model keys replace local ones.

    :param ctx: the client context.
    :param received: what the server sent (do not modify in place).
    :param local: the client's kept model state.
    :returns: ``{key: tensor}`` for the keys this plugin sets, or ``None``.
    """


@spec(CLIENT, "firstresult")
def local_train(ctx: ClientContext, model: nn.ModuleDict) -> Any:
    """Train the working model with a loop of the plugin's own (instead of an objective).

    Called on the client after ``update_client``, before ``local_objective``; a plugin
    answering here (returning anything but ``None``) owns the whole loop.
    ``ctx.fit(model, objective)`` still runs the core loop (with every plugin's
    ``loss_terms`` and ``before_step``, logging ``loss``) for parts of it; report other
    numbers with ``ctx.log``. Global RNGs are seeded per (round, client) and ``ctx.rng``
    is a seeded ``torch.Generator``.

    :param ctx: the client context.
    :param model: the working model, merged state loaded, on ``ctx.device``.
    :returns: ``True`` (or any value but ``None``) once trained, or ``None`` to pass.
    """


@spec(CLIENT, "firstresult")
def local_objective(ctx: ClientContext, model: nn.ModuleDict) -> Objective | None:
    """Describe what local training minimises; the core runs the loop.

    Called on the client when no plugin answered ``local_train``, with the merged state
    loaded into ``model``. Return a ``fedkit.training.Objective`` (a loss on a batch, the
    batches, what the optimiser updates); the core's fit loop runs
    ``federation.local_epochs`` epochs with the recipe's optimiser, lets other plugins add
    ``loss_terms`` and act in ``before_step``, and logs ``loss``.
    ``fedkit.training.supervised_objective`` and ``fedkit.ssl.local.two_view_objective``
    build the common ones.

    :param ctx: the client context.
    :param model: the working model, merged state loaded, on ``ctx.device``.
    :returns: an ``Objective``, or ``None`` to pass.
    """


@spec(CLIENT, "claims")
def loss_terms(
    ctx: ClientContext, model: nn.ModuleDict, batch: Any, outputs: dict[str, Tensor]
) -> dict[str, Tensor] | None:
    """Add terms to the local loss, at every step of the core fit loop (claims).

    Called on the client per batch, after the objective's loss. Every returned term is
    added to the loss before ``backward`` and logged as ``loss_<name>`` (averaged over
    the epoch, like ``loss``); names are claimed, so two plugins cannot add the same one.
    A proximal term towards the global model, or a representation-level regulariser on
    ``outputs["features"]``, lives here.

    :param ctx: the client context (``ctx.received`` holds the global model).
    :param model: the model being trained.
    :param batch: the objective's batch (a tuple; ``batch[0]`` holds the inputs).
    :param outputs: what the objective's forward pass computed on this batch, still in
        the autograd graph: the built-in objectives give ``features`` (the encoder's
        output; for two-view objectives, of the first view) and ``logits`` (supervised)
        or ``projections`` (two-view); empty for an objective that gives none.
    :returns: ``{name: scalar tensor}``, or ``None``.
    """


@spec(CLIENT)
def before_step(ctx: ClientContext, model: nn.ModuleDict, optimizer: Optimizer) -> None:
    """Act on gradients after ``backward`` and before the optimiser step.

    Called on the client at every step of the core fit loop, in recipe order. Gradient
    corrections (control variates), clipping and noise go here; modify ``p.grad`` in place.
    (An objective's own per-step update, such as a BYOL target's moving average, is its
    ``after_step``.)

    :param ctx: the client context (``ctx.lr``: the learning rate of this step).
    :param model: the model being trained.
    :param optimizer: the optimiser about to step.
    :returns: nothing.
    """


@spec(CLIENT)
def after_local_train(ctx: ClientContext, model: nn.ModuleDict, before: dict[str, Tensor]) -> None:
    """Look at what local training changed, once it finished.

    Called on the client after the training loop. ``before`` is the state training
    started from; ``model`` holds the state after (``model.state_dict()``). Store what
    the next round needs in ``ctx.state``/``ctx.tensors``; report numbers (divergences,
    norms) with ``ctx.log``.

    :param ctx: the client context (``ctx.steps``: optimiser steps just taken).
    :param model: the trained model.
    :param before: the model state before training (detached copies).
    :returns: nothing.
    """


@spec(CLIENT, "claims")
def upload_selection(
    ctx: ClientContext, local: dict[str, Tensor], model: nn.ModuleDict
) -> dict[str, Any] | None:
    """Choose what the client sends to the server after training (claims).

    Called on the client after ``after_local_train``. Return a tensor to send it under
    that key, ``fedkit.DROP`` to withhold it. A non-model key is booked as data-derived
    unless a plugin declared it in ``auxiliary_keys``; a plugin sending data-derived keys
    sets ``uploads_data_derived = True``: ``fedkit plugins`` and ``fedkit run`` show it,
    and without it the server refuses a reply holding a data-derived key. A private key
    is always refused. Unclaimed keys: the model's shared keys are sent as they are.

    :param ctx: the client context.
    :param local: the client's model state after training (detached copies).
    :param model: the trained working model (for computing features).
    :returns: ``{key: tensor or fedkit.DROP}``, or ``None``.
    """


@spec(CLIENT, "chain")
def process_upload(ctx: ClientContext, upload: dict[str, Tensor]) -> dict[str, Tensor] | None:
    """Transform the whole upload just before it leaves the client (chain).

    Called on the client after ``upload_selection``, in recipe order, each plugin seeing
    the previous one's result. Clipping for differential privacy, compression and
    quantisation go here; the ledger counts what this returns. The server refuses a
    reply whose model keys changed shape or dtype, or that holds a non-finite value.

    :param ctx: the client context (``ctx.received`` holds what was sent down).
    :param upload: the tensors about to be sent.
    :returns: the upload to send instead, or ``None`` to keep it.
    """


# --------------------------------------------------------------------------- server, round end


@spec(SERVER, "claims")
def aggregate(server: Server, cluster: int, uploads: list[Upload]) -> dict[str, Any] | None:
    """Combine the uploads of the clients that worked on one cluster (claims).

    Called on the server per cluster per round, for clusters at least one client chose.
    Each ``Upload`` has ``client``, ``weight`` (its sample count) and ``tensors``; in
    asynchronous steps (``systems.mode: async``) also ``staleness`` (server steps since
    the model version the client started from) and ``delta`` (its upload minus that
    version), and ``server.pool`` is the current version. Return
    the keys this plugin sets with their new server values; a claimed non-model key stays
    in the cluster state and is sent down with it next round; a key claimed with
    ``fedkit.DROP`` is removed from the cluster state. Unclaimed keys: the mean weighted
    by ``weight`` (integer buffers: weighted mean rounded down).

    :param server: the server.
    :param cluster: the cluster index.
    :param uploads: what each client of the cluster sent, in client-id order.
    :returns: ``{key: tensor or fedkit.DROP}``, or ``None``.
    """


@spec(SERVER, "claims")
def server_update(
    server: Server, cluster: int, previous: dict[str, Tensor], aggregated: dict[str, Tensor]
) -> dict[str, Tensor] | None:
    """Turn the aggregate into the cluster's next state (claims; server optimisers).

    Called on the server per aggregated cluster, after ``aggregate``. ``previous`` is the
    cluster state the round started from, ``aggregated`` the result of aggregation.
    Unclaimed keys take the aggregated value; ``fedkit.DROP`` removes a key. Server
    momentum or Adam treat ``previous − aggregated`` as a pseudo-gradient here; keep
    optimiser state in ``server.tensors``.

    :param server: the server.
    :param cluster: the cluster index.
    :param previous: the cluster state before this round.
    :param aggregated: the state ``aggregate`` produced.
    :returns: ``{key: tensor}``, or ``None``.
    """


@spec(SERVER)
def round_end(server: Server) -> None:
    """Run server-side logic after aggregation (logging, schedules, restarts).

    Called once per round on the server, after every cluster was updated and before
    evaluation. ``server.log(name=value)`` adds entries to this round's metrics row
    (JSON values; deterministic, so that resumed runs match); ``server.sampled`` are the
    round's clients.

    :param server: the server, pool updated.
    :returns: nothing.
    """


# --------------------------------------------------------------------------- evaluation


@spec(CLIENT, "firstresult")
def personal_model(ctx: ClientContext, model: nn.ModuleDict) -> nn.Module | None:
    """Supply the model a client is evaluated with, when it is not the default one.

    Called on the client on evaluation rounds (``evaluation.every``, ``evaluation.clients``)
    with ``model`` holding the client's default personal model: its cluster's current
    state with its own values of the private keys. A plugin that keeps a whole personal
    model of its own (a personal model in ``ctx.tensors``, a fine-tuned copy) returns it
    here, or loads it into ``model`` and returns ``model``. The core's protocol and every
    ``evaluate_client`` then score what is returned. Nothing of it leaves the client but
    the scores.

    :param ctx: the client context (``ctx.round``: the round just finished;
        ``ctx.received``: the cluster state of this evaluation).
    :param model: the default personal model, on ``ctx.device``, in eval mode.
    :returns: a module with the parts the recipe's protocol reads (``encoder``, and
        ``classifier`` for supervised evaluation), or ``None`` to keep the default.
    """


@spec(CLIENT)
def evaluate_client(ctx: ClientContext, model: nn.ModuleDict) -> None:
    """Score a client's personal model on the client's own data.

    Called on the client on evaluation rounds, after the core's protocol scored the
    personal model (supervised: accuracy on ``ctx.test``). Report scores with
    ``ctx.log(name=value)``: the round's metrics get ``personalized_<name>`` (the mean
    over evaluated clients) and ``client_<name>`` (each client's value). A score is a
    number, a bool or a short string, booked in the ledger as ``eval_metrics``.

    :param ctx: the client context.
    :param model: the personal model (``personal_model``'s answer or the default), in
        eval mode under ``torch.no_grad()``.
    :returns: nothing.
    """


@spec(SERVER)
def evaluate(server: Server, round: int) -> None:
    """Add server-side evaluation metrics for this round.

    Called on the server every ``evaluation.every`` rounds and after the last one, after
    the core's protocol and the clients' evaluation ran. Score what the server holds (its
    pool, on ``server.own_data``) and report with ``server.log``; a client's data is
    scored on the client, in ``evaluate_client``.

    :param server: the server.
    :param round: the round just finished (1-based).
    :returns: nothing.
    """


@spec(SERVER)
def round_logged(server: Server, metrics: dict[str, Any]) -> None:
    """Observe a round's complete metrics row (logging to TensorBoard, a database, ...).

    Called once per round on the server, after evaluation, with the row as it is written
    to the run's logs (per-client values included). For observers: do not change
    ``metrics`` or the run here; logic belongs in ``round_end``.

    :param server: the server.
    :param metrics: the round's complete metrics row (read-only by convention).
    :returns: nothing.
    """


# --------------------------------------------------------------------------- simulation


@spec(SIMULATION, "firstresult")
def malicious_clients(recipe: Recipe) -> Iterable[int] | None:
    """Say which clients an attack controls: the simulation's truth.

    Called once per run by the engine, when the run is prepared (and again on resume: the
    answer must follow from the recipe alone, the plugin's options and seed included).
    The answer is kept with the evaluator, on the simulation side: it is handed to
    simulation hooks (``adversary.malicious``) and used to score detection (a defence's
    ``flagged`` against it), and no server-side hook receives it. The plugin's client-side
    instance decides the same set from the same recipe to act on its own clients. One
    attack per run (two plugins answering this hook are refused). Refused with the Flower
    deployment, where no party knows the truth.

    :param recipe: the validated recipe.
    :returns: client ids, or ``None`` to pass.
    """


@spec(SIMULATION, "chain")
def attack_uploads(
    adversary: Adversary, cluster: int, uploads: list[Upload]
) -> list[Upload] | None:
    """Replace the malicious clients' uploads with crafted ones (chain).

    Called per cluster per round, after every reply was checked and booked and before any
    server-side hook sees it (``aggregate`` receives what this returns). ``uploads`` are
    the cluster's uploads in client-id order (client states, as ``aggregate`` gets them;
    an update is an upload minus ``adversary.pool[cluster]``). Attacks that need more than
    one client's update (the colluding clients' honest updates, the benign updates, as
    the attack's threat model allows) craft them here; what one client can do alone
    belongs in its client-side hooks. Replace only uploads of ``adversary.malicious``
    clients, with the same keys, shapes and dtypes.

    :param adversary: the simulation's adversary view (``malicious``: the truth).
    :param cluster: the cluster index.
    :param uploads: the cluster's uploads so far.
    :returns: the uploads to aggregate instead, or ``None`` to keep them.
    """


@spec(SIMULATION)
def attack_evaluate(adversary: Adversary, round: int) -> None:
    """Measure an attack's success on what only the simulation holds.

    Called on evaluation rounds (``evaluation.every`` and the last), after the
    evaluator scored the global model and before ``evaluate``: ``adversary.test`` is the
    global test set, ``adversary.model(c)`` cluster ``c``'s model. Report with
    ``adversary.log(name=value)`` (a backdoor's attack success rate, say): the row gets
    it, as it gets the evaluator's scores.

    :param adversary: the simulation's adversary view.
    :param round: the round just finished (1-based).
    :returns: nothing.
    """
