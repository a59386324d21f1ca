"""Recipe schema: YAML validated into typed config before anything runs.

Every section forbids unknown keys, so a misspelt key is an error (with a did-you-mean)
rather than a silently ignored setting. ``--set a.b=c`` overrides are applied to the raw
mapping before validation, so they are checked exactly like the file's own values.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from fedkit.errors import RecipeError, unknown_hint


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BackboneConfig(Section):
    """A timm model used as the encoder (built with ``num_classes=0``)."""

    name: str = "test_resnet"
    kwargs: dict[str, Any] = Field(default_factory=dict)
    cifar_stem: bool = False
    pretrained: bool = False


class PartitionConfig(Section):
    """A partitioner by name and its parameters (e.g. ``{name: dirichlet, alpha: 0.5}``)."""

    model_config = ConfigDict(extra="allow")
    name: str = "iid"

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class DataConfig(Section):
    dataset: str = "digits"
    root: str | None = None
    download: bool = False
    image_size: int = Field(32, gt=0)
    partition: PartitionConfig = Field(default_factory=PartitionConfig)
    num_clients: int = Field(10, gt=0)
    server_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    local_test_size: int = Field(100, gt=0)
    max_train: int | None = Field(None, gt=0)
    max_test: int | None = Field(None, gt=0)
    standardize: bool = True

    @field_validator("partition", mode="before")
    @classmethod
    def _partition_from_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value


class OptimizerConfig(Section):
    name: Literal["sgd", "adam", "adamw"] = "sgd"
    lr: float = Field(0.05, gt=0)
    momentum: float = Field(0.9, ge=0)
    weight_decay: float = Field(0.0, ge=0)


class ScheduleConfig(Section):
    """Learning rate across rounds: constant, or cosine decay per round (constant within)."""

    name: Literal["constant", "cosine"] = "constant"


class FederationConfig(Section):
    rounds: int = Field(5, gt=0)
    clients_per_round: int = Field(10, gt=0)
    local_epochs: int = Field(1, gt=0)
    batch_size: int = Field(32, gt=0)
    drop_last: bool = False
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    lr_schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    min_clients: int = Field(1, gt=0)
    client_timeout: float | None = Field(None, gt=0)

    @field_validator("lr_schedule", mode="before")
    @classmethod
    def _schedule_from_name(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _reachable_quorum(self) -> FederationConfig:
        if self.min_clients > self.clients_per_round:
            raise ValueError(
                f"min_clients ({self.min_clients}) at most clients_per_round "
                f"({self.clients_per_round}): a round never has more clients than it samples"
            )
        return self


class PluginSpec(Section):
    """One active plugin and its options (the plugin validates the options itself)."""

    name: str
    options: dict[str, Any] = Field(default_factory=dict)


class EvaluationConfig(Section):
    """Which protocol scores the model, how often (0: only after the last round) and on
    which clients.

    ``clients``: the clients that evaluate their personal model on their own data each
    evaluation round, ``all`` or a number drawn per round (seeded). ``personal``: with a
    representation protocol (knn, linear, semi), also score every trained client's own
    encoder (its cluster's state with its private keys), on the client.
    ``monitor_every``: with a representation protocol, also score the global encoder with
    the cheap kNN monitor every that many rounds (0: never), for a learning curve when the
    protocol itself runs only at the end.
    """

    protocol: Literal["supervised", "knn", "linear", "semi", "none"] = "supervised"
    every: int = Field(1, ge=0)
    monitor_every: int = Field(0, ge=0)
    clients: Literal["all"] | int = "all"
    personal: bool = False
    knn_k: int = Field(200, gt=0)
    knn_temperature: float = Field(0.1, gt=0)
    linear_epochs: int = Field(200, gt=0)
    linear_lr: float = Field(3e-3, gt=0)
    semi_fractions: list[float] = Field(default_factory=lambda: [0.01, 0.1])
    semi_epochs: int = Field(100, gt=0)
    semi_lr: float = Field(1e-3, gt=0)
    max_eval: int | None = Field(None, gt=0)

    @field_validator("clients")
    @classmethod
    def _clients(cls, value: str | int) -> str | int:
        if isinstance(value, int) and value < 1:
            raise ValueError("all, or a number of clients of at least 1")
        return value

    @model_validator(mode="after")
    def _monitor(self) -> EvaluationConfig:
        if self.monitor_every and self.protocol in ("supervised", "none"):
            raise ValueError(
                "monitor_every > 0 only with a representation protocol (knn, linear, semi): "
                f"the kNN monitor scores an encoder, and protocol is {self.protocol}"
            )
        return self

    @field_validator("semi_fractions")
    @classmethod
    def _fractions(cls, value: list[float]) -> list[float]:
        if not value or any(not 0.0 < f <= 1.0 for f in value):
            raise ValueError("a non-empty list of label fractions in (0, 1]")
        return value


class SecureAggregationConfig(Section):
    """Secure aggregation with Flower's SecAgg+ (``flower`` executor only; decision 0023):
    the server learns only the weighted mean of each round's uploads. ``true`` turns it
    on with Flower's defaults. ``num_shares``: how many neighbours hold a share of each
    client's secrets (an int > 2, or a fraction of the round's clients);
    ``reconstruction_threshold``: how many shares rebuild one (an int, or a fraction of
    ``num_shares``); ``clipping_range``: each entry of a client's change is clipped to
    ±this before quantisation; ``quantization_range``: the integer levels it is rounded
    onto."""

    enabled: bool = False
    num_shares: int | float = Field(1.0, gt=0)
    reconstruction_threshold: int | float = Field(0.5, gt=0)
    clipping_range: float = Field(8.0, gt=0)
    quantization_range: int = Field(2**22, gt=1, lt=2**32)

    @model_validator(mode="before")
    @classmethod
    def _on_when_given(cls, value: Any) -> Any:
        if isinstance(value, bool):
            return {"enabled": value}
        if isinstance(value, dict) and value and "enabled" not in value:
            return {**value, "enabled": True}
        return value


class EngineConfig(Section):
    """Where clients run and where what they keep lives.

    ``executor``: a registered executor (``fedkit plugins`` lists them): ``sequential``
    (one after another, in this process), ``isolated`` (each job as a fresh worker process
    would run it: plugins rebuilt from the recipe, everything that crosses pickled; for
    checking plugins), ``ray`` (long-lived actors on a Ray cluster; the ``ray`` extra) or
    ``flower`` (each client a Flower node: Flower's simulation runtime, or a deployment
    started with ``fedkit deploy``; the ``flower`` extra). ``workers``, ``num_cpus``,
    ``num_gpus``, ``address``: Ray's actor count (Flower's simulation: its actors),
    resources per actor and the cluster to join (``HOST:PORT``, ``ray://host:port``, or
    ``auto``: Ray's pick, ``RAY_ADDRESS`` first); none: a Ray of the run's own, even
    beside another cluster on the machine. ``num_cpus`` is also torch's thread count for
    every client's work under every executor, so a recipe's numbers do not depend on
    where it runs.
    ``store``: a registered client store, ``memory`` or ``disk``, or ``auto`` (disk when
    the clients' kept state would pass ``memory_budget_mb``); ``cache``: client memories
    a disk store keeps in memory.
    """

    executor: str = "sequential"
    checkpoint_every: int = Field(1, ge=1)
    workers: int | None = Field(None, gt=0)
    num_cpus: float = Field(1.0, gt=0)
    num_gpus: float = Field(0.0, ge=0)
    address: str | None = None
    store: str = "auto"
    memory_budget_mb: float = Field(1024.0, gt=0)
    cache: int = Field(64, gt=0)
    keep_checkpoints: int = Field(2, ge=1)
    secure_aggregation: SecureAggregationConfig = Field(default_factory=SecureAggregationConfig)

    @field_validator("secure_aggregation")
    @classmethod
    def _secure_aggregation_on_flower(cls, value: SecureAggregationConfig, info: Any) -> Any:
        executor = info.data.get("executor")
        if value.enabled and executor != "flower":
            raise ValueError(
                "the flower executor (Flower's SecAgg+ runs between Flower nodes; "
                f"engine.executor is {executor!r})"
            )
        return value


class FaultConfig(Section):
    """Injected client faults (testing only): per sampled client and round, the probability
    of each fault (they must sum to at most 1); ``delay``: a straggler's extra seconds."""

    exception: float = Field(0.0, ge=0, le=1)
    dropout: float = Field(0.0, ge=0, le=1)
    nan: float = Field(0.0, ge=0, le=1)
    straggler: float = Field(0.0, ge=0, le=1)
    crash: float = Field(0.0, ge=0, le=1)
    delay: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _at_most_one(self) -> FaultConfig:
        total = self.exception + self.dropout + self.nan + self.straggler + self.crash
        if total > 1:
            raise ValueError(f"fault probabilities summing to at most 1, found {total:g}")
        return self


class SpeedConfig(Section):
    """Clients' compute speed in training samples per second, drawn per client from a
    lognormal with this ``median`` and ``sigma`` (0: every client alike; 1: about a
    tenfold spread between the slowest and fastest tenth)."""

    median: float = Field(100.0, gt=0)
    sigma: float = Field(0.0, ge=0)


class LinkConfig(Section):
    """Clients' links: download and upload bandwidth in megabits per second (lognormal
    per client with these medians and ``sigma``) and a fixed ``latency`` in seconds per job."""

    down_mbps: float = Field(20.0, gt=0)
    up_mbps: float = Field(5.0, gt=0)
    sigma: float = Field(0.0, ge=0)
    latency: float = Field(0.0, ge=0)


class AvailabilityConfig(Section):
    """When clients are reachable. ``always``; ``diurnal``: each client is reachable for
    the fraction ``online`` of every ``period`` seconds, from a phase drawn per client;
    ``trace``: the windows listed in the file ``trace`` (repeating every ``period``
    seconds). ``wait``: the virtual seconds the server waits before sampling again when
    no client is reachable."""

    model: Literal["always", "diurnal", "trace"] = "always"
    period: float = Field(86400.0, gt=0)
    online: float = Field(0.5, gt=0, le=1)
    trace: str | None = None
    wait: float = Field(600.0, gt=0)

    @model_validator(mode="after")
    def _trace_file(self) -> AvailabilityConfig:
        if (self.model == "trace") != (self.trace is not None):
            raise ValueError(
                "a trace file exactly when model is trace "
                f"(model is {self.model}, trace is {self.trace!r})"
            )
        return self


class SystemsConfig(Section):
    """The virtual clock (docs/systems.md): clients' speeds and links (drawn, or read from
    the ``devices`` file), their availability, a round's ``deadline`` in virtual seconds
    and the ``over_selection`` factor (sample ceil(k × factor), keep the first k to
    finish). Off by default; a ``systems:`` section with any key turns it on unless it
    says ``enabled: false``."""

    enabled: bool = False
    speed: SpeedConfig = Field(default_factory=SpeedConfig)
    link: LinkConfig = Field(default_factory=LinkConfig)
    devices: str | None = None
    availability: AvailabilityConfig = Field(default_factory=AvailabilityConfig)
    deadline: float | None = Field(None, gt=0)
    over_selection: float = Field(1.0, ge=1)
    mode: Literal["sync", "async"] = "sync"
    concurrency: int | None = Field(None, ge=1)
    """``async``: clients training at once (default ``clients_per_round``); a server step
    aggregates the ``clients_per_round`` earliest to finish (docs/systems.md)."""

    @model_validator(mode="after")
    def _async_keys(self) -> SystemsConfig:
        if self.mode == "sync" and self.concurrency is not None:
            raise ValueError("concurrency only with mode: async")
        if self.mode == "async" and not self.enabled:
            raise ValueError("enabled: true with mode: async (it runs on the virtual clock)")
        if self.mode == "async" and self.over_selection != 1:
            raise ValueError("over_selection 1 with mode: async (it always keeps every job)")
        return self

    @model_validator(mode="before")
    @classmethod
    def _on_when_given(cls, value: Any) -> Any:
        if isinstance(value, dict) and value and "enabled" not in value:
            return {**value, "enabled": True}
        return value


class Recipe(Section):
    """A complete, validated run description."""

    description: str = ""
    seed: int = Field(0, ge=0)
    backbone: BackboneConfig = Field(default_factory=BackboneConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    federation: FederationConfig = Field(default_factory=FederationConfig)
    plugins: list[PluginSpec] = Field(default_factory=list)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    faults: FaultConfig = Field(default_factory=FaultConfig)
    systems: SystemsConfig = Field(default_factory=SystemsConfig)
    device: Literal["auto", "cpu", "cuda"] = "auto"
    precision: Literal["fp32", "bf16"] = "fp32"
    channels_last: bool = False

    @field_validator("plugins", mode="before")
    @classmethod
    def _plugin_shorthand(cls, value: Any) -> Any:
        """Accept ``- name`` and ``- name: {option: value}`` as well as ``{name, options}``."""
        if not isinstance(value, list):
            return value
        specs = []
        for item in value:
            if isinstance(item, str):
                specs.append({"name": item})
            elif isinstance(item, dict) and len(item) == 1 and "name" not in item:
                ((name, options),) = item.items()
                specs.append({"name": name, "options": options or {}})
            else:
                specs.append(item)
        return specs

    @model_validator(mode="after")
    def _quorum_within_the_population(self) -> Recipe:
        needed, clients = self.federation.min_clients, self.data.num_clients
        if needed > clients:
            raise ValueError(
                f"federation.min_clients ({needed}) at most data.num_clients ({clients}): "
                "a round cannot have more clients than the federation"
            )
        return self

    @model_validator(mode="after")
    def _async_in_simulation(self) -> Recipe:
        if self.systems.mode == "async" and self.engine.executor == "flower":
            raise ValueError(
                "systems.mode: async with a simulation executor (sequential, isolated, ray): "
                "it holds jobs across steps, which the Flower executor cannot"
            )
        return self

    @model_validator(mode="after")
    def _clock_without_secure_sums(self) -> Recipe:
        if self.systems.enabled and self.engine.secure_aggregation.enabled:
            raise ValueError(
                "engine.secure_aggregation: false with the virtual clock (systems): the clock "
                "drops clients (deadline, over-selection, availability) after SecAgg+ "
                "has summed their vectors, which the sum cannot take back"
            )
        return self


def _section_fields(path: tuple[Any, ...]) -> list[str]:
    """The field names allowed at a location, for did-you-mean on unknown keys."""
    model: Any = Recipe
    for part in path:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        model = field.annotation
    return list(getattr(model, "model_fields", {}))


def expected_from(message: str) -> str:
    """A pydantic error message turned into the "expected ..." part of a ``RecipeError``."""
    return re.sub(r"^(Input should be|Value error,) ", "", message)


def _translate(error: ValidationError, file: str | None) -> RecipeError:
    first = error.errors()[0]
    loc = tuple(p for p in first["loc"] if not (isinstance(p, str) and "[" in p))
    key = ".".join(str(p) for p in loc) or "(top level)"
    found = first.get("input")
    if first["type"] == "extra_forbidden":
        allowed = _section_fields(loc[:-1])
        hint = unknown_hint(str(loc[-1]), allowed)
        return RecipeError(key, "one of " + ", ".join(allowed), file=file, hint=hint)
    expected = expected_from(first["msg"])
    if not loc:  # a check across sections: its message names the key; the input is the recipe
        named = re.match(r"([a-z_]+(?:\.[a-z_]+)+): (.*)$", expected, re.DOTALL)
        key, expected = (named.group(1), named.group(2)) if named else (key, expected)
        return RecipeError(key, expected, file=file)
    return RecipeError(key, expected, found, file=file)


def parse_value(text: str, item: str | None = None, file: str | None = None) -> Any:
    """Parse one ``--set`` value with YAML rules (numbers, booleans, lists, null)."""
    if not text.strip():
        return ""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = str(exc).splitlines()[0]
        raise RecipeError(
            "--set",
            f"a YAML value after '=' ({problem}; quote text with special characters)",
            item or text,
            file=file,
        ) from None


def apply_overrides(raw: dict[str, Any], overrides: list[str], file: str | None = None) -> None:
    """Apply ``a.b=c`` overrides in place; list items are addressed by index (``plugins.0``)."""
    for item in overrides:
        if "=" not in item:
            raise RecipeError("--set", "KEY=VALUE", item, file=file)
        path, value = item.split("=", 1)
        keys = path.strip().split(".")
        node: Any = raw
        for depth, key in enumerate(keys[:-1]):
            if isinstance(node, list):
                node = node[_index(key, node, ".".join(keys[: depth + 1]), file)]
            else:
                node = node.setdefault(key, {})
            if not isinstance(node, (dict, list)):
                where = ".".join(keys[: depth + 1])
                raise RecipeError(where, "a section to set keys in", node, file=file)
        last = keys[-1]
        parsed = parse_value(value, item, file)
        if isinstance(node, list):
            node[_index(last, node, path, file)] = parsed
        else:
            node[last] = parsed


def _index(key: str, node: list, path: str, file: str | None) -> int:
    if not key.isdigit() or int(key) >= len(node):
        raise RecipeError(path, f"a list index below {len(node)}", key, file=file)
    return int(key)


def load_raw(path: str | Path) -> dict[str, Any]:
    """Read a recipe file into a mapping, with clear errors for empty or non-YAML files."""
    path = Path(path)
    file = str(path)
    if not path.is_file():
        raise RecipeError("(file)", "an existing recipe file", file)
    try:
        raw = yaml.safe_load(path.read_text())
    except UnicodeDecodeError:
        raise RecipeError("(file)", "a text (YAML) file", "binary data", file=file) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = str(exc).splitlines()[0]
        raise RecipeError("(file)", f"valid YAML{where}", problem, file=file) from None
    if raw is None:
        raise RecipeError("(top level)", "a mapping of recipe sections", "an empty file", file=file)
    if not isinstance(raw, dict):
        raise RecipeError("(top level)", "a mapping of recipe sections", raw, file=file)
    return raw


def validate(raw: dict[str, Any], file: str | None = None) -> Recipe:
    """Validate a raw mapping into a ``Recipe``; errors are ``RecipeError``s."""
    try:
        return Recipe.model_validate(raw)
    except ValidationError as exc:
        raise _translate(exc, file) from None


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Load, override and validate a recipe file (schema only; see ``fedkit.core.preflight``)."""
    return overridden(load_raw(path), overrides or [], str(path))


def overridden(raw: dict[str, Any], overrides: list[str], file: str | None = None) -> Recipe:
    """A raw recipe with ``--set`` overrides, validated. The overrides are noted at the end
    of its ``description``, which then still says what the run is (the run directory's
    ``recipe.yaml`` keeps it)."""
    apply_overrides(raw, overrides, file=file)
    recipe = validate(raw, file=file)
    noted = [o.strip() for o in overrides if o.partition("=")[0].strip() != "description"]
    if noted and recipe.description:
        text = f"{recipe.description} [--set {'; '.join(noted)}]"
        recipe = recipe.model_copy(update={"description": text})
    return recipe


def dump_recipe(recipe: Recipe) -> str:
    """The resolved recipe as YAML (what the run directory keeps)."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
