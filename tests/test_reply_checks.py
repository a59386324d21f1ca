"""Everything that crosses is typed and booked: what a client reports is a number, a bool
or a short string (else the run stops naming the plugin and the key), its bytes are in
the ledger, and every reply is checked on the server before any hook sees it."""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap

import numpy as np
import pytest
import torch
from conftest import client_context, prepared, tiny_recipe
from typer.testing import CliRunner

import fedkit.cli.app
from fedkit import PluginOptions, hookimpl
from fedkit.cli.app import app
from fedkit.core import reply_checks
from fedkit.core.engine import run_round
from fedkit.core.messages import EvalResult
from fedkit.core.runs import run as run_recipe
from fedkit.core.worker import Worker
from fedkit.errors import RoundFailed
from fedkit.plugin.ledger import TENSOR_FIELDS
from fedkit.plugin.reported import MAX_TEXT, MAX_VALUES, MetricError
from fedkit.rundir.logs import read_failures, read_ledger

# ----------------------------------------------------------- typed: ctx.log and the CLI

LEAKY = '''
from fedkit import PluginOptions, hookimpl


class Leaky:
    """Logs a whole tensor, or a string of 1 MB, from a client hook."""

    class Options(PluginOptions):
        kind: str = "tensor"

    def __init__(self, options):
        self.options = options

    @hookimpl
    def after_local_train(self, ctx, model):
        if self.options.kind == "tensor":
            ctx.log(embedding=next(model.parameters()).detach())
        else:
            ctx.log(embedding="x" * 2**20)
'''


def install_leaky(root):
    """An installed distribution whose entry point is the hidden client plugin."""
    (root / "leaky_plugin.py").write_text(textwrap.dedent(LEAKY))
    info = root / "leaky_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: leaky-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fedkit]\nleaky = leaky_plugin:Leaky\n")


@pytest.mark.parametrize(
    ("kind", "found"), [("tensor", "a Tensor of shape"), ("text", "a string of 1048576")]
)
def test_a_plugin_that_logs_a_tensor_or_a_long_string_stops_the_run_naming_it(
    kind, found, tmp_path, write_recipe, monkeypatch
):
    site = tmp_path / "site"
    site.mkdir()
    install_leaky(site)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(fedkit.cli.app.console, "width", 200)
    recipe = write_recipe(
        tiny_recipe(plugins=["fedavg", {"leaky": {"kind": kind}}], federation={"rounds": 1})
    )
    ran = CliRunner().invoke(app, ["run", str(recipe), "--out", str(tmp_path / "out"), "-q"])
    assert ran.exit_code == 2, ran.output
    assert "Traceback" not in ran.output
    message = " ".join(ran.output.split())
    assert "plugin 'leaky' in hook 'after_local_train'" in message
    assert "'embedding'" in message and found in message
    assert "x" * 100 not in ran.output  # the value itself is not printed


def test_ctx_log_takes_numbers_bools_short_strings_and_numpy_scalars():
    ctx = client_context(tiny_recipe())
    ctx.log(a=1, b=0.5, c=True, d="x" * MAX_TEXT, e=np.float32(0.25), f=np.int64(3))
    ctx.log(g=np.bool_(False), h=math.nan)
    logged = ctx.logged
    assert [type(logged[k]) for k in "abcdefg"] == [int, float, bool, str, float, int, bool]
    assert logged["e"] == 0.25 and math.isnan(logged["h"])
    bad = [torch.tensor(1.0), np.zeros(2), [1], {"a": 1}, None, "x" * (MAX_TEXT + 1), 2**64]
    for value in bad:
        with pytest.raises(MetricError, match="'z'"):
            ctx.log(z=value)
    assert "z" not in ctx.logged
    with pytest.raises(MetricError, match=f"the {MAX_VALUES}"):
        ctx.log(**{f"m{i}": i for i in range(MAX_VALUES)})


class LogsInEvaluation:
    @hookimpl
    def evaluate_client(self, ctx, model):
        ctx.log(per_class=[0.5, 0.25])


def test_a_bad_score_in_evaluation_names_the_plugin_too():
    run = prepared(tiny_recipe(plugins=["fedavg", "scores"]), scores=LogsInEvaluation())
    with pytest.raises(MetricError, match="plugin 'scores' in hook 'evaluate_client'.*per_class"):
        run_round(run, 1)
    run.close()


# ----------------------------------------------------------------------------- booked


