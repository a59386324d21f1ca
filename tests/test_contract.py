"""The plugin contract v2: client-side hooks see only a client context, the two sides share
nothing through ``self`` (an isolated executor, which rebuilds plugins per job and
pickles everything that crosses, gives bit-identical runs), and the core's extension
points: options, wrappers, sampling, ledger categories, client metrics, kept results."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    COMBOS,
    clustered_recipe,
    fedca_recipe,
    prepared,
    tiny_recipe,
    with_logdir,
)
from pydantic import BaseModel

from fedkit import PluginOptions, hookimpl
from fedkit.config.schema import validate
from fedkit.core import runs
from fedkit.core.engine import prepare, run_round
from fedkit.errors import RecipeError
from fedkit.plugin.context import ClientContext
from fedkit.plugin.entrypoints import discover
from fedkit.plugin.hookspecs import CLIENT
from fedkit.plugin.ledger import Ledger
from fedkit.plugin.registry import hook_names, hook_side, implemented_hooks, loaded_plugins
from fedkit.plugin.server import Server
from fedkit.rundir.store import StateStore

ROOT = Path(__file__).resolve().parent.parent
SERVER_SIDE = ("server", "pool", "ledger", "store", "clients", "roster", "executor", "data")


def server_objects(value: Any, depth: int = 0) -> list[Any]:
    """Server-side objects reachable from ``value`` through containers and attributes."""
    if isinstance(value, (Server, Ledger)) or type(value).__name__ in ("Run", "MemoryStore"):
        return [value]
    if depth > 3 or isinstance(value, (torch.Tensor, str, bytes, int, float)):
        return []
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    else:
        items = list(getattr(value, "__dict__", {}).values())
    return [o for item in items for o in server_objects(item, depth + 1)]


class ContextCheck:
    """Checks every client-side hook call: a ``ClientContext``, nothing server-side
    reachable, attribute access beyond the client's own raises, nothing can be added."""

    def __init__(self) -> None:
        self.called: set[tuple[str, str]] = set()

    def before(self, hook: str, names: list[str], kwargs: dict) -> None:
        if hook_side(hook) != CLIENT:
            return
        ctx = kwargs["ctx"]
        assert type(ctx) is ClientContext, hook
        for name in SERVER_SIDE:
            with pytest.raises(AttributeError, match="client-side hook sees only"):
                getattr(ctx, name)
        with pytest.raises(AttributeError):
            ctx.stash = 1  # no side channel on the context
        slots = [getattr(ctx, s) for s in ClientContext.__slots__]
        assert server_objects(slots) == [] and server_objects(list(kwargs.values())) == []
        self.called.update((name, hook) for name in names)


def rows_state(run, rounds: int = 2):
    rows = [run_round(run, r) for r in range(1, rounds + 1)]
    # a client's exception (a failed check inside a hook too) is recorded, not raised
    assert [row.get("failures") for row in rows] == [None] * rounds
    memories = {c: m for c, m in run.executor.store.items()}
    return rows, run.server.pool, memories


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("combo", list(COMBOS))
def test_client_hooks_see_only_a_client_context_and_sides_share_nothing(combo, tmp_path):
    raw = with_logdir(COMBOS[combo], tmp_path)
    run = prepared(raw)
    check = ContextCheck()
    run.executor.worker.plugins.observe(check.before)
    rows, pool, memories = rows_state(run)
    for name, plugin in run.executor.worker.plugins.objects.items():
        client_hooks = {h for h in implemented_hooks(plugin) if hook_side(h) == CLIENT}
        assert client_hooks <= {h for n, h in check.called if n == name}, name
    isolated = prepared({**raw, "engine": {"executor": "isolated"}})
    rows2, pool2, memories2 = rows_state(isolated)
    assert rows2 == rows
    assert all(same_tensors(a, b) for a, b in zip(pool, pool2, strict=True))
    assert memories.keys() == memories2.keys()
    for cid, m in memories.items():
        assert same_tensors(m.model, memories2[cid].model)
        assert same_tensors(m.tensors, memories2[cid].tensors)
        assert m.state == memories2[cid].state


