"""Nothing a Flower node receives can make it run code: the setup is data (the recipe,
key lists, the template's tensors), a node rebuilds the model with the plugins installed
on it, no function on a message-reading path unpickles, evaluates or imports a name, and
a node runs only the plugins its operator allows."""

from __future__ import annotations

import ast
import io
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import prepared, tiny_recipe

from fedkit.errors import FedkitError, RecipeError

pytest.importorskip("flwr", reason="the flower extra is not installed")

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, Metadata  # noqa: E402

from fedkit.core.engine import jobs  # noqa: E402
from fedkit.flower.flower_executor import refuse_uninstalled, setup_content  # noqa: E402
from fedkit.flower.node import SETUP, TEMPLATE, NodeHost  # noqa: E402
from fedkit.flower.records import META, eval_content, get_meta, job_content, result_of  # noqa: E402
from fedkit.flower.runner import answer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

MESSAGE_PATH = [
    "fedkit/flower/records.py",
    "fedkit/flower/node.py",
    "fedkit/flower/runner.py",
    "fedkit/flower/clientapp.py",
    "fedkit/flower/serverapp.py",
    "fedkit/flower/server_root.py",
    "fedkit/flower/flower_executor.py",
    "fedkit/flower/secagg.py",
    "fedkit/core/setup_data.py",
    "fedkit/core/messages.py",
    "fedkit/rundir/store.py",
]
"""The modules that read what arrives in a message, on a node or on the server."""


def short(text: str) -> bytes:
    raw = text.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def payload(target: Path) -> bytes:
    """The issue's pickle: ``collections._sys.modules.get("os")``, then
    ``getattr(os, "system")("touch TARGET")``, in protocol 4's dotted global names."""
    return (
        b"\x80\x04"
        + short("builtins") + short("getattr") + b"\x93"
        + short("collections") + short("_sys.modules.get") + b"\x93"
        + short("os") + b"\x85R"
        + short("system") + b"\x86R"
        + short(f"touch {target}") + b"\x85R."
    )  # fmt: skip