class Tap:
    """Wraps an executor and keeps every reply it hands the engine."""

    def __init__(self, inner):
        self.inner, self.results, self.scores = inner, [], []

    def run(self, jobs):
        for result in self.inner.run(jobs):
            self.results.append(result)
            yield result

    def evaluate(self, jobs):
        for result in self.inner.evaluate(jobs):
            self.scores.append(result)
            yield result

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Reports:
    """Reports values of every allowed type (a numpy scalar among them)."""

    @hookimpl
    def after_local_train(self, ctx, model):
        ctx.log(visits=ctx.participations, odd=ctx.id % 2 == 1, note=f"client {ctx.id} ✓")
        ctx.log(ratio=np.float32(0.125))

    @hookimpl
    def evaluate_client(self, ctx, model):
        ctx.log(seen=len(ctx.test))


def encoded(values) -> int:
    """The bytes the ledger's docstring defines for reported values."""
    return sum(
        len(k.encode()) + len(json.dumps(v, separators=(",", ":"), ensure_ascii=False).encode())
        for k, v in values.items()
    )


def test_reported_values_are_booked_and_the_total_is_everything_that_crossed():
    run = prepared(tiny_recipe(plugins=["fedavg", "reports"]), reports=Reports())
    tap = run.executor = Tap(run.executor)
    size = sum(v.nbytes for v in run.server.pool[0].values())
    rows = [run_round(run, r) for r in (1, 2)]
    ledger = run.server.ledger.to_rows()
    crossed = 0
    for r in (1, 2):
        results, scores = tap.results[3 * (r - 1) : 3 * r], tap.scores[3 * (r - 1) : 3 * r]
        for res, score in zip(results, scores, strict=True):
            row = next(x for x in ledger if (x["round"], x["client"]) == (r, res.client))
            assert res.metrics["note"] == f"client {res.client} ✓"
            assert row["up_metrics"] == encoded(res.metrics) > 0
            assert row["eval_metrics"] == encoded(score.metrics) > 0
            crossed += sum(t.nbytes for t in res.upload.values()) + encoded(res.metrics)
            crossed += size * len(res.fetched) + size + encoded(score.metrics)  # down, eval
    assert sum(row["bytes"]["total"] for row in rows) == run.server.ledger.totals()["total"]
    assert run.server.ledger.totals()["total"] == crossed
    assert sum(run.server.ledger.totals()[f] for f in TENSOR_FIELDS) < crossed
    run.close()


def test_a_checkpoint_without_the_metrics_fields_resumes_with_zero():
    from fedkit.plugin.ledger import Ledger

    old = {f: 1 for f in TENSOR_FIELDS}  # a fedkit before the metrics fields
    ledger = Ledger()
    ledger.restore(old)
    assert ledger.totals()["up_metrics"] == ledger.totals()["eval_metrics"] == 0
    assert ledger.totals()["total"] == len(TENSOR_FIELDS)


# ---------------------------------------------------------------------------- checked

SEEN: list[tuple[int, list[int]]] = []


class Recorder:
    """A server plugin that records which clients' uploads ``aggregate`` receives."""

    @hookimpl
    def aggregate(self, server, cluster, uploads):
        SEEN.append((server.round, sorted(u.client for u in uploads)))
        for u in uploads:
            assert all(torch.isfinite(t).all() for t in u.tensors.values() if t.is_floating_point())
        return {}