def test_every_built_in_plugin_is_exercised_by_the_context_check():
    names = {spec.name for raw in COMBOS.values() for spec in validate(raw).plugins}
    installed = set(
        re.findall(r"^(\w+) = \"fedkit_plugins", (ROOT / "pyproject.toml").read_text(), re.M)
    )
    registering = {"datasets", "partitioners", "executors", "stores"}  # used by every run
    # attacks: backdoor's combo has every client hook any attack implements (training_data,
    # process_upload); each attack's own arithmetic is tests/test_attacks.py's
    attacks = {"label_flip", "sign_flip", "gaussian_noise", "alie", "ipm", "min_max", "min_sum"}
    # asynchronous aggregation: server-side aggregate only (no client hook to check); its
    # runs, composed with fedprox, are tests/test_async.py's
    asynchronous = {"fedasync", "fedbuff"}
    # defences: server-side hooks only (configure, aggregate), checked just below, so the
    # context check has nothing of theirs to watch; their arithmetic and runs (with IFCA's
    # clusters, a server split) are tests/test_defences.py's, one against an attack the
    # robustness tutorial's (tests/test_tutorials_contract.py)
    defences = {"median", "trimmed_mean", "krum", "bulyan", "rfa", "bucketing", "fltrust", "flame"}
    classes = loaded_plugins({k: v for k, v in discover().items() if k in defences})
    assert classes.keys() == defences
    assert {
        n: h for n, c in classes.items() for h in implemented_hooks(c) if hook_side(h) == CLIENT
    } == {}
    assert installed and installed - registering - attacks - asynchronous - defences <= names


def test_the_server_never_travels():
    import pickle

    run = prepared(tiny_recipe())
    with pytest.raises(TypeError, match="never travels"):
        pickle.dumps(run.server)


def test_plugins_never_write_files_themselves():
    """mlflow_tracking opens MLflow's own SQLite file before round 1 to find out whether
    MLflow could write it (tests/test_tracking_faults.py), and writes nothing itself."""
    writers = re.compile(r"write_safetensors|write_text|write_bytes|\bopen\(|server\.out|atomic")
    probes = {"mlflow_tracking.py": 1}
    offenders = [
        p.name
        for p in (ROOT / "plugins").glob("*.py")
        if len(writers.findall(p.read_text())) > probes.get(p.name, 0)
    ]
    assert offenders == []


# ------------------------------------------------------------------ options and wrappers


class PlainOptions:
    """Options as a plain pydantic model, without extra="forbid"."""

    class Options(BaseModel):
        factor: float = 0.5

    def __init__(self, options):
        self.options = options


class CoreOptions:
    class Options(PluginOptions):
        factor: float = 0.5

    def __init__(self, options):
        self.options = options


@pytest.mark.parametrize("plugin", [PlainOptions, CoreOptions])
def test_a_misspelt_option_is_an_error_whatever_the_options_base(plugin):
    raw = tiny_recipe(plugins=["fedavg", {"shrink": {"factr": 0.2}}])
    with pytest.raises(RecipeError, match=r"plugins\.1\.shrink\.factr.*did you mean \"factor\""):
        prepared(raw, shrink=plugin)
    run = prepared(tiny_recipe(plugins=["fedavg", {"shrink": {"factor": 0.2}}]), shrink=plugin)
    assert run.plugins.objects["shrink"].options.factor == 0.2


class WrapsClaims:
    calls = 0

    @hookimpl(wrapper=True)
    def aggregate(self, server, cluster, uploads):
        WrapsClaims.calls += 1
        return (yield)


def test_a_wrapper_on_a_claims_hook_runs_around_it():
    WrapsClaims.calls = 0
    run = prepared(tiny_recipe(plugins=["fedavg", "wrap"]), wrap=WrapsClaims())
    run_round(run, 1)
    assert WrapsClaims.calls == 1


# ------------------------------------------------------------------ sampling, ledger, metrics


class EveryOther:
    """Samples clients 0 and 2 in odd rounds, client 1 in even ones."""

    @hookimpl
    def sample_clients(self, server, round):
        return [0, 2] if round % 2 else [1]


def test_the_sampling_hook_decides_who_trains():
    run = prepared(tiny_recipe(plugins=["fedavg", "sampler"]), sampler=EveryOther())
    rows = [run_round(run, r) for r in (1, 2)]
    assert rows[0]["clients"] == [0, 2] and rows[1]["clients"] == [1]
    assert set(rows[0]["per_client"]) == {"0", "2"}
    sent_jobs = {key for key, row in run.server.ledger.rows.items() if row["down_model"]}
    assert sent_jobs == {(1, 0), (1, 2), (2, 1)}  # every client also evaluates (eval_*)
    assert [info.participations for info in run.server.roster] == [1, 1, 1]


class BadSampler:
    @hookimpl
    def sample_clients(self, server, round):
        return [0, 0, 7]


def test_a_bad_sample_is_a_clear_error():
    run = prepared(tiny_recipe(plugins=["fedavg", "bad"]), bad=BadSampler())
    with pytest.raises(RecipeError, match="sample_clients"):
        run_round(run, 1)