class Touch:
    """An object whose unpickling runs a command (the ``__reduce__`` way)."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.target}",)


@pytest.fixture(scope="module")
def run():
    opened = prepared(tiny_recipe(plugins=["fedavg"], federation={"clients_per_round": 2}))
    yield opened
    opened.close()


def incoming(content, kind: str = "query") -> Message:
    meta = Metadata(
        run_id=1, message_id="m", src_node_id=1, dst_node_id=2, reply_to_message_id="",
        group_id="", created_at=0.0, ttl=3600, message_type=kind,
    )  # fmt: skip
    return Message(content, metadata=meta)


def hostile_setups(run, target: Path):
    """A real setup message with a pickle put where each part of one could be, and
    whether the node must refuse it (a pickle in a record it never reads is ignored)."""
    import json

    def fresh(token: str):
        return setup_content(run.executor.setup, run.executor, None, token)

    old = fresh("old")  # the setup as it used to be: the recipe beside a pickle
    meta = get_meta(old)
    legacy = {**{k: v for k, v in meta.items() if k != "setup"}, "trusted": ["collections"]}
    legacy["recipe"] = meta["setup"]["recipe"]
    old[META] = ConfigRecord({"json": json.dumps(legacy)})
    old[SETUP] = ConfigRecord({"bytes": payload(target)})
    del old[TEMPLATE]
    yield "an old-style pickled setup", old, True

    beside = fresh("beside")
    beside[SETUP] = ConfigRecord({"bytes": payload(target)})
    yield "a pickle beside a valid setup", beside, False

    in_meta = fresh("meta")
    meta = get_meta(in_meta)
    meta["setup"]["recipe"] = payload(target).decode("latin-1")
    in_meta[META] = ConfigRecord({"json": json.dumps(meta)})
    yield "a pickle as the recipe", in_meta, True

    buffer = io.BytesIO()
    np.save(buffer, np.array([Touch(target)], dtype=object), allow_pickle=True)
    in_array = fresh("array")
    template = in_array[TEMPLATE]
    data = buffer.getvalue()
    template[next(iter(template))] = Array(
        dtype="object", shape=(1,), stype="numpy.ndarray", data=data
    )
    yield "a pickled object array as the template", in_array, True

    raw = fresh("raw")
    raw[TEMPLATE] = ArrayRecord(
        {"float32": Array(dtype="float32", shape=(4,), stype="numpy.ndarray", data=payload(target))}
    )
    yield "a pickle as an array's bytes", raw, True


def test_the_payload_is_live(tmp_path):
    """The pickles the node is handed below do run a command when unpickled."""
    target = tmp_path / "owned"
    pickle.loads(payload(target))
    assert target.exists()
    target.unlink()
    buffer = io.BytesIO()
    np.save(buffer, np.array([Touch(target)], dtype=object), allow_pickle=True)
    buffer.seek(0)
    np.load(buffer, allow_pickle=True)
    assert target.exists()


def test_a_node_handed_a_pickle_refuses_the_setup_and_runs_nothing(run, tmp_path):
    target = tmp_path / "owned"
    from flwr.app import RecordDict

    for name, content, refused in hostile_setups(run, target):
        host = NodeHost()
        reply = answer(host, incoming(content), RecordDict(), 0)
        assert not target.exists(), name
        assert reply.has_error() is refused, name
        if refused:
            assert host.runs == {}, name  # no run was set up


def test_no_function_on_a_message_path_unpickles_evaluates_or_imports_a_name():
    banned_modules = {"pickle", "_pickle", "marshal", "dill", "cloudpickle", "shelve", "importlib"}
    banned_calls = {"eval", "exec", "compile", "__import__"}
    for relative in MESSAGE_PATH:
        tree = ast.parse((ROOT / relative).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
                assert not names & banned_modules, (relative, names)
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] not in banned_modules, relative
            elif isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                called = ast.unparse(func).removeprefix("builtins.")
                assert called not in banned_calls, (relative, node.lineno)
                if name == "load" and ast.unparse(func) in {"torch.load", "np.load", "numpy.load"}:
                    flags = {k.arg: ast.unparse(k.value) for k in node.keywords}
                    assert flags.get("weights_only") == "True" or "allow_pickle" not in flags, (
                        relative,
                        node.lineno,
                    )
                    assert flags.get("allow_pickle") != "True", (relative, node.lineno)


def test_a_node_answers_setup_train_and_evaluate_with_unpickling_impossible(run, monkeypatch):
    """Every unpickler and ``torch.load`` raise while a node is set up, trains and is
    evaluated: no step of it needs them."""
    from flwr.app import RecordDict

    def refuse(*args, **kwargs):
        raise AssertionError("a message path unpickled")

    class Refusing(pickle.Unpickler):
        def load(self):
            refuse()

    for module, name, value in (
        (pickle, "loads", refuse), (pickle, "load", refuse), (pickle, "Unpickler", Refusing),
        (torch, "load", refuse),
    ):  # fmt: skip
        monkeypatch.setattr(module, name, value)
    host, state = NodeHost(), RecordDict()
    setup = setup_content(run.executor.setup, run.executor, None, "clean")
    assert get_meta(host.handle("query", setup, state, 1))["client"] == 1
    run.record.round = 1
    (job,) = jobs(run, [1])
    result, need = result_of(host.handle("train", job_content(job, [0], None), state, 1))
    assert need is None and result.failure is None
    assert set(result.upload) == set(run.server.pool[0])
    from fedkit.core.messages import EvalJob

    ask = EvalJob(1, 1, 0, job.lr, run.server.pool[0], ("accuracy",))
    scores = get_meta(host.handle("evaluate", eval_content(ask, [1, 0]), state, 1))
    assert "accuracy" in scores["metrics"]


def test_a_rebuilt_setup_holds_the_servers_template_exactly(run):
    from flwr.app import RecordDict

    host, state = NodeHost(), RecordDict()
    host.handle("query", setup_content(run.executor.setup, run.executor, None, "t"), state, 0)
    rebuilt = host.runs["t"]["setup"]
    sent = run.executor.setup
    assert str(rebuilt.template) == str(sent.template)
    theirs, ours = sent.template.state_dict(), rebuilt.template.state_dict()
    assert theirs.keys() == ours.keys()
    assert all(torch.equal(theirs[k], ours[k]) and theirs[k].dtype == ours[k].dtype for k in ours)
    assert (rebuilt.private, rebuilt.kept, rebuilt.auxiliary) == (
        sent.private,
        sent.kept,
        sent.auxiliary,
    )


def test_a_node_runs_only_the_plugins_its_operator_allows(run):
    from flwr.app import RecordDict

    content = setup_content(run.executor.setup, run.executor, None, "allow")
    refused = NodeHost(allow=frozenset({"fedprox"}))
    with pytest.raises(FedkitError, match=r"plugin 'fedavg'.*allows only fedprox"):
        refused.handle("query", content, RecordDict(), 0)
    assert refused.runs == {}
    reply = answer(refused, incoming(content), RecordDict(), 0)
    assert reply.has_error() and "allows only fedprox" in reply.error.reason
    allowed = NodeHost(allow=frozenset({"fedavg"}))
    assert get_meta(allowed.handle("query", content, RecordDict(), 0))["client"] == 0


def test_a_recipe_naming_a_plugin_the_node_lacks_is_refused_by_name(run):
    from flwr.app import RecordDict

    content = setup_content(run.executor.setup, run.executor, None, "missing")
    meta = get_meta(content)
    meta["setup"]["recipe"]["plugins"] = ["fedavg", "not_installed_here"]
    content[META] = ConfigRecord({"json": __import__("json").dumps(meta)})
    with pytest.raises(FedkitError, match="'not_installed_here': it is not installed here"):
        NodeHost().handle("query", content, RecordDict(), 0)


def test_the_server_refuses_an_in_process_plugin_before_sending_anything(run):
    """Nodes run only installed plugins, so the flower executor refuses a recipe whose
    plugin was handed over in-process (``fedkit.run(plugins=...)``)."""
    import dataclasses

    from fedkit_plugins.fedavg import FedAvg

    setup = dataclasses.replace(run.executor.setup, available={"fedavg": FedAvg})
    with pytest.raises(RecipeError, match="plugins.0") as info:
        refuse_uninstalled(setup)
    assert "installed" in str(info.value)


def test_deploy_node_refuses_an_allow_list_of_unknown_plugins(tmp_path):
    from typer.testing import CliRunner

    from fedkit.cli.app import app

    args = ["deploy", "node", "--superlink", "127.0.0.1:1", "--partition", "0", "--insecure"]
    args += ["--dir", str(tmp_path / "node"), "--allow", "fedavg,nosuchplugin"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert "--allow" in result.output and "nosuchplugin" in result.output
    assert "Traceback" not in result.output


def test_a_reply_naming_another_client_or_malformed_is_refused_not_fatal(run):
    """A node's reply is checked before it is read as a result: one that names another
    client, asks for a cluster outside the pool, or is not a reply fedkit writes is
    refused (the client's failure), never an exception that ends the run."""
    from fedkit.core.messages import ClientResult
    from fedkit.flower.flower_executor import MalformedReply, read_reply
    from fedkit.flower.records import message, result_content

    upload = {k: v.clone() for k, v in run.server.pool[0].items()}
    good = ClientResult(3, 0, 10.0, upload, [0], {"loss": 0.5})
    content = result_content(good, lambda key: "model")
    result, need = read_reply(content, result_of, 3, 1)
    assert result.client == 3 and need is None and set(result.upload) == set(upload)
    with pytest.raises(MalformedReply, match="names client 3"):
        read_reply(content, result_of, 4, 1)
    asking = result_content(ClientResult.failed(3, "", ""), lambda key: "model", need=7)
    with pytest.raises(MalformedReply, match="cluster 7"):
        read_reply(asking, result_of, 3, 2)
    with pytest.raises(MalformedReply, match="malformed"):
        read_reply(message({"client": 3}), result_of, 3, 1)


def test_a_jobs_learning_rate_crosses_as_a_json_number_and_is_checked_on_arrival(run):
    """The round's learning rate travels in the job's JSON value, exactly (a float's JSON
    text reads back to the same float); a node refuses a job whose rate is not a finite
    number, rather than training with it."""
    from fedkit.core.messages import EvalJob
    from fedkit.flower.records import eval_of, job_of

    run.record.round = 2
    (job,) = jobs(run, [1])
    job.lr = 0.1 + 0.2  # a float without a short decimal form
    assert job_of(job_content(job, [0], None)).lr == job.lr
    ask = EvalJob(2, 1, 0, job.lr, run.server.pool[0], ("accuracy",))
    assert eval_of(eval_content(ask, None)).lr == job.lr
    for bad in ("0.1", None, True, float("nan"), -1.0, [0.1]):
        content = job_content(job, [0], None)
        content[META] = ConfigRecord({"json": json.dumps({**get_meta(content), "lr": bad})})
        with pytest.raises(ValueError, match="learning rate must be a finite number"):
            job_of(content)