class Tamper:
    """Sends a reply the server must refuse, from the clients named."""

    class Options(PluginOptions):
        mode: str
        clients: list[int] = [0]

    def __init__(self, options):
        self.options = options

    @hookimpl
    def private_keys(self, server, model):
        return ["classifier.bias"] if self.options.mode == "private" else []

    @hookimpl
    def auxiliary_keys(self, server):
        return ["tamper.aux*"]

    @hookimpl
    def upload_selection(self, ctx, local, model):
        if self.options.mode == "private" and ctx.id in self.options.clients:
            return {"classifier.bias": local["classifier.bias"]}
        return {}

    @hookimpl
    def process_upload(self, ctx, upload):
        if ctx.id not in self.options.clients:
            return None
        out, mode = dict(upload), self.options.mode
        key = "encoder.conv1.0.weight"
        if mode == "shape":
            out[key] = torch.zeros(out[key].numel())
        elif mode == "dtype":
            out[key] = out[key].double()
        elif mode == "data":
            out["tamper.features"] = torch.zeros(3)
        elif mode == "oversized":
            template = sum(v.nbytes for v in ctx.received.values())
            out["tamper.aux_big"] = torch.zeros(template * reply_checks.EXTRA_FACTOR // 4 + 1)
        elif mode == "nan":
            out[key] = out[key].clone()
            out[key].view(-1)[3] = math.nan
        elif mode == "metrics":
            ctx._metrics["leak"] = [1.0, 2.0]  # past ctx.log, as another program could send
        return out


REASONS = {
    "shape": "'encoder.conv1.0.weight': expected the template's",
    "dtype": "torch.float32 (or a narrower floating dtype), found (",
    "private": "'classifier.bias': a private key",
    "data": "'tamper.features': neither a model key nor a declared auxiliary one",
    "oversized": "'tamper.aux_big': auxiliary and data-derived tensors of",
    "nan": "'encoder.conv1.0.weight': expected finite values",
    "metrics": "metric 'leak': found a list of 2 items",
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(REASONS))
def test_a_bad_reply_is_refused_before_any_hook_and_recorded(mode, tmp_path, monkeypatch):
    if mode == "nan":  # a client that does not check its own upload (another program)
        monkeypatch.setattr(Worker, "check_upload", lambda *args: None)
    SEEN.clear()
    raw = tiny_recipe(
        plugins=["fedavg", {"tamper": {"mode": mode}}, "recorder"],
        federation={"rounds": 2},
        evaluation={"protocol": "none"},
    )
    result = run_recipe(raw, out=tmp_path, plugins={"tamper": Tamper, "recorder": Recorder()})
    assert SEEN == [(1, [1, 2]), (2, [1, 2])]  # client 0's reply reached no hook
    for row in result.rows:
        assert set(row["failures"]) == {"0"}
        assert row["failures"]["0"].startswith(
            "refused: upload key" if mode != "metrics" else "refused: metric"
        )
        assert REASONS[mode] in row["failures"]["0"]
    failures = read_failures(tmp_path)
    assert [(f["round"], f["client"]) for f in failures] == [(1, 0), (2, 0)]
    assert all(REASONS[mode] in f["error"] for f in failures)
    for entry in read_ledger(tmp_path):  # a refused reply is not booked, its download is
        if entry["client"] == 0:
            assert entry["down_model"] > 0
            assert entry["up_model"] == entry["up_aux"] == entry["up_data"] == 0
            assert entry["up_metrics"] == 0


def test_the_round_stops_when_refusals_break_the_quorum(tmp_path):
    raw = tiny_recipe(
        plugins=["fedavg", {"tamper": {"mode": "dtype", "clients": [0, 2]}}],
        federation={"rounds": 2, "min_clients": 2},
        evaluation={"protocol": "none"},
    )
    with pytest.raises(RoundFailed, match="1 of 3 clients answered.*client 0: refused: upload key"):
        run_recipe(raw, out=tmp_path, plugins={"tamper": Tamper})
    assert not read_failures(tmp_path)  # the round never completed; stops.jsonl says why


def test_replies_the_hooks_cannot_produce_are_refused_too():
    """A cluster outside the pool, a bad weight, bad fetches and a bad score, as a client
    running other code could send them."""
    run = prepared(tiny_recipe(plugins=["fedavg"]))
    tap = run.executor = Tap(run.executor)
    run_round(run, 1)
    good = tap.results[0]
    expected = run.expected
    assert reply_checks.refusal(good, expected, run.server) is None
    bad = {
        "cluster": dataclasses.replace(good, cluster=1),
        "weight": dataclasses.replace(good, weight=-1.0),
        "weight: expected a finite": dataclasses.replace(good, weight=math.inf),
        "fetched": dataclasses.replace(good, fetched=[0, 0]),
        "fetched: expected distinct": dataclasses.replace(good, fetched=[3]),
        "upload key 'x'": dataclasses.replace(good, upload={**good.upload, "x": [1.0]}),
        "metrics": dataclasses.replace(good, metrics="loss=1"),
    }
    for reason, result in bad.items():
        refused = reply_checks.checked(result, expected, run.server)
        assert refused.failure == "refused" and refused.error.startswith(reason), reason
        assert refused.upload == {} and refused.metrics == {}
    assert reply_checks.checked(bad["fetched"], expected, run.server).fetched == [0]
    loud = dataclasses.replace(good, failure="exception" * 10, error="x" * 10**6, fetched=[0, 9])
    failed = reply_checks.checked(loud, expected, run.server)  # a failure is text, kept short
    assert failed.fetched == [0] and failed.upload == {}
    assert len(failed.failure) == reply_checks.KIND_LENGTH
    assert len(failed.error) == reply_checks.ERROR_LENGTH
    half = {k: v.half() if v.is_floating_point() else v for k, v in good.upload.items()}
    compressed = dataclasses.replace(good, upload=half)  # a documented process_upload
    assert reply_checks.refusal(compressed, expected, run.server) is None
    counter = next(k for k, v in good.upload.items() if not v.is_floating_point())
    as_float = dataclasses.replace(good, upload={**good.upload, counter: torch.zeros(())})
    reason = reply_checks.refusal(as_float, expected, run.server)
    assert reason.startswith(f"upload key {counter!r}: expected the template's () torch.int64,")
    score = EvalResult(0, {"accuracy": 0.5, "confusion": [[1, 0], [0, 1]]})
    refused = reply_checks.checked_scores(score)
    assert refused.failure == "refused" and "metric 'confusion'" in refused.error
    assert reply_checks.checked_scores(EvalResult(0, {"accuracy": 0.5})).failure is None
    run.close()