class Extras:
    """Uploads an auxiliary and a data-derived tensor and logs a value per client."""

    uploads_data_derived = True  # the server refuses an undeclared data-derived key

    @hookimpl
    def auxiliary_keys(self, server):
        return ["extra.aux*"]

    @hookimpl
    def upload_selection(self, ctx, local, model):
        ctx.log(client_id=ctx.id, odd=ctx.id % 2 == 1, note=f"client {ctx.id}")
        return {"extra.aux_state": torch.zeros(5), "extra.features": torch.zeros(3)}


def test_ledger_categories_and_client_metrics():
    run = prepared(tiny_recipe(plugins=["fedavg", "extras"]), extras=Extras())
    row = run_round(run, 1)
    sizes = {c.id: c.num_samples for c in run.server.roster}
    assert row["bytes"]["up_aux"] == 3 * 5 * 4 and row["bytes"]["up_data"] == 3 * 3 * 4
    assert row["bytes"]["down_aux"] == 0  # round 1: nothing aggregated yet
    expected = sum(c * n for c, n in sizes.items()) / sum(sizes.values())
    assert row["train_client_id"] == pytest.approx(expected)
    assert row["train_odd"] == pytest.approx(sizes[1] / sum(sizes.values()))
    assert "train_note" not in row and row["per_client"]["2"]["note"] == "client 2"
    losses = [row["per_client"][str(c)]["loss"] for c in sizes]
    assert row["train_loss"] == pytest.approx(
        sum(v * sizes[c] for c, v in zip(sizes, losses, strict=True)) / sum(sizes.values())
    )
    row2 = run_round(run, 2)  # the cluster state now holds both: sent down, by category
    assert row2["bytes"]["down_aux"] == 3 * 5 * 4 and row2["bytes"]["down_data"] == 3 * 3 * 4


class OwnLoop:
    """A whole loop of its own (trains nothing) that reports an extra number."""

    @hookimpl
    def local_train(self, ctx, model):
        ctx.log(loss=1.0, extra=float(ctx.id))
        return True


def test_every_number_a_loop_of_its_own_logs_reaches_the_metrics_row():
    run = prepared(tiny_recipe(plugins=["loop", "fedavg"]), loop=OwnLoop())
    row = run_round(run, 1)
    sizes = {c.id: c.num_samples for c in run.server.roster}
    assert row["train_loss"] == 1.0
    assert row["train_extra"] == pytest.approx(
        sum(c * n for c, n in sizes.items()) / sum(sizes.values())
    )
    assert {cid: v["extra"] for cid, v in row["per_client"].items()} == {
        "0": 0.0,
        "1": 1.0,
        "2": 2.0,
    }


# ------------------------------------------------------------------ results kept by the core


def test_once_computes_a_single_time_and_leaves_the_rngs_alone():
    run = prepared(tiny_recipe())
    calls = []

    def compute():
        calls.append(1)
        torch.rand(100)
        return {"w": torch.ones(2)}

    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    first = run.server.once("thing", compute)
    assert torch.equal(torch.rand(3), expected)  # compute's draws did not move the stream
    second = run.server.once("thing", compute)
    assert calls == [1] and torch.equal(first["w"], second["w"])
    assert torch.equal(run.server.tensors["thing/w"], torch.ones(2))


CPCFL = clustered_recipe(
    {"cpcfl": {"num_clusters": 2, "switch_round": 1, "pretrain": {"epochs": 1, "batch_size": 32}}}
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "raw,module", [(CPCFL, "fedkit_plugins.cpcfl"), (fedca_recipe(), "fedkit_plugins.fedca")]
)
def test_resume_does_not_pre_train_again_and_plugins_leave_the_run_dir_alone(
    raw, module, tmp_path, monkeypatch
):
    import importlib

    plugin = importlib.import_module(module)
    calls = []
    original = plugin.pretrain_encoder

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(plugin, "pretrain_encoder", counted)
    recipe = validate(raw)
    plain = prepare(recipe)  # no run directory at all
    expected = [run_round(plain, r) for r in (1, 2)]
    assert len(calls) == 1
    out = tmp_path / "run"
    run = runs.start(recipe, out)
    runs.commit(run, out, [run_round(run, 1)], 1)
    assert len(calls) == 2
    resumed, done = runs.resume(out)
    assert done == 1 and len(calls) == 2  # kept by the core, not trained again
    assert run_round(resumed, 2) == expected[1]
    logs = {"metrics.jsonl", "clients.jsonl", "ledger.jsonl", "failures.jsonl"}
    core = {"recipe.yaml", "partition.json", "classes.json", "checkpoints", "clients"}
    core_files = {*core, *logs}
    assert {p.name for p in out.iterdir()} == core_files


def test_every_hook_states_its_side():
    for name in hook_names():
        assert hook_side(name) in ("registry", "server", "client", "simulation")
    assert StateStore is not None
